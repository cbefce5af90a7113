"""The fidelity suite's printed report (benchmarks/fidelity.py): the table header and rows, the per-category
explanation of a memory miss, the summary statistics and the device's name and catalogue entry."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from optplan.estimators.hardware import GPUSpec, find_gpu
from optplan.estimators.memory import MemoryBreakdown
from optplan.planner.calibrate import ProbeComparison
from optplan.probes.runtime import ProbeResult

MIB = 2**20


@dataclass
class Row:
    model: str
    label: str
    nproc: int
    result: ProbeResult | None  # None: skipped
    skipped: str = ""
    memory: MemoryBreakdown | None = None
    pred_bytes: int | None = None
    pred_step_s: float | None = None
    cal_step_s: float | None = None
    is_calibration: bool = False
    time_note: str = ""
    comparison: ProbeComparison | None = None  # what calibration and the results file keep

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok

    @property
    def meas_bytes(self) -> int | None:
        return self.result.peak_allocated_bytes if self.result is not None else None

    @property
    def mem_err(self) -> float | None:
        return abs_err(self.pred_bytes, self.meas_bytes) if self.ok else None

    @property
    def time_err(self) -> float | None:
        return abs_err(self.pred_step_s, self.result.step_s) if self.ok and self.result else None

    @property
    def cal_err(self) -> float | None:
        if not self.ok or self.is_calibration or self.result is None:
            return None
        return abs_err(self.cal_step_s, self.result.step_s)


def abs_err(pred: float | None, meas: float | None) -> float | None:
    """|pred - meas| / meas in percent (None when either is missing)."""
    if pred is None or not meas:
        return None
    return 100.0 * abs(pred - meas) / meas


def signed(pred: float | None, meas: float | None) -> str:
    if pred is None or not meas:
        return "n/a"
    return f"{100.0 * (pred - meas) / meas:+.2f}%"


def header(device: str) -> str:
    head = (f"{'model':<12}{'strategy':<28}{'np':>3} | {'pred MiB':>9}{'meas MiB':>9}{'err':>10} |")
    if device == "cuda":
        head += f" {'pred ms':>9}{'meas ms':>9}{'err':>10} | {'calib ms':>9}{'err':>10} |"
    else:
        head += f" {'step1 s':>7} |"
    return head + f" {'probe s':>7}"


def mib(n: int | None) -> str:
    return f"{n / MIB:>9.1f}" if n is not None else f"{'n/a':>9}"


def ms(s: float | None) -> str:
    return f"{1e3 * s:>9.1f}" if s is not None else f"{'n/a':>9}"


def format_row(row: Row, device: str) -> str:
    start = f"{row.model:<12}{row.label:<28}{row.nproc:>3} | "
    if row.result is None:
        return start + f"skipped: {row.skipped}"
    r = row.result
    if not r.ok:
        return start + f"{mib(row.pred_bytes)}{'':>9}{'':>10} | {r.status.upper()}: {r.reason} ({r.wall_s:.0f} s)"
    line = start + f"{mib(row.pred_bytes)}{mib(row.meas_bytes)}{signed(row.pred_bytes, row.meas_bytes):>10} |"
    if device == "cuda":
        line += f" {ms(row.pred_step_s)}{ms(r.step_s)}{signed(row.pred_step_s, r.step_s):>10} |"
        if row.is_calibration:
            line += f" {'(calibration probe)':>19} |"
        else:
            line += f" {ms(row.cal_step_s)}{signed(row.cal_step_s, r.step_s):>10} |"
    else:
        step = f"{r.step_s:>7.2f}" if r.step_s is not None else f"{'n/a':>7}"
        line += f" {step} |"
    line += f" {r.wall_s:>7.1f}"
    if row.time_note:
        line += f"  [{row.time_note}]"
    return line


def explain_lines(row: Row) -> list[str]:
    """Predicted categories (memory.py) and measured ones (the probe's tracker, CPU) of one case, MiB."""
    m, r = row.memory, row.result
    if m is None or r is None:
        return []

    def part(name: str, n: float) -> str:
        return f"{name} {n / MIB:.2f}"

    items = {k: v for k, v in m.detail_bytes.items() if k not in ("cuda_context", "fragmentation_margin")}
    pred = [part("params", m.params_bytes), part("grads", m.grads_bytes), part("optim", m.optimizer_bytes),
            part("acts", m.activations_bytes)] + [part(k, v) for k, v in items.items()]
    lines = ["      predicted: " + ", ".join(pred)]
    if r.peak_by_category_bytes:
        meas = [part(k, v) for k, v in sorted(r.peak_by_category_bytes.items(), key=lambda kv: -kv[1])]
        lines.append("      measured:  " + ", ".join(meas))
    elif r.peak_reserved_bytes is not None:
        lines.append(f"      measured:  max allocated {(r.peak_allocated_bytes or 0) / MIB:.2f}, max reserved "
                     f"{r.peak_reserved_bytes / MIB:.2f}, outside the allocator {(r.non_torch_bytes or 0) / MIB:.2f}")
    for note in r.notes:
        lines.append(f"      note: {note}")
    return lines


def stats(values: list[float]) -> tuple[str, str]:
    if not values:
        return "n/a", "n/a"
    return f"{statistics.median(values):.2f}%", f"{max(values):.2f}%"


def device_name(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    name = platform.processor() or platform.machine() or "cpu"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def catalogue_gpu() -> tuple[GPUSpec | None, str]:
    """The detected GPU's catalogue entry, or None and why."""
    from optplan.probes.hardware import detect_gpus

    report = detect_gpus()
    if not report.available or not report.devices:
        return None, f"no GPU detected ({report.reason})"
    first = report.devices[0]
    if first.catalogue_name is None:
        return None, f"{first.name} is not in the GPU catalogue: time not predicted"
    return find_gpu(first.catalogue_name), ""


# ---------------------------------------------------------------------------------------------------
