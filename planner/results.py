"""Measured results files -> calibrations: one measured campaign improves every later plan for that GPU.

A results file is what ``benchmarks/gpu_campaign.py`` writes (``fidelity.json``, ``grid.json``): JSON with
``"format": "optplan-results/1"``, an ``env`` record (device, driver, CUDA, torch, packages, commit) and
``measured``, a list of :class:`MeasuredCase` (the GPU's catalogue name, the model's profile hash, the
torch version, and the :class:`~optplan.planner.calibrate.ProbeComparison` of one real run: the strategy,
its predicted step parts and allocated bytes, and the probe's measurements).

:func:`calibrations_from_results` groups the measured cases of any number of files by calibration key
(GPU, model hash, torch version) and fits each group with ``calibrate.fit_calibration``, the same fit the
probe stage uses, so the cache (``calibrate.save_calibration``) holds one entry format whichever way the
measurements came. Each fit reports how far the predictions of its own runs were from the measurements
before and after it (median absolute relative error, %), so a user sees what the calibration buys.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from optplan.estimators.calibration import Calibration
from optplan.estimators.errors import OptplanError
from optplan.planner.calibrate import ProbeComparison, fit_calibration

RESULTS_FORMAT = "optplan-results/1"


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
        if self.time_error_before_pct is not None and self.time_error_after_pct is not None:
            parts.append(f"step time error {self.time_error_before_pct:.1f}% -> {self.time_error_after_pct:.1f}% "
                         f"(compute x {c.compute_scale:.3f}, communication x {c.comm_scale:.3f})")
        if self.memory_error_before_pct is not None and self.memory_error_after_pct is not None:
            parts.append(f"allocated memory error {self.memory_error_before_pct:.1f}% -> "
                         f"{self.memory_error_after_pct:.1f}% (x {c.allocated_scale:.3f})")
        return "; ".join(parts)


def read_results(path: Path) -> list[MeasuredCase]:
    """The measured cases of one results file; a one-line OptplanError naming the file and the fix."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise OptplanError(f"results file {path} not found: pass a fidelity.json or grid.json that "
                           "benchmarks/gpu_campaign.py wrote") from None
    except OSError as exc:
        raise OptplanError(f"cannot read results file {path} ({exc.strerror or exc}): fix its permissions") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OptplanError(f"{path} is not JSON (line {exc.lineno}: {exc.msg}): pass a results file that "
                           "benchmarks/gpu_campaign.py wrote") from None
    if not isinstance(doc, dict) or doc.get("format") != RESULTS_FORMAT or not isinstance(doc.get("measured"), list):
        raise OptplanError(f"{path} is not an optplan results file (no \"format\": \"{RESULTS_FORMAT}\" with a "
                           "\"measured\" list): pass fidelity.json or grid.json from benchmarks/gpu_campaign.py")
    out = []
    for i, entry in enumerate(doc["measured"]):
        try:
            out.append(MeasuredCase.model_validate(entry))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise OptplanError(f"{path}: measured[{i}].{where}: {first['msg']}; the file was edited or comes from "
                               "another optplan version: rerun the campaign") from None
    return out


def _median_pct(pairs: Sequence[tuple[float, float]]) -> float | None:
    errs = [100.0 * abs(pred - meas) / meas for pred, meas in pairs if meas]
    return statistics.median(errs) if errs else None


def _calibrated_step_s(c: ProbeComparison, cal: Calibration) -> float | None:
    if c.predicted_on_device_s is None or c.predicted_exposed_comm_s is None:
        return None
    return cal.compute_scale * c.predicted_on_device_s + cal.comm_scale * c.predicted_exposed_comm_s


def calibrations_from_results(paths: Sequence[Path]) -> list[CalibrationFit]:
    """One fitted calibration per (GPU, model hash, torch version) over every measured case of ``paths``,
    in first-seen order; groups without a usable measurement (nothing ok) are left out. CPU runs (``gpu``
    "cpu") fit memory only: their times are not comparable with a GPU's."""
    groups: dict[tuple[str, str, str], list[MeasuredCase]] = {}
    for path in paths:
        for case in read_results(path):
            if not case.gpu:
                continue  # a GPU outside the catalogue: no plan can use its calibration
            groups.setdefault((case.gpu, case.model_hash, case.torch_version), []).append(case)
    fits = []
    for (gpu, model_hash, torch_ver), cases in groups.items():
        comps = [c.comparison for c in cases]
        cal = fit_calibration(comps, gpu=gpu, model_hash=model_hash, torch_version=torch_ver)
        if cal is None:
            continue
        ok = [c for c in comps if c.result.status == "ok"]
        timed = [(c, s) for c in ok if c.time_comparable and c.result.step_s and c.predicted_step_s
                 and (s := _calibrated_step_s(c, cal)) is not None]
        mem = [c for c in ok if c.result.peak_allocated_bytes and c.predicted_allocated_bytes]
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
