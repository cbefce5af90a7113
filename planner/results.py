"""Measured results files -> calibrations: one measured campaign improves every later plan for that GPU.

A results file is what ``benchmarks/gpu_campaign.py`` writes (``fidelity.json``, ``grid.json``): JSON with
``"format": "optplan-results/1"``, an ``env`` record (device, driver, CUDA, torch, packages, commit) and
``measured``, a list of :class:`MeasuredCase` (the GPU's catalogue name, the model's profile hash, the
torch version, and the :class:`~optplan.planner.calibrate.ProbeComparison` of one real run: the strategy,
its predicted step parts and allocated bytes, and the probe's measurements).

:func:`calibrations_from_results` groups the measured cases of any number of files by calibration key
(GPU, model hash, torch version) and fits each group with ``calibrate.fit_calibration``, the same fit the
probe stage uses, so the cache (``calibrate.save_calibration``) holds one entry format whichever way the
measurements came. A ``measurements.json`` that a generated train.py wrote (``"format":
"optplan-measurements/1"``, :func:`case_from_measurements`) is one more measured case: a real run of a plan at
its full scale, with the plan's prediction carried in it. Each fit reports how far the predictions of its own runs were from the measurements
before and after it (median absolute relative error, %), so a user sees what the calibration buys.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from optplan.estimators.calibration import Calibration, torch_release
from optplan.estimators.errors import OptplanError
from optplan.estimators.strategy import Strategy
from optplan.planner.calibrate import (
    MEMORY_RATIO_BOUNDS,
    TIME_NOT_CALIBRATED,
    TIME_RATIO_BOUNDS,
    ProbeComparison,
    fit_calibration,
    median_abs_error,
    plausible,
)
from optplan.probes.model_errors import one_line
from optplan.probes.runtime import ProbeResult, ProbeSpec

RESULTS_FORMAT = "optplan-results/1"
MEASUREMENTS_FORMAT = "optplan-measurements/1"
"""What a generated train.py writes (``optplan.probes.trainloop``): one run of a plan, at its full scale."""


class MeasuredCase(BaseModel):
    """One measured run in a results file and what was predicted for it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str = Field(description="catalogue name of the GPU it ran on ('' or 'cpu' when none)")
    model: str = Field(description="a readable model name")
    model_hash: str = Field(description="calibrate.profile_hash of the model's profile")
    torch_version: str = ""
    comparison: ProbeComparison


class CalibrationFit(BaseModel):
    """A calibration fitted from results files, with the error of its own runs before and after (%)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    calibration: Calibration
    model: str
    runs: int = Field(ge=0, description="measured runs in the group (ok or not)")
    time_error_before_pct: float | None = None
    time_error_after_pct: float | None = None
    memory_error_before_pct: float | None = None
    memory_error_after_pct: float | None = None

    def line(self) -> str:
        c = self.calibration
        parts = [f"{c.gpu} {self.model} (torch {c.torch_version or '?'}): {self.runs} run(s)"]
        refused = c.source.find(TIME_NOT_CALIBRATED)
        if refused >= 0:  # one scale would have fitted its own runs worse: the step time stays uncalibrated
            parts.append("step " + c.source[refused:].split("; ")[0])  # fit_calibration joins its parts with "; "
        parts.extend(part.removeprefix("results files: ") for part in c.source.split("; ")
                     if "left out of" in part)  # implausible runs (TIME_RATIO_BOUNDS, MEMORY_RATIO_BOUNDS)
        if refused < 0 and self.time_error_before_pct is not None and self.time_error_after_pct is not None:
            parts.append(f"step time error {self.time_error_before_pct:.1f}% -> {self.time_error_after_pct:.1f}% "
                         f"(compute x {c.compute_scale:.3f}, communication x {c.comm_scale:.3f})")
        if self.memory_error_before_pct is not None and self.memory_error_after_pct is not None:
            parts.append(f"allocated memory error {self.memory_error_before_pct:.1f}% -> "
                         f"{self.memory_error_after_pct:.1f}% (x {c.allocated_scale:.3f})")
        return "; ".join(parts)


STRATEGY_MARKERS = frozenset({"engine", "mbs", "precision", "zero", "fsdp", "dp", "tp"})
"""Keys every recorded Strategy has, in every optplan version that wrote results (a results file nests strategies
in its cases)."""


def _eager_loss_if_unrecorded(node: Any) -> Any:
    """``node`` with every recorded strategy that has no ``compile_loss`` given ``compile_loss: false``: results
    files written before the training loop compiled its loss (it compiles it with the plan's ``compile`` now,
    estimators/compiled_loss.py) measured an eager loss, and must keep being priced as what ran."""
    if isinstance(node, list):
        return [_eager_loss_if_unrecorded(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _eager_loss_if_unrecorded(v) for k, v in node.items()}
    if STRATEGY_MARKERS <= out.keys() and "compile_loss" not in out:
        out["compile_loss"] = False
    return out


def read_results(path: Path) -> list[MeasuredCase]:
    """The measured cases of one results file; a one-line OptplanError naming the file and the fix."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise OptplanError(f"results file {path} not found: pass a measurements.json that train.py wrote, or "
                           "a fidelity.json or grid.json that benchmarks/gpu_campaign.py wrote") from None
    except IsADirectoryError:
        raise OptplanError(f"results file {path} is a folder: pass the measurements.json (or fidelity.json, grid.json) "
                           "in it") from None
    except OSError as exc:
        raise OptplanError(f"cannot read results file {path} ({exc.strerror or exc}): fix its permissions") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OptplanError(f"{path} is not JSON (line {exc.lineno}: {exc.msg}): pass a measurements.json that "
                           "train.py wrote, or a results file that benchmarks/gpu_campaign.py wrote") from None
    if isinstance(doc, dict) and doc.get("format") == MEASUREMENTS_FORMAT:
        return [case_from_measurements(doc, path)]
    if not isinstance(doc, dict) or doc.get("format") != RESULTS_FORMAT or not isinstance(doc.get("measured"), list):
        raise OptplanError(f"{path} is neither a train.py measurements file (\"format\": \"{MEASUREMENTS_FORMAT}\") "
                           f"nor an optplan results file (\"format\": \"{RESULTS_FORMAT}\" with a \"measured\" "
                           "list): pass the measurements.json an exported train.py wrote, or fidelity.json or "
                           "grid.json from benchmarks/gpu_campaign.py")
    out = []
    for i, entry in enumerate(doc["measured"]):
        try:
            out.append(MeasuredCase.model_validate(_eager_loss_if_unrecorded(entry)))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise OptplanError(f"{path}: measured[{i}].{where}: {first['msg']}; the file was edited or comes from "
                               "another optplan version: rerun the campaign") from None
    return out


def case_from_measurements(doc: dict[str, Any], path: Path) -> MeasuredCase:
    """The MeasuredCase of a train.py run (``measurements.json``): the plan's uncalibrated prediction (carried
    in its ``PLAN``) against what the run measured. Times count only when the run was on the plan's GPU
    (``match_device_name`` of the CUDA device name) at the plan's world size; a CPU run (live tensor bytes under
    optplan's tracker) calibrates the ``cpu`` memory accounting and nothing else."""
    from optplan.probes.hardware import match_device_name

    fix = "pass the measurements.json a train.py exported by optplan wrote, unedited"
    try:
        plan, measured, cluster = doc["plan"], doc["measured"], doc["cluster"]
        pred = plan.get("prediction")
        if not isinstance(pred, dict):
            raise OptplanError(f"{path}: the plan carries no prediction (exported from a --params plan or an older "
                               "optplan): re-export train.py with optplan recommend --out and run it again")
        # what ran: the loss compiled or not (files written before train.py recorded it ran it eagerly)
        strategy = Strategy.model_validate({**plan["strategy"], "compile_loss": bool(measured.get("loss_compiled"))})
        device = str(cluster["device"])
        world = int(cluster["world_size"])
        spec = match_device_name(str(cluster.get("device_name", ""))) if device == "cuda" else None
        gpu = spec.name if spec is not None else ("cpu" if device == "cpu" else "")
        comparable = device == "cuda" and gpu == plan.get("gpu") and world == int(plan["world_size"])
        on_cpu = device == "cpu"
        allocated = int(pred["cpu_allocated_bytes"] if on_cpu else pred["allocated_bytes"])
        torch_ver = str((doc.get("software") or {}).get("torch") or "")
        result = ProbeResult(
            spec=ProbeSpec(model_path=str(plan.get("model_file") or plan.get("model", "")), strategy=strategy,
                           ds_config={} if strategy.engine == "deepspeed" else None, device=device,  # type: ignore[arg-type]
                           nproc=world, warmup_steps=int(measured.get("warmup_steps", 0)),
                           timed_steps=max(1, len(measured.get("step_times_s", [])) - int(measured.get("warmup_steps", 0)))),
            status=measured.get("status", "ok"), device_name=str(cluster.get("device_name", "")),
            torch_version=torch_ver, world_size=world,
            step_times_s=tuple(measured.get("step_times_s", ())), step_s=measured.get("step_s"),
            peak_allocated_bytes=measured.get("peak_allocated_bytes"),
            peak_reserved_bytes=measured.get("peak_reserved_bytes"), non_torch_bytes=measured.get("non_torch_bytes"),
            losses=tuple(measured.get("losses", ())), samples_per_step=strategy.global_batch,
            notes=tuple(doc.get("notes", ())))
        comparison = ProbeComparison(
            candidate=strategy, probed=strategy,
            predicted_step_s=pred["uncalibrated_step_s"] if comparable else None,
            predicted_on_device_s=pred["uncalibrated_on_device_s"] if comparable else None,
            predicted_exposed_comm_s=pred["uncalibrated_exposed_comm_s"] if comparable else None,
            predicted_allocated_bytes=allocated, predicted_total_bytes=allocated if on_cpu else int(pred["total_bytes"]),
            time_comparable=comparable, result=result)
        return MeasuredCase(gpu=gpu, model=str(plan.get("model", "")), model_hash=str(pred["model_hash"]),
                            torch_version=torch_ver, comparison=comparison)
    except OptplanError:
        raise
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "a value"
        raise OptplanError(f"{path}: {where} is {first.get('input')!r}: {first['msg'].lower()}; {fix}") from None
    except (KeyError, TypeError, ValueError) as exc:
        what = f"missing {exc}" if isinstance(exc, KeyError) else one_line(str(exc), 160)
        raise OptplanError(f"{path}: not a complete train.py measurements file ({what}): {fix}") from None


def _median_pct(pairs: Sequence[tuple[float, float]]) -> float | None:
    err = median_abs_error(pairs)
    return None if err is None else 100.0 * err


def _calibrated_step_s(c: ProbeComparison, cal: Calibration) -> float | None:
    if c.predicted_on_device_s is None or c.predicted_exposed_comm_s is None:
        return None
    return cal.compute_scale * c.predicted_on_device_s + cal.comm_scale * c.predicted_exposed_comm_s


def calibrations_from_results(paths: Sequence[Path]) -> list[CalibrationFit]:
    """One fitted calibration per (GPU, model hash, torch release) over every measured case of ``paths``,
    in first-seen order; groups without a usable measurement (nothing ok) are left out. CPU runs (``gpu``
    "cpu") fit memory only: their times are not comparable with a GPU's."""
    groups: dict[tuple[str, str, str], list[MeasuredCase]] = {}
    for path in paths:
        for case in read_results(path):
            if not case.gpu:
                continue  # a GPU outside the catalogue: no plan can use its calibration
            groups.setdefault((case.gpu, case.model_hash, torch_release(case.torch_version)), []).append(case)
    fits = []
    for (gpu, model_hash, torch_ver), cases in groups.items():
        comps = [c.comparison for c in cases]
        cal = fit_calibration(comps, gpu=gpu, model_hash=model_hash, torch_version=torch_ver)
        if cal is None:
            continue
        ok = [c for c in comps if c.result.status == "ok"]
        timed = [(c, s) for c in ok if c.time_comparable and c.result.step_s and c.predicted_step_s
                 and plausible(c.time_ratio, TIME_RATIO_BOUNDS) and (s := _calibrated_step_s(c, cal)) is not None]
        mem = [c for c in ok if c.result.peak_allocated_bytes and c.predicted_allocated_bytes
               and plausible(c.memory_ratio, MEMORY_RATIO_BOUNDS)]
        fits.append(CalibrationFit(
            calibration=cal.model_copy(update={"source": f"results files: {cal.source}"}), model=cases[0].model,
            runs=len(cases),
            time_error_before_pct=_median_pct([(c.predicted_step_s, c.result.step_s) for c, _ in timed]),  # type: ignore[misc]
            time_error_after_pct=_median_pct([(s, c.result.step_s) for c, s in timed]),  # type: ignore[misc]
            memory_error_before_pct=_median_pct([(c.predicted_allocated_bytes, c.result.peak_allocated_bytes)  # type: ignore[misc]
                                                 for c in mem]),
            memory_error_after_pct=_median_pct([(c.predicted_allocated_bytes * cal.allocated_scale,  # type: ignore[misc]
                                                 c.result.peak_allocated_bytes) for c in mem])))
    return fits
