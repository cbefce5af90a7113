"""Fit a Calibration from probe runs (predicted vs measured), and keep it in a cache file.

A probe runs one candidate for a few steps on the local hardware (``optplan.probes.runtime``); its
strategy is the candidate scaled to what is local (see ``planner.probe_stage``), and the estimators
predict that same probed strategy. Each comparison gives measured ÷ predicted ratios:

* memory (every probe that ran): peak allocated bytes ÷ predicted allocated bytes (model states +
  activations + buffers; on the CPU, memory.py's CPU accounting), the caching-allocator margin
  (``max_memory_reserved`` ÷ ``max_memory_allocated`` − 1) and the bytes outside torch's allocator (CUDA
  context, NCCL); the median of each over the probes (robust to one odd probe);
* time (only when the probes ran on the GPU the plan is for): ``compute_scale`` is the median of measured
  ÷ predicted step time over probes whose predicted exposed communication is under 5 % of the step (the
  on-device parts), and ``comm_scale`` the median of (measured − compute_scale × on-device) ÷ predicted
  exposed communication over the others, clamped to [0.1, 10]. With only communicating probes,
  ``compute_scale`` takes communication at face value.

The cache (``calibration.json`` under ``$OPTPLAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/optplan`` or
``~/.cache/optplan``) maps ``GPU|model hash|torch version`` to the fitted Calibration, so later runs on
the same GPU, model and torch start calibrated. Writes are atomic (temp file + rename).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from optplan.estimators.calibration import Calibration, calibration_key
from optplan.estimators.errors import OptplanError
from optplan.estimators.profile import NUMERICS_FIELDS, RUN_FIELDS, ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.probes.cache_dir import cache_dir
from optplan.probes.runtime import ProbeResult

CACHE_FILE = "calibration.json"
COMM_FREE_FRACTION = 0.05
"""Probes whose predicted exposed communication is below this share of the step calibrate compute."""
COMM_SCALE_BOUNDS = (0.1, 10.0)
TIME_RATIO_BOUNDS = (0.1, 10.0)
"""Measured ÷ predicted step times outside these bounds are left out of the time fit. The worst real runs lie within
them: an early H200 visit measured timm's ResNet-50 under AMP at 5.4x the prediction of the time (tests/planner/
test_results.py), and published runs sit within 0.5-2x (benchmarks/results). A run 10x off is a run of something
else (another device, a broken or edited file); the plan-side guard (estimate.calibrate_estimate) still refuses a
scale that would beat the GPU's peak FLOP/s."""
MEMORY_RATIO_BOUNDS = (0.5, 2.0)
"""Measured ÷ predicted allocated bytes outside these bounds are left out of the memory fit (the accounting is
within 2 % on the CPU and 6.5 % on the GPU campaign's runs)."""
CACHE_FORMAT = 1


def plausible(ratio: float | None, bounds: tuple[float, float]) -> bool:
    """Whether a measured ÷ predicted ``ratio`` lies within ``bounds`` (``TIME_RATIO_BOUNDS``, ``MEMORY_RATIO_BOUNDS``)."""
    return ratio is not None and bounds[0] <= ratio <= bounds[1]


class ProbeComparison(BaseModel):
    """One probed candidate: what was predicted for the probed strategy and what the probe measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    candidate: Strategy = Field(description="the plan's strategy")
    probed: Strategy = Field(description="the strategy the probe ran (scaled to the local devices)")
    predicted_step_s: float | None = Field(default=None, description="the probed strategy's predicted step (s)")
    predicted_on_device_s: float | None = Field(default=None, description="its compute + memory-bound + "
                                                "optimizer + host + bubble parts (s)")
    predicted_exposed_comm_s: float | None = Field(default=None, description="its exposed communication (s)")
    predicted_allocated_bytes: int = Field(ge=0, description="model states + activations + buffers (bytes)")
    predicted_total_bytes: int = Field(ge=0, description="allocated + overhead (bytes)")
    time_comparable: bool = Field(description="the probe ran on the GPU the plan is for")
    result: ProbeResult

    @property
    def measured_step_s(self) -> float | None:
        return self.result.step_s

    @property
    def time_ratio(self) -> float | None:
        """Measured ÷ predicted step time (None when either is missing)."""
        if self.result.step_s is None or not self.predicted_step_s:
            return None
        return self.result.step_s / self.predicted_step_s

    @property
    def memory_ratio(self) -> float | None:
        """Measured peak allocated ÷ predicted allocated bytes (None when not measured)."""
        if self.result.peak_allocated_bytes is None or not self.predicted_allocated_bytes:
            return None
        return self.result.peak_allocated_bytes / self.predicted_allocated_bytes


ADAPTER_LATER_FIELDS = ("dropout", "quant_input_elements", "quant_input_unkept_elements", "bnb_4bit_keeps_inputs",
                        "graph_held_steps")
"""AdapterProfile fields added after calibrations were first keyed by profile hash."""


IDENTITY_FIELDS = ("name", "path")
"""ModelProfile fields that say where the model file is and what it is called, not what it computes: left out of
:func:`profile_hash`, so a calibration follows the model when the file moves, is renamed, or was measured on
another machine (a GPU campaign's results file) or through another cache folder (``--hf``'s generated file)."""


def profile_hash(profile: ModelProfile, *, with_identity: bool = False) -> str:
    """16 hex digits of SHA-256 over the profile (timings, notes, file path and name left out): same model, same
    hash, wherever its file is. A full-training
    profile leaves out ``adapter`` (None), a model without a tensor-parallel plan ``tensor_plan`` (None), and a
    transformer shape's unset ``head_dim``/``moe``/``mla`` and an adapter's
    :data:`ADAPTER_LATER_FIELDS` at their defaults, so hashes from before those fields existed still match;
    ``attention_key_heads`` is never hashed (the same reason; it prices context parallelism only).
    ``with_identity``: the hash as it was before 2026-11-30 (path and name included), which older cache entries
    and results files carry (:func:`profile_hashes`)."""
    skip: dict[str, object] = {name: True for name in RUN_FIELDS}
    if not with_identity:
        skip.update({name: True for name in IDENTITY_FIELDS})
    skip.update({name: True for name in ("adapter", "tensor_plan") if getattr(profile, name) is None})
    skip.update({name: True for name in ("sparse_grad_params", "self_recompute_flops_per_sample")
                 if not getattr(profile, name)})  # added later: count only when set
    # the K/V heads the attention call receives price context parallelism only, and a model that repeats its K/V
    # already hashes apart by its counted bytes: never in the key, so every key from before it existed still matches
    skip["attention_key_heads"] = True
    shape = profile.transformer
    if shape is not None:  # shape fields added later (head width, MoE, latent attention) count only when set
        unset = {name for name in ("head_dim", "moe", "mla") if getattr(shape, name) is None} | set(NUMERICS_FIELDS)
        if unset:
            skip["transformer"] = unset
    adapter = profile.adapter
    if adapter is not None:  # adapter fields added later (dropout, quantised layers' inputs) count only when set
        unset = {name for name in ADAPTER_LATER_FIELDS
                 if getattr(adapter, name) == type(adapter).model_fields[name].default}
        if unset:
            skip["adapter"] = unset
    doc = profile.model_dump(mode="json", exclude=skip)
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def profile_hashes(profile: ModelProfile) -> tuple[str, str]:
    """The keys a calibration for ``profile`` may be stored under: :func:`profile_hash`, then the older hash
    that also covered the file's path and name (entries written before it was left out)."""
    return profile_hash(profile), profile_hash(profile, with_identity=True)


def torch_version() -> str:
    """The installed torch's version string, read from package metadata (torch is not imported)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


TIME_NOT_CALIBRATED = "time not calibrated"
"""How ``Calibration.source`` begins the reason a fit left the step time uncalibrated (results.py prints it)."""


def median_abs_error(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Median of |predicted - measured| / measured over (predicted, measured) pairs (a fraction; None for none)."""
    errs = [abs(pred - meas) / meas for pred, meas in pairs if meas]
    return statistics.median(errs) if errs else None


def fit_calibration(comparisons: Sequence[ProbeComparison], *, gpu: str, model_hash: str,
                    torch_version: str = "") -> Calibration | None:
    """The Calibration the probes support (see the module docstring), or None when no probe measured."""
    measured = [c for c in comparisons if c.result.status == "ok"]
    all_mem = [r for c in measured if (r := c.memory_ratio) is not None]
    mem = [r for r in all_mem if plausible(r, MEMORY_RATIO_BOUNDS)]
    frag = [c.result.peak_reserved_bytes / c.result.peak_allocated_bytes - 1 for c in measured
            if c.result.peak_reserved_bytes and c.result.peak_allocated_bytes
            and c.result.peak_reserved_bytes >= c.result.peak_allocated_bytes]  # reserved holds what is allocated
    context = [c.result.non_torch_bytes for c in measured if c.result.non_torch_bytes is not None]
    all_timed = [c for c in measured if c.time_comparable and c.time_ratio is not None
                 and c.predicted_on_device_s is not None and c.predicted_exposed_comm_s is not None]
    timed = [c for c in all_timed if plausible(c.time_ratio, TIME_RATIO_BOUNDS)]
    implausible = _implausible(all_timed, timed, all_mem, mem)
    quiet = [c for c in timed if c.predicted_exposed_comm_s <= COMM_FREE_FRACTION * (c.predicted_step_s or 0)]  # type: ignore[operator]
    loud = [c for c in timed if c not in quiet]
    compute_scale, comm_scale = 1.0, 1.0
    if quiet:
        compute_scale = statistics.median(c.time_ratio for c in quiet)  # type: ignore[type-var]
    elif loud:
        compute_scale = statistics.median(max(1e-3, (c.measured_step_s - c.predicted_exposed_comm_s)  # type: ignore[operator]
                                                   / c.predicted_on_device_s) for c in loud if c.predicted_on_device_s)
    if quiet and loud:
        lo, hi = COMM_SCALE_BOUNDS
        ratios = [(c.measured_step_s - compute_scale * c.predicted_on_device_s) / c.predicted_exposed_comm_s  # type: ignore[operator]
                  for c in loud if c.predicted_exposed_comm_s]
        if ratios:
            comm_scale = min(hi, max(lo, statistics.median(ratios)))
    if not mem and not timed:
        return None
    parts = list(implausible)
    if mem:
        parts.append(f"memory from {len(mem)} probe(s)")
    before = median_abs_error([(c.predicted_step_s, c.measured_step_s) for c in timed]) or 0.0  # type: ignore[misc]
    after = median_abs_error([(compute_scale * c.predicted_on_device_s + comm_scale * c.predicted_exposed_comm_s,  # type: ignore[operator]
                               c.measured_step_s) for c in timed]) or 0.0  # type: ignore[misc]
    if timed and after >= before:  # one pair of scales misses these runs more than none: keep time uncalibrated
        ratios = sorted(c.time_ratio for c in timed)  # type: ignore[type-var]
        parts.append(f"{TIME_NOT_CALIBRATED}: one compute scale ({compute_scale:.3f}) would fit its {len(timed)} runs "
                     f"worse than none (median error {100 * before:.1f}% -> {100 * after:.1f}%, measured/predicted "
                     f"{ratios[0]:.2f}-{ratios[-1]:.2f}: the model misses something that differs between them)")
        timed, compute_scale, comm_scale = [], 1.0, 1.0
    elif timed:
        parts.append(f"time from {len(timed)} probe(s) ({len(quiet)} without communication)")
    return Calibration(
        gpu=gpu, model_hash=model_hash, torch_version=torch_version,
        compute_scale=compute_scale if timed else 1.0, comm_scale=comm_scale,
        allocated_scale=statistics.median(mem) if mem else 1.0,
        fragmentation_fraction=max(0.0, statistics.median(frag)) if frag else None,
        context_bytes=int(statistics.median(context)) if context else None,
        time_probes=len(timed), memory_probes=len(mem), source="; ".join(parts))


def _implausible(all_timed: Sequence[ProbeComparison], timed: Sequence[ProbeComparison], all_mem: Sequence[float],
                 mem: Sequence[float]) -> list[str]:
    """What the fit left out as implausible (``TIME_RATIO_BOUNDS``, ``MEMORY_RATIO_BOUNDS``), for its source."""
    out = []
    if len(timed) < len(all_timed):
        ratios = sorted(c.time_ratio for c in all_timed if c not in timed)  # type: ignore[type-var]
        lo, hi = TIME_RATIO_BOUNDS
        out.append(f"{len(ratios)} run(s) left out of time: measured/predicted {ratios[0]:.3g}-{ratios[-1]:.3g}, "
                   f"outside {lo:g}-{hi:g} (a run of another device or an edited file?)")
    if len(mem) < len(all_mem):
        ratios = sorted(r for r in all_mem if r not in mem)
        lo, hi = MEMORY_RATIO_BOUNDS
        out.append(f"{len(ratios)} run(s) left out of memory: measured/predicted {ratios[0]:.3g}-{ratios[-1]:.3g}, "
                   f"outside {lo:g}-{hi:g}")
    return out


# --- the cache -----------------------------------------------------------------------------------------

def cache_path(path: Path | None = None) -> Path:
    return path if path is not None else cache_dir() / CACHE_FILE


def _read_cache(path: Path) -> dict[str, dict[str, object]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise OptplanError(f"cannot read the calibration cache {path} ({exc.strerror or exc}); "
                           "fix its permissions or set OPTPLAN_CACHE_DIR to another folder") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("calibrations"), dict):
        raise OptplanError(f"the calibration cache {path} is not an optplan calibration file; delete it "
                           "(it is rebuilt by the next probe run) or set OPTPLAN_CACHE_DIR to another folder")
    return doc["calibrations"]


def load_calibration(gpu: str, model_hash: str | Sequence[str], torch_ver: str, *,
                     path: Path | None = None) -> Calibration | None:
    """The cached Calibration for this GPU, model and torch version, or None. ``model_hash``: one key, or
    several tried in order (:func:`profile_hashes`)."""
    cache = _read_cache(cache_path(path))
    hashes = (model_hash,) if isinstance(model_hash, str) else tuple(model_hash)
    entry = next((cache[k] for k in (calibration_key(gpu, h, torch_ver) for h in hashes) if k in cache), None)
    if entry is None:
        return None
    try:
        return Calibration.model_validate(entry)
    except ValidationError:
        return None  # an entry from another optplan version: ignored, replaced by the next probe run


def save_calibration(cal: Calibration, *, path: Path | None = None) -> Path:
    """Store ``cal`` under its key (other entries kept); atomic: temp file in the same folder + rename."""
    target = cache_path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        entries = _read_cache(target)
        entries[cal.key] = cal.model_dump(mode="json")
        text = json.dumps({"format": CACHE_FORMAT, "calibrations": entries}, indent=2, sort_keys=True)
        fd, tmp = tempfile.mkstemp(prefix=".calibration-", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(text + "\n")
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise OptplanError(f"cannot write the calibration cache {target} ({exc.strerror or exc}); "
                           "set OPTPLAN_CACHE_DIR to a writable folder") from None
    return target
