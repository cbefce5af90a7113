"""What every section of benchmarks/gpu_campaign.py shares: the record each results file carries (device, driver,
CUDA, torch and package versions, the commit), the ``Campaign`` a section is handed (device, output folder, deadline,
the ``--models``/``--cases``/``--engines`` filters) and the measured-case record ``optplan calibrate`` takes."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity_report  # noqa: E402
import fidelity_suite  # noqa: E402
from campaign_io import ROOT  # noqa: E402

from optplan.estimators.hardware import Cluster, GPUSpec, find_gpu  # noqa: E402
from optplan.estimators.profile import ModelProfile  # noqa: E402
from optplan.planner.calibrate import ProbeComparison, profile_hash  # noqa: E402
from optplan.planner.results import RESULTS_FORMAT, MeasuredCase  # noqa: E402
from optplan.planner.space import SEARCHED_PRECISIONS_BF16  # noqa: E402
from optplan.probes.runtime import ProbeResult  # noqa: E402

EXAMPLES = ROOT / "examples"
PACKAGES = ("optplan", "torch", "deepspeed", "accelerate", "transformers", "optuna", "pydantic", "textual", "typer",
            "nvidia-ml-py", "numpy")
CPU_STAND_IN_GPU = "H100-SXM"
"""The catalogue GPU the CPU path predicts for, so that every step runs; its times are not comparable."""
GRID_SHARE_TARGET = 0.97
DEFAULT_BUDGET_S = 480.0
"""Seconds one call may spend measuring: the 600 s command limit less the wheel installs and imports."""
DEFAULT_JOBS = {"cuda": 4, "cpu": 3}
"""Probes at once (probe_pool.py), by device: one on the device, the others importing. On a GPU four: with three, the
seventh H200 visit's device lock stood idle 69 of its fidelity section's 280 s, the next probe still importing (6-15 s
before its first step, 16 cores) when the last one let go (0.8-18 s held, 3.8 s in median). On the CPU (2 cores, CI)
three."""


# ---------------------------------------------------------------------------------------------------
# the record every file carries, and atomic writes
# ---------------------------------------------------------------------------------------------------
def git_commit() -> str:
    """The checkout's commit (``+dirty`` when it has changes), else ``$OPTPLAN_GIT_COMMIT``, else 'unknown'."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=10)
            return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("OPTPLAN_GIT_COMMIT", "unknown (no git checkout; set OPTPLAN_GIT_COMMIT)")


def deepspeed_import_error() -> str | None:
    """None when ``import deepspeed`` works in a fresh interpreter, else its last error line (the GPU
    machine gets DeepSpeed from wheels; a missing dependency would fail every DeepSpeed run alike)."""
    try:
        proc = subprocess.run([sys.executable, "-c", "import deepspeed"], cwd=ROOT, capture_output=True, text=True,
                              timeout=180)
    except subprocess.TimeoutExpired:
        return "import deepspeed took over 180 s"
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"import deepspeed exited with {proc.returncode}"


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def host_record() -> dict[str, Any]:
    """The host CPU the steps were launched from: its model, logical cores, the cores this process may run on, the
    threads per core, the cgroup's CPU quota (``cpu.max``: "max 100000" when unlimited) and the load averages. Host-
    paced step times differ between GPU visits (probes/host_speed.py): this says on what."""
    model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    siblings = _read("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
    threads = None
    if siblings:
        parts = [p.split("-") for p in siblings.split(",")]
        threads = sum(int(p[-1]) - int(p[0]) + 1 for p in parts)
    return {
        "cpu_model": model or platform.processor() or None,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "threads_per_core": threads,
        "cgroup_cpu_max": _read("/sys/fs/cgroup/cpu.max"),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def env_record(device: str) -> dict[str, Any]:
    """Device, driver, CUDA, torch and package versions, the commit and the start time."""
    from optplan.probes.hardware import detect_gpus

    versions = {}
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    report = detect_gpus()
    return {
        "device": device,
        "device_name": fidelity_report.device_name(device),
        "catalogue_gpu": (report.devices[0].catalogue_name if report.available and report.devices else None),
        "driver": report.driver_version,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "packages": versions,
        "commit": git_commit(),
        "deepspeed_import_error": deepspeed_import_error(),
        "nvcc": shutil.which("nvcc"),
        "host": host_record(),
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


@dataclass
class Campaign:
    """What every section needs: the device, the output folder, the env record and the deadline."""

    device: str
    out: Path
    env: dict[str, Any]
    deadline: float
    quick: bool
    gpu: GPUSpec | None
    log: Callable[[str], None] = print
    models: frozenset[str] | None = None  # --models: fidelity, trace and grid keep only these
    cases: tuple[str, ...] | None = None  # --cases: words a fidelity case's tag must hold (first case kept)
    engines: frozenset[str] | None = None  # --engines: the plans exports and launch keep (torch, deepspeed)
    jobs: int = 1  # --jobs: probes at once in fidelity, trace and grid (and validate's in exports, the two plans of
    # exports and launch), taking the device in turn (probes/device_lock.py)
    traced: dict[tuple[str, str], tuple[ModelProfile, ProbeResult]] = field(default_factory=dict)
    """The fidelity section's traced runs, by (model, case label): the trace section reports them without a probe."""

    def wants(self, key: str) -> bool:
        """Whether --models keeps the model ``key`` (the grid's 'llama1b' answers to 'llama')."""
        return self.models is None or key in self.models or key.removesuffix("1b") in self.models

    def keeps_case(self, case: fidelity_suite.Case, first: bool) -> bool:
        """Whether --cases keeps the fidelity ``case``: each model's first case (its calibration probe) always;
        another when its tag (``case_tag``) holds every word of one of the comma-separated filters."""
        return (self.cases is None or first
                or any(all(w in case_tag(case).split() for w in f.split()) for f in self.cases))

    def wants_engine(self, engine: str) -> bool:
        """Whether --engines keeps plans on ``engine`` (exports, launch)."""
        return self.engines is None or engine in self.engines

    def plan_args(self) -> list[str]:
        """``optplan recommend``'s GPU, sequence and batch for the exports and launch plans. On the CPU a global
        batch of 16, not the MLP's 256: the plan (amp-bf16) then steps in well under a second where the CPU emulates
        bf16 (~0.5 GFLOP/s on AVX2), and each file still launches through its trainer. The precisions are
        ``recommend``'s defaults, named: the model file's OPTPLAN precision would otherwise be the only one searched."""
        gpu = self.gpu.name if self.gpu is not None else CPU_STAND_IN_GPU
        precisions = [w for p in SEARCHED_PRECISIONS_BF16 for w in ("--precision", p)]
        return ["--gpu", gpu, *precisions,
                *(["--seq-len", "512"] if self.device == "cuda" else ["--global-batch", "16"])]

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()

    def doc(self, section: str, **body: Any) -> dict[str, Any]:
        return {"format": RESULTS_FORMAT, "section": section, "env": self.env, **body}

    @property
    def gpu_name(self) -> str:
        """The calibration key's GPU: the catalogue name, or 'cpu'."""
        if self.device == "cpu":
            return "cpu"
        return self.gpu.name if self.gpu is not None else ""

    def cluster(self, gpus: int = 1) -> Cluster:
        return Cluster(gpu=self.gpu or find_gpu(CPU_STAND_IN_GPU), gpus=gpus, gpus_per_node=gpus)

    @property
    def time_comparable(self) -> bool:
        return self.device == "cuda" and self.gpu is not None

    @property
    def deepspeed_error(self) -> str | None:
        why = self.env.get("deepspeed_import_error")
        return f"deepspeed cannot be imported here: {why}" if why else None


def measured_case(c: Campaign, model: str, profile: ModelProfile, comparison: ProbeComparison) -> dict[str, Any]:
    return MeasuredCase(gpu=c.gpu_name, model=model, model_hash=profile_hash(profile),
                        torch_version=comparison.result.torch_version or torch.__version__,
                        comparison=comparison).model_dump(mode="json")


def pct(pred: float | None, meas: float | None) -> float | None:
    """Signed error (predicted − measured) ÷ measured, %."""
    if pred is None or not meas:
        return None
    return 100.0 * (pred - meas) / meas


def median_max(values: Sequence[float]) -> dict[str, float | None]:
    vals = [abs(v) for v in values]
    return {"median_abs_pct": statistics.median(vals) if vals else None, "max_abs_pct": max(vals) if vals else None,
            "n": len(vals)}


def device_held_s(result: ProbeResult | None) -> float | None:
    """How long a probe's child held the device lock (s): from taking it to handing it over, else to its exit (what
    bounds a section's time when probes run ``--jobs`` at a time); None when the child took no lock (none, or a
    probe of several processes, whose lock the parent holds around it)."""
    marks = result.timeline_s if result is not None else {}
    end = marks.get("released", marks.get("exited"))
    return round(end - marks["device_acquired"], 3) if "device_acquired" in marks and end is not None else None


def spread(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, min, max and sum of ``values``, and how many."""
    return {"median": statistics.median(values) if values else None, "min": min(values) if values else None,
            "max": max(values) if values else None, "sum": round(sum(values), 3), "n": len(values)}


def case_tag(case: fidelity_suite.Case) -> str:
    """The words --cases matches: precision, mode, ``mbs<N>``, checkpointing and ``compile`` when compiled
    (e.g. "bf16 single mbs2 selective compile")."""
    return " ".join([case.precision, case.mode, f"mbs{case.mbs}", case.checkpointing,
                     *(["compile"] if case.compile else [])])
