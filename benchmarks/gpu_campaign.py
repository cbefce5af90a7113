"""One command that measures everything a GPU can tell optplan, and keeps the results (issue 16).

GPU time comes in short visits (one H100 or H200, ten minutes a command, no package index), so every
measurement is scripted here and every result is written as JSON under ``--out`` as soon as it exists
(a killed run keeps what it measured). Sections, each one file:

* ``probes.json`` (part 1): the GPU paths of the probes: a CUDA OOM becomes data (a probe under a memory
  cap ends with status "oom", not a crash), the microbenchmarks (matmul per dtype, copy bandwidth)
  against the catalogue's peaks, and the GPU-only probe tests of ``tests/probes`` (allocator figures,
  the OOM cap, the hung probe's memory freed after its kill), run by pytest.
* ``fidelity.json`` (part 1): ``benchmarks/fidelity.py``'s suite (GPT-2 small, Llama-3 1B, ResNet-50,
  the MLP; fp32, amp-bf16, bf16, bf16-pure; checkpointing on and off; torch single process and DeepSpeed
  ZeRO-0..3 at world size 1): predicted allocated bytes against ``max_memory_allocated``, the
  ``max_memory_reserved`` margin (the fragmentation margin's first measurement), and step times against
  the uncalibrated and the calibrated prediction. Then ``calibration``: the results are fitted into a
  calibration cache (``planner/results.py``, what ``optplan calibrate fidelity.json`` does), read back and
  used for an estimate, and the step-time error before and after is recorded.
* ``trace.json`` (part 1): where the step time goes: a few runs (those the first H200 visit's time errors were
  largest on) with two extra steps under ``torch.profiler`` (``ProbeSpec.trace_steps``, probes/step_trace.py),
  their kernel time per step by category (GEMM, attention, optimizer, communication, other) beside the
  predicted step's parts (compute, memory-bound, optimizer, host).
* ``exports.json`` (part 2): ``optplan recommend --out`` for a DeepSpeed and a torch plan of a model file
  on this one GPU, then ``optplan validate`` on what was written: ``ds_config.json`` through
  ``deepspeed.initialize``, ``launch.sh`` through torchrun, ``accelerate.yaml`` through
  ``accelerate launch`` (on the CPU the DeepSpeed plan only).
* ``launch.json`` (part 2, benchmarks/campaign_launch.py): the user's path end to end: ``optplan recommend --out``,
  the exported ``launch.sh`` run as written, ``optplan calibrate`` on the ``measurements.json`` its train.py wrote,
  and ``recommend`` again with that calibration (whether it was applied, and the next plan's prediction).
* ``grid.json`` (part 2): recommendation quality. For two models, every configuration of a small
  single-GPU grid (precision × checkpointing × micro-batch × engine) runs for a few steps; ``recommend``
  searches the same space; the report gives the pick's rank among the measured configurations, its
  measured throughput as a share of the best measured (target >= 97 %), and Spearman's rank correlation
  of predicted and measured throughput.

Every file holds ``"format": "optplan-results/1"``, an ``env`` record (device, driver, CUDA, torch and
package versions, the git commit: ``git rev-parse`` here, else ``$OPTPLAN_GIT_COMMIT``) and, where runs
were measured, ``measured`` (planner/results.py's MeasuredCase list), which ``optplan calibrate`` takes.

Run (``--device`` defaults to cuda when torch sees a GPU):

    python benchmarks/gpu_campaign.py --quick --out DIR           # everything, small, one 10-minute call
    python benchmarks/gpu_campaign.py --part 1 --out DIR          # probes + fidelity + calibration
    python benchmarks/gpu_campaign.py --part 2 --out DIR          # exports + launch + recommendation grid
    python benchmarks/gpu_campaign.py --device cpu --quick --out DIR   # the CPU path CI runs
    python benchmarks/gpu_campaign.py --sections exports,trace,grid --out DIR   # chosen sections, in order
    python benchmarks/gpu_campaign.py --sections fidelity --models resnet --out DIR   # one model's runs

``--sections`` (probes, fidelity, trace, gpu_tests, exports, launch, grid) replaces ``--part``'s list, so that a visit
spends its minutes on what earlier visits left unmeasured; ``--models`` (mlp, gpt2, llama, resnet, timm-vit, timm-resnet) keeps only
those models in fidelity, trace and grid; ``--engines`` (torch, deepspeed) keeps those plans in exports and launch.

``--budget-s`` (default 540) bounds one call: runs not started in time are recorded as "out of time".
On the CPU the step times are measured but not compared (no CPU in the catalogue: predictions are for
the H100 and marked ``time_comparable: false``); the rest runs as on a GPU. The last line reads
``campaign: <sections> written to DIR in N s``.

The CPU's ``--quick`` run (``--device cpu --quick``, tests/benchmarks/test_gpu_campaign.py) is built to cost little
on 2 shared cores, where each run is mostly a child process importing torch (~4 s of CPU) and bf16 matmuls are
emulated (~90x slower than fp32 on AVX2): the OOM probe is the MLP under a 1 MiB cap; the microbenchmark runs no
all-reduce (as on one GPU; tests/probes/test_microbench.py runs the gloo one); fidelity runs the quick subset
without what other tests already check (fidelity.py's ``Case.cpu_quick``) and a 0.6 M-parameter Llama
(``LLAMA_CPU_QUICK_SHAPE``); fidelity, trace and grid share one profile per model file (the profile cache, probes/profile_cache.py);
the GPU tests are collected in one pytest process; the exports and the launch plan a global batch of 16 (the launch:
the torch plan, 3 steps under the live-tensor tracker); the grid is 4 MLP runs (micro-batch 16) and recommend's free
pick outside it is named, not run. About 305 s of CPU in all (fidelity 120, exports 65, grid 40, launch 25, gpu_tests
20, probes 12, trace 9, start 8), about 450 s wall on 2 cores at twice their load:
the test passes ``--budget-s 1500``, as the 480 s default is a GPU visit's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity  # noqa: E402
from campaign_io import ROOT, last_line, run_optplan, write_json  # noqa: E402
from campaign_launch import part_launch  # noqa: E402

from optplan.estimators.estimate import estimate  # noqa: E402
from optplan.estimators.hardware import Cluster, GPUSpec, find_gpu  # noqa: E402
from optplan.estimators.profile import ModelProfile  # noqa: E402
from optplan.estimators.strategy import Strategy  # noqa: E402
from optplan.planner.calibrate import ProbeComparison, load_calibration, profile_hash, save_calibration  # noqa: E402
from optplan.planner.probe_stage import LocalDevices, compare_spec  # noqa: E402
from optplan.planner.recommend import recommend  # noqa: E402
from optplan.planner.results import RESULTS_FORMAT, MeasuredCase, calibrations_from_results  # noqa: E402
from optplan.planner.search import Goal, rank  # noqa: E402
from optplan.probes.loader import profile_model_file  # noqa: E402
from optplan.probes.runtime import ProbeResult, ProbeSpec, run_probe  # noqa: E402

EXAMPLES = ROOT / "examples"
PACKAGES = ("optplan", "torch", "deepspeed", "accelerate", "transformers", "optuna", "pydantic", "textual", "typer",
            "nvidia-ml-py", "numpy")
CPU_STAND_IN_GPU = "H100-SXM"
"""The catalogue GPU the CPU path predicts for, so that every step runs; its times are not comparable."""
GRID_SHARE_TARGET = 0.97
DEFAULT_BUDGET_S = 480.0
"""Seconds one call may spend measuring: the 600 s command limit less the wheel installs and imports."""


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
        "device_name": fidelity.device_name(device),
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

    def wants(self, key: str) -> bool:
        """Whether --models keeps the model ``key`` (the grid's and trace's 'llama1b' answers to 'llama')."""
        return self.models is None or key in self.models or key.removesuffix("1b") in self.models

    def keeps_case(self, case: fidelity.Case, first: bool) -> bool:
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
        bf16 (~0.5 GFLOP/s on AVX2), and each file still launches through its trainer."""
        gpu = self.gpu.name if self.gpu is not None else CPU_STAND_IN_GPU
        return ["--gpu", gpu, *(["--seq-len", "512"] if self.device == "cuda" else ["--global-batch", "16"])]

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


# ---------------------------------------------------------------------------------------------------
# part 1: probes.json
# ---------------------------------------------------------------------------------------------------
def oom_as_data(c: Campaign) -> dict[str, Any]:
    """A probe whose memory cap is far below what it needs must end with status 'oom' and a reason."""
    # on the CPU the MLP (8 MiB of parameters) under a 1 MiB cap: the tracker's cap is the same path at any size,
    # without building GPT-2's 124 M parameters
    path = EXAMPLES / ("gpt2.py" if c.device == "cuda" else "mlp.py")
    seq = 1024 if c.device == "cuda" else None
    strategy = Strategy(precision="fp32", optimizer="adamw", mbs=8 if c.device == "cuda" else 2, engine="torch")
    cap = 256 * 2**20 if c.device == "cuda" else 2**20
    spec = ProbeSpec(model_path=str(path), seq_len=seq, strategy=strategy, device=c.device,  # type: ignore[arg-type]
                     warmup_steps=1, timed_steps=1, memory_cap_bytes=cap)
    result = run_probe(spec, timeout_s=min(240.0, max(30.0, c.left_s())))
    return {"model": str(path.relative_to(ROOT)), "seq_len": seq, "strategy": strategy.label(), "cap_bytes": cap,
            "status": result.status, "reason": result.reason, "wall_s": result.wall_s,
            "ok": result.status == "oom" and bool(result.reason)}


def microbench(c: Campaign) -> dict[str, Any]:
    from optplan.probes.microbench import run_microbench

    # no all-reduce on one GPU, nor in the CPU's --quick run (as on one GPU; tests/probes/test_microbench.py runs
    # the same gloo all-reduce on 2 processes)
    bench = run_microbench(device=c.device, quick=c.quick or c.device == "cpu",  # type: ignore[arg-type]
                           allreduce_nproc=0 if c.device == "cuda" or c.quick else 2,
                           timeout_s=min(240.0, max(30.0, c.left_s())))
    doc: dict[str, Any] = {"result": bench.model_dump(mode="json"),
                           "ok": bool(bench.matmul_flops_per_s) and bench.copy_bytes_per_s > 0}
    if c.gpu is not None:  # measured ÷ datasheet: what the efficiency constants should be near
        doc["matmul_share_of_catalogue_peak"] = {d: v / c.gpu.peak_flops[d]  # type: ignore[index]
                                                 for d, v in bench.matmul_flops_per_s.items()
                                                 if c.gpu.peak_flops.get(d)}  # type: ignore[call-overload]
        doc["copy_share_of_catalogue_hbm"] = bench.copy_bytes_per_s / c.gpu.memory_bandwidth_bytes_per_s
    return doc


def gpu_tests(c: Campaign) -> dict[str, Any]:
    """The GPU-only probe tests (skipped on a machine without CUDA): each test's outcome, from pytest's
    JUnit XML report."""
    import xml.etree.ElementTree as ET

    with tempfile.TemporaryDirectory(prefix="optplan_campaign_pytest_") as tmp:
        report = Path(tmp) / "junit.xml"
        # the microbenchmark test repeats what microbench() measured: left out on the GPU to save its time
        # on the CPU in one process (-n 0: pyproject's -n auto would start a worker per core only to skip them)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               "tests/probes", "-k", "(cuda and not microbench) or hung" if c.device == "cuda" else "cuda",
               *(() if c.device == "cuda" else ("-n", "0"))]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                  timeout=max(30.0, min(300.0, c.left_s())))
            text, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            text, code = out, 124
        tests: dict[str, str] = {}
        with contextlib.suppress(OSError, ET.ParseError):
            for case in ET.parse(report).getroot().iter("testcase"):
                outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
                tests[f"{case.get('classname')}::{case.get('name')}"] = outcome
    counts = {k: sum(v == k for v in tests.values()) for k in ("passed", "failed", "error", "skipped")}
    return {"command": " ".join(["pytest", *cmd[5:]]), "exit_code": code, "counts": counts, "tests": tests,
            "ok": (code in (0, 5) and not counts["failed"] and not counts["error"]
                   and (c.device == "cpu" or counts["passed"] > 0)),  # on a GPU, all skipped is not a pass
            "tail": "\n".join(text.strip().splitlines()[-12:])}


def part_probes(c: Campaign) -> dict[str, Any]:
    doc = c.doc("probes")
    path = c.out / "probes.json"
    for name, fn in (("oom", oom_as_data), ("microbench", microbench)):
        if c.left_s() < 20:
            doc[name] = {"skipped": "out of time"}
            write_json(path, doc)
            continue
        t0 = time.perf_counter()
        try:
            doc[name] = fn(c)
        except Exception as exc:  # noqa: BLE001 - one section's failure is data, the campaign goes on
            doc[name] = {"error": f"{type(exc).__name__}: {exc}"}
        doc[name]["section_s"] = round(time.perf_counter() - t0, 1)
        shown = {k: v for k, v in doc[name].items() if k in ("status", "ok", "counts", "error", "skipped")}
        c.log(f"probes: {name}: {json.dumps(shown)}")
        write_json(path, doc)
    return doc


def part_gpu_tests(c: Campaign) -> dict[str, Any]:
    """The GPU-only tests, last in part 1 (the hung-probe test waits out its timeout): added to probes.json."""
    path = c.out / "probes.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        doc = c.doc("probes")
    if c.left_s() < 45:
        doc["gpu_tests"] = {"skipped": "out of time"}
    else:
        t0 = time.perf_counter()
        try:
            doc["gpu_tests"] = gpu_tests(c)
        except Exception as exc:  # noqa: BLE001
            doc["gpu_tests"] = {"error": f"{type(exc).__name__}: {exc}"}
        doc["gpu_tests"]["section_s"] = round(time.perf_counter() - t0, 1)
    shown = {k: v for k, v in doc["gpu_tests"].items() if k in ("ok", "counts", "error", "skipped")}
    c.log(f"probes: gpu_tests: {json.dumps(shown)}")
    write_json(path, doc)
    return doc


# ---------------------------------------------------------------------------------------------------
# part 1: fidelity.json and the calibration round trip
# ---------------------------------------------------------------------------------------------------
def row_record(row: fidelity.Row) -> dict[str, Any]:
    r = row.result
    return {
        "model": row.model, "label": row.label, "nproc": row.nproc,
        "status": r.status if r is not None else "skipped", "reason": (r.reason if r is not None else row.skipped),
        "predicted_allocated_bytes": row.pred_bytes,
        "measured_allocated_bytes": row.meas_bytes if row.ok else None,
        "measured_reserved_bytes": r.peak_reserved_bytes if r is not None and row.ok else None,
        "reserved_margin": ((r.peak_reserved_bytes / r.peak_allocated_bytes - 1)
                            if r is not None and row.ok and r.peak_reserved_bytes and r.peak_allocated_bytes else None),
        "non_torch_bytes": r.non_torch_bytes if r is not None else None,
        "memory_error_pct": pct(row.pred_bytes, row.meas_bytes) if row.ok else None,
        "predicted_step_s": row.pred_step_s, "calibrated_step_s": row.cal_step_s,
        "measured_step_s": r.step_s if r is not None and row.ok else None,
        "time_error_pct": pct(row.pred_step_s, r.step_s) if r is not None and row.ok else None,
        "calibrated_time_error_pct": (pct(row.cal_step_s, r.step_s)
                                      if r is not None and row.ok and not row.is_calibration else None),
        "is_calibration_probe": row.is_calibration, "probe_wall_s": r.wall_s if r is not None else None,
        "note": row.time_note,
    }


def part_fidelity(c: Campaign) -> dict[str, Any]:
    path = c.out / "fidelity.json"
    profiles: dict[str, ModelProfile] = {}
    rows: list[fidelity.Row] = []
    doc = c.doc("fidelity", gpu=c.gpu_name, targets={
        "cpu_memory_pct": fidelity.CPU_MEMORY_TARGET, "gpu_memory_median_max_pct": fidelity.GPU_MEMORY_TARGET,
        "gpu_time_calibrated_median_pct": fidelity.GPU_TIME_TARGET}, cases=[], measured=[])

    def on_model(key: str, model: fidelity.Model, profile: ModelProfile | None, profile_s: float) -> None:
        if profile is not None:
            profiles[key] = profile
        c.log(f"fidelity: {key}: {'profiled' if profile else 'profiling failed'} in {profile_s:.1f} s")

    def on_row(row: fidelity.Row) -> None:
        rows.append(row)
        doc["cases"].append(row_record(row))
        if row.comparison is not None and row.result is not None and row.model in profiles:
            doc["measured"].append(measured_case(c, row.model, profiles[row.model], row.comparison))
        c.log("fidelity: " + fidelity.format_row(row, c.device))
        doc["summary"] = fidelity_summary(doc["cases"])
        write_json(path, doc)

    ds_error = c.deepspeed_error
    doc["deepspeed_optimizer"] = ("torch AdamW (foreach) as the client optimizer: no fused-Adam JIT build "
                                  "(no nvcc or time for it on a visit); the prediction follows")
    wanted = None if c.models is None else {case.model for case in fidelity.SUITE if c.wants(case.model)}
    suite = fidelity.select_cases(c.device, c.quick, wanted)
    firsts = {id(next(x for x in suite if x.model == key)) for key in {x.model for x in suite}}

    def skip(case: fidelity.Case) -> str | None:
        if not c.keeps_case(case, id(case) in firsts):
            return "not in --cases"
        return ds_error if ds_error and case.mode.startswith("zero") else None

    fidelity.run_suite(c.device, quick=c.quick, wanted=wanted, timeout_s=300.0, deadline=c.deadline,
                       ds_torch_optimizer=True, on_model=on_model, on_row=on_row, skip=skip)
    doc["summary"] = fidelity_summary(doc["cases"])
    write_json(path, doc)
    doc["calibration"] = calibration_round_trip(c, path, rows, profiles)
    write_json(path, doc)
    return doc


def case_tag(case: fidelity.Case) -> str:
    """The words --cases matches: precision, mode, ``mbs<N>``, checkpointing and ``compile`` when compiled
    (e.g. "bf16 single mbs2 selective compile")."""
    return " ".join([case.precision, case.mode, f"mbs{case.mbs}", case.checkpointing,
                     *(["compile"] if case.compile else [])])


def fidelity_summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [x for x in cases if x["status"] == "ok"]
    return {
        "cases": len(cases), "ok": len(ok),
        "not_ok": {x["label"] + f" ({x['model']})": f"{x['status']}: {x['reason']}" for x in cases if x["status"] != "ok"},
        "memory": median_max([x["memory_error_pct"] for x in ok if x["memory_error_pct"] is not None]),
        "reserved_margin_median": (statistics.median(m) if (m := [x["reserved_margin"] for x in ok
                                                                if x["reserved_margin"] is not None]) else None),
        "time_uncalibrated": median_max([x["time_error_pct"] for x in ok if x["time_error_pct"] is not None]),
        "time_calibrated": median_max([x["calibrated_time_error_pct"] for x in ok
                                       if x["calibrated_time_error_pct"] is not None]),
    }


def calibration_round_trip(c: Campaign, results: Path, rows: list[fidelity.Row],
                           profiles: dict[str, ModelProfile]) -> dict[str, Any]:
    """Fit the results into a cache file, read each entry back and price one measured case with it."""
    cache = c.out / "calibration_cache.json"
    try:
        fits = calibrations_from_results([results])
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {"cache": cache.name, "fits": [f.model_dump(mode="json") for f in fits], "used": []}
    for fit in fits:
        save_calibration(fit.calibration, path=cache)
    for key, profile in profiles.items():
        h = profile_hash(profile)
        row = next((r for r in rows if r.model == key and r.ok and r.comparison is not None), None)
        if row is None or row.result is None:
            continue
        cal = load_calibration(c.gpu_name, h, row.result.torch_version or torch.__version__, path=cache)
        if cal is None:
            out["used"].append({"model": key, "loaded": False})
            continue
        strategy = row.comparison.probed  # type: ignore[union-attr]
        plain = estimate(profile, c.cluster(row.nproc), strategy)
        calibrated = estimate(profile, c.cluster(row.nproc), strategy, calibration=cal)
        plain_alloc = plain.memory.total_bytes - plain.memory.overhead_bytes
        cal_alloc = (calibrated.memory.total_bytes - calibrated.memory.overhead_bytes
                     + calibrated.memory.detail_bytes.get("calibration_correction", 0))
        applied = cal_alloc / plain_alloc if plain_alloc else None
        out["used"].append({
            "model": key, "loaded": True, "case": row.label,
            "calibrated_note": next((n for n in calibrated.notes if n.startswith("calibrated on")), None),
            # the estimate applies the cached scale to its allocated bytes; the same scale on this probe's
            # prediction (CPU accounting on the CPU) against what the probe measured
            "applied_allocated_scale": applied,
            "allocated_error_pct_before": pct(row.pred_bytes, row.meas_bytes),
            "allocated_error_pct_after": pct(row.pred_bytes * applied if row.pred_bytes else None, row.meas_bytes),
            "step_error_pct_before": pct(plain.time.step_s, row.result.step_s) if c.time_comparable else None,
            "step_error_pct_after": pct(calibrated.time.step_s, row.result.step_s) if c.time_comparable else None,
        })
    c.log(f"calibration: {len(fits)} fit(s) written to {cache.name}; used for {sum(u.get('loaded', False) for u in out['used'])} model(s)")
    return out


# ---------------------------------------------------------------------------------------------------
# part 1: trace.json (where the step time goes)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceCase:
    key: str
    path: Path
    seq_len: int | None
    strategy: Strategy


def trace_cases(device: str, tmp: Path) -> list[TraceCase]:
    """The runs the H200 visit's time errors were largest on (benchmarks/results/2026-11-26-H200): GPT-2 small
    at micro-batch 4 (28-54 % slower predicted than measured) and 16, the Llama-3 1B layout at 2 and 4 with
    checkpointing (23-38 % faster predicted), DeepSpeed ZeRO-1 and ZeRO-3 at world size 1 (1.6-5.8x slower
    measured than predicted), ResNet-50 and the MLP (the FLOPs-only path: 8-90x); on the CPU one small MLP run.
    --quick on a GPU keeps the first GPT-2 and the first Llama run."""
    if device == "cpu":
        return [TraceCase("mlp", EXAMPLES / "mlp.py", None, Strategy(precision="fp32", optimizer="adamw", mbs=16,
                                                                     engine="torch"))]
    llama = fidelity.llama_wrapper(tmp, None, 1024)
    return [
        *(TraceCase("gpt2", EXAMPLES / "gpt2.py", 1024, Strategy(precision="bf16", mbs=b, engine="torch"))
          for b in (4, 16)),
        TraceCase("llama1b", llama, 1024, Strategy(precision="bf16", mbs=2, engine="torch")),
        TraceCase("llama1b", llama, 1024, Strategy(precision="bf16", mbs=4, checkpointing="full", engine="torch")),
        TraceCase("llama1b", llama, 1024, Strategy(precision="bf16", mbs=2, engine="deepspeed", zero=1)),
        TraceCase("llama1b", llama, 1024, Strategy(precision="bf16", mbs=2, checkpointing="full",
                                                   engine="deepspeed", zero=3)),
        TraceCase("resnet", EXAMPLES / "resnet.py", None, Strategy(precision="bf16", optimizer="sgd", mbs=32,
                                                                  engine="torch")),
        TraceCase("mlp", EXAMPLES / "mlp.py", None, Strategy(precision="fp32", optimizer="adamw", mbs=1024,
                                                             engine="torch")),
    ]


def part_trace(c: Campaign) -> dict[str, Any]:
    """Kernel time by category (probes/step_trace.py) beside the predicted step's parts, for a few runs."""
    path = c.out / "trace.json"
    doc = c.doc("trace", gpu=c.gpu_name, time_comparable=c.time_comparable, runs=[])
    with tempfile.TemporaryDirectory(prefix="optplan_campaign_trace_") as tmp:
        cases = trace_cases(c.device, Path(tmp))
        if c.quick and c.device == "cuda":  # one run per model: GPT-2 at micro-batch 4, the Llama layout at 2
            cases = [cases[0], cases[2]]
        for case in cases:
            key, model_path, seq, strategy = case.key, case.path, case.seq_len, case.strategy
            if not c.wants(key):
                continue
            if strategy.engine == "deepspeed" and c.deepspeed_error:
                doc["runs"].append({"model": key, "strategy": strategy.label(), "skipped": c.deepspeed_error})
                continue
            if c.left_s() < 30:
                doc["runs"].append({"model": key, "strategy": strategy.label(), "skipped": "out of time"})
                continue
            profile = profile_model_file(model_path, seq_len=seq)
            block = profile.repeated_block.class_name if profile.repeated_block else None
            spec = ProbeSpec(model_path=str(model_path), seq_len=seq, strategy=strategy, block_class=block,
                             ds_config=fidelity.ds_config(strategy, profile, torch_optimizer=True), device=c.device,  # type: ignore[arg-type]
                             warmup_steps=2 if c.device == "cuda" else 1,
                             timed_steps=3 if c.device == "cuda" else 1, trace_steps=2 if c.device == "cuda" else 1)
            result = run_probe(spec, timeout_s=max(30.0, min(240.0, c.left_s())))
            t = estimate(profile, c.cluster(1), strategy,
                         adam_impl=fidelity.probe_adam_impl(strategy, c.device, ds_torch_optimizer=True)).time
            predicted = {"step_s": t.step_s, "compute_s": t.compute_s, "recompute_s": t.recompute_s,
                         "memory_bound_s": t.memory_bound_s, "optimizer_s": t.optimizer_s,
                         "host_overhead_s": t.host_overhead_s}
            doc["runs"].append({"model": key, "strategy": strategy.label(), "status": result.status,
                                "reason": result.reason, "measured_step_s": result.step_s,
                                "trace": result.step_trace, "predicted": predicted if c.time_comparable else None})
            busy = (result.step_trace or {}).get("busy_s")
            host = ((result.step_trace or {}).get("host_per_step") or {}).get("aten_self_s")
            attention = next((k["name"][:60] for k in (result.step_trace or {}).get("top_kernels") or []
                              if k.get("category") == "attention"), None)  # which SDPA backend ran
            c.log(f"trace: {key} {strategy.label()}: {result.status}"
                  + (f", step {result.step_s * 1e3:.1f} ms, busy {busy * 1e3:.1f} ms" if result.step_s and busy else "")
                  + (f", host operators {host * 1e3:.1f} ms" if host else "")
                  + (f", attention kernel {attention}" if attention else ""))
            write_json(path, doc)
    write_json(path, doc)
    return doc


# ---------------------------------------------------------------------------------------------------
# part 2: exports.json
# ---------------------------------------------------------------------------------------------------
def part_exports(c: Campaign) -> dict[str, Any]:
    """recommend --out for a DeepSpeed and a torch plan on this one GPU (the DeepSpeed plan on the CPU), then validate
    what was written."""
    path = c.out / "exports.json"
    doc = c.doc("exports", plans=[])
    model = EXAMPLES / ("gpt2.py" if c.device == "cuda" else "mlp.py")
    with tempfile.TemporaryDirectory(prefix="optplan_campaign_exports_") as tmp:
        # CPU: the DeepSpeed plan only (its three files; the torch plan's launch.sh and accelerate.yaml run under
        # `optplan validate` with 2 processes in tests/tui/test_cli_probe.py), a GPU both
        for engine in [e for e in (("deepspeed", "torch") if c.device == "cuda" else ("deepspeed",)) if c.wants_engine(e)]:
            if c.left_s() < 30:
                doc["plans"].append({"engine": engine, "skipped": "out of time"})
                continue
            if engine == "deepspeed" and c.deepspeed_error:
                doc["plans"].append({"engine": engine, "skipped": c.deepspeed_error})
                continue
            folder = Path(tmp) / engine
            entry: dict[str, Any] = {"engine": engine, "model": str(model.relative_to(ROOT))}
            # --no-probe --no-calibration: the plan is what the analytic search picks (a GPU would start the
            # probe stage by default, which the grid measures on its own)
            code, out, err = run_optplan(["recommend", str(model), "--gpus", "1", *c.plan_args(), "--engine", engine,
                                       "--no-probe", "--no-calibration", "--out", str(folder), "--json"],
                                      timeout_s=max(30.0, min(300.0, c.left_s())))
            entry["recommend_exit_code"] = code
            if code != 0:
                entry["error"] = last_line(out, err)
                doc["plans"].append(entry)
                write_json(path, doc)
                continue
            rec = json.loads(out)
            entry["plan"] = rec["plan"]
            entry["files"] = sorted(p.name for p in folder.iterdir())
            per_run = int(max(60.0, min(300.0, c.left_s() / (3 if engine == "deepspeed" else 2))))
            code, out, err = run_optplan(["validate", str(folder), str(model), *(["--seq-len", "512"] if c.device == "cuda" else []), "--steps", "2", "--json",
                                       "--timeout", str(per_run)],
                                      timeout_s=max(60.0, min(400.0, c.left_s() + 30)))
            entry["validate_exit_code"] = code
            try:
                report = json.loads(out)
                entry["runs"] = [{"file": r["file"], "how": r["how"], "started": r["started"], "fits": r["fits"],
                                  "status": r["comparison"]["result"]["status"],
                                  "reason": r["comparison"]["result"]["reason"],
                                  "predicted_step_s": r["comparison"]["predicted_step_s"],
                                  "measured_step_s": r["comparison"]["result"]["step_s"],
                                  "notes": r["notes"]} for r in report["runs"]]
            except (json.JSONDecodeError, KeyError, TypeError):
                entry["error"] = last_line(out, err)
            doc["plans"].append(entry)
            for r in entry.get("runs", []):
                r["file"] = Path(r["file"]).name  # the temporary folder is gone after the run
            c.log(f"exports: {engine}: recommend {entry['recommend_exit_code']}, validate {code}: "
                  + ", ".join(f"{r['file']} {r['status']}" for r in entry.get("runs", [])))
            write_json(path, doc)
    launched = [r for p in doc["plans"] for r in p.get("runs", [])]
    doc["summary"] = {"launched": len(launched), "ok": sum(r["status"] == "ok" for r in launched),
                      "files": sorted({r["file"] for r in launched if r["status"] == "ok"})}
    write_json(path, doc)
    return doc


# ---------------------------------------------------------------------------------------------------
# part 2: grid.json (recommendation quality)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GridModel:
    key: str
    path: Path
    seq_len: int | None
    precisions: tuple[str, ...]
    checkpointing: tuple[str, ...]
    micro_batches: tuple[int, ...]
    engines: tuple[str, ...]  # "torch" or "deepspeed-zeroN"


def grid_models(device: str, quick: bool, tmp: Path) -> list[GridModel]:
    """Two models per device (one with --quick on the CPU). On a GPU: GPT-2 small and the Llama-3 1B
    layout (benchmarks/fidelity.py's wrapper pins the size whatever $OPTPLAN_LLAMA_SIZE says), seq 1,024."""
    llama1b = fidelity.llama_wrapper(tmp, None, 1024)
    if device == "cpu":
        # --quick: micro-batch 16 alone, 4 runs (a run is mostly a process start on the CPU; 64 repeats them)
        return [GridModel("mlp", EXAMPLES / "mlp.py", None, ("fp32", "amp-bf16"), ("none", "full"),
                          (16,) if quick else (16, 64), ("torch",)),
                GridModel("gpt2", EXAMPLES / "gpt2.py", 64, ("fp32",), ("none", "full"), (1, 2), ("torch",))][
                    : 1 if quick else 2]
    if quick:
        return [GridModel("gpt2", EXAMPLES / "gpt2.py", 1024, ("amp-bf16", "bf16"), ("none", "full"), (4, 16),
                          ("torch",)),
                GridModel("llama1b", llama1b, 1024, ("bf16",), ("none", "full"), (2, 4), ("torch",))]
    # 16 runs per model (about 10 s each on an H200): fits one 10-minute call with the exports and the traces
    return [GridModel("gpt2", EXAMPLES / "gpt2.py", 1024, ("amp-bf16", "bf16"), ("none", "full"), (4, 16),
                      ("torch", "deepspeed-zero1")),
            GridModel("llama1b", llama1b, 1024, ("amp-bf16", "bf16"), ("none", "full"), (2, 4),
                      ("torch", "deepspeed-zero1"))]


def grid_strategy(model: GridModel, precision: str, ckpt: str, mbs: int, engine: str) -> Strategy:
    kwargs: dict[str, Any] = {"precision": precision, "optimizer": "adamw", "mbs": mbs, "checkpointing": ckpt}
    if engine == "torch":
        kwargs["engine"] = "torch"
    else:
        kwargs.update(engine="deepspeed", zero=int(engine.rsplit("zero", 1)[1]))
    return Strategy(**kwargs)


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None below 3 points or without spread."""
    if len(x) < 3:
        return None

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    if not sx or not sy:
        return None
    return sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True)) / (sx * sy)


def _measure(c: Campaign, model: GridModel, profile: ModelProfile, strategy: Strategy) -> ProbeResult:
    ds = fidelity.ds_config(strategy, profile, torch_optimizer=True)  # no fused-Adam JIT build on a visit
    block = profile.repeated_block.class_name if profile.repeated_block else None
    spec = ProbeSpec(model_path=str(model.path), seq_len=model.seq_len, strategy=strategy, block_class=block,
                     ds_config=ds, device=c.device, warmup_steps=1 if c.device == "cpu" else 2,  # type: ignore[arg-type]
                     timed_steps=2 if c.device == "cpu" else 3)
    return run_probe(spec, timeout_s=max(30.0, min(240.0, c.left_s())))


def _price(profile: ModelProfile, cluster: Cluster, strategy: Strategy, device: str) -> Any:
    """The estimate of ``strategy`` as the grid runs it (DeepSpeed with torch's AdamW: :func:`_measure`), so that the
    ranking and the rank correlation compare the predicted and the measured program alike; None when refused."""
    try:
        return estimate(profile, cluster, strategy,
                        adam_impl=fidelity.probe_adam_impl(strategy, device, ds_torch_optimizer=True))
    except Exception:  # noqa: BLE001 - a configuration the estimators refuse is not in the ranking
        return None


def grid_one(c: Campaign, model: GridModel, doc: dict[str, Any], save: Callable[[], None]) -> dict[str, Any]:
    """Measure one model's grid and judge recommend's pick on it."""
    profile = profile_model_file(model.path, seq_len=model.seq_len)
    cluster = c.cluster(1)
    runs: list[dict[str, Any]] = []
    shown = str(model.path.relative_to(ROOT)) if model.path.is_relative_to(ROOT) else "examples/llama.py 1B layout"
    entry: dict[str, Any] = {"model": model.key, "path": shown, "seq_len": model.seq_len,
                             "params": profile.params, "runs": runs}
    doc["models"].append(entry)
    measured: dict[Strategy, float] = {}
    predicted: dict[Strategy, float] = {}

    local = LocalDevices(device=c.device, name=c.env["device_name"], count=1,
                         catalogue_name=c.gpu.name if c.gpu is not None else None)
    priced: dict[Strategy, Any] = {}

    def price(strategy: Strategy) -> Any:
        if strategy not in priced:
            priced[strategy] = _price(profile, cluster, strategy, c.device)
        return priced[strategy]

    def run(strategy: Strategy, why: str) -> None:
        if c.left_s() < 15:
            runs.append({"strategy": strategy.label(), "status": "skipped", "reason": "out of time", "why": why})
            return
        est = price(strategy)
        pred = est.samples_per_s if est is not None else None
        result = _measure(c, model, profile, strategy)
        meas = (result.samples_per_step / result.step_s) if result.ok and result.step_s else None
        if pred is not None:
            predicted[strategy] = pred
        if meas is not None:
            measured[strategy] = meas
        runs.append({"strategy": strategy.label(), "why": why, "status": result.status, "reason": result.reason,
                     "predicted_samples_per_s": pred, "measured_samples_per_s": meas,
                     "measured_allocated_bytes": result.peak_allocated_bytes, "probe_wall_s": result.wall_s})
        if result.status in ("ok", "oom") and est is not None:
            # predicted as the probe ran it (CPU accounting on the CPU; DeepSpeed with torch's AdamW: _measure)
            impl = fidelity.probe_adam_impl(strategy, c.device, ds_torch_optimizer=True)
            comp = compare_spec(profile, cluster, strategy, strategy, local, c.time_comparable, result,
                                adam_impl=impl)
            doc["measured"].append(measured_case(c, model.key, profile, comp))
        c.log(f"grid: {model.key} {strategy.label()}: {result.status}"
              + (f", measured {meas:.2f} samples/s" if meas else "")
              + (f", predicted {pred:.2f}" if pred else ""))
        save()

    engines = tuple(e for e in model.engines if not (e.startswith("deepspeed") and c.deepspeed_error))
    if len(engines) < len(model.engines):
        entry["skipped_engines"] = c.deepspeed_error
    grid = [grid_strategy(model, p, k, b, e) for e in engines for p in model.precisions
            for k in model.checkpointing for b in model.micro_batches]
    # the planner's choice among exactly these configurations (its ranking: the band's slow end, then the
    # simplest of the ties), so that the pick and the measured runs share batch and accumulation
    fitting = [e for s in grid if (e := price(s)) is not None and e.fits]
    pick = rank(fitting, Goal())[0].strategy if fitting else None
    entry["pick"] = pick.label() if pick is not None else None
    # recommend's free pick over the same precisions and engines, for information (its global batch and
    # accumulation may differ from the grid's, so it is measured but not ranked)
    rec = recommend(profile, cluster, precisions=list(model.precisions), optimizers=["adamw"],
                    engines=sorted({s.engine for s in grid}) or ["torch"], offload=False)
    entry["recommend_pick"] = rec.plan.label() if rec.plan is not None else None
    for s in grid:
        run(s, "grid")
    if rec.plan is not None and all(r["strategy"] != rec.plan.label() for r in runs):
        if c.device == "cpu" and c.quick:  # the MLP's batch of 256 in emulated bf16: ~20 s of CPU for a run not ranked
            entry["recommend_pick_run"] = "not measured in the CPU's --quick run (outside the grid: not ranked)"
        else:
            run(rec.plan, "recommend's free pick (outside the grid: not ranked)")
    both = [s for s in measured if s in predicted]
    entry["measured_runs"] = len(measured)
    entry["spearman_predicted_vs_measured"] = spearman([predicted[s] for s in both], [measured[s] for s in both])
    if measured:
        in_grid = {s: v for s, v in measured.items() if s in set(grid)}
        if pick is not None and pick in in_grid:
            best = max(in_grid, key=in_grid.__getitem__)
            entry["best_measured"] = {"strategy": best.label(), "samples_per_s": in_grid[best]}
            order = sorted(in_grid.values(), reverse=True)
            entry["pick_rank"] = order.index(in_grid[pick]) + 1
            entry["pick_share_of_best"] = in_grid[pick] / in_grid[best]
            entry["meets_target"] = entry["pick_share_of_best"] >= GRID_SHARE_TARGET
        if rec.plan is not None and rec.plan in measured:
            entry["recommend_pick_samples_per_s"] = measured[rec.plan]
    save()
    return entry


def part_grid(c: Campaign) -> dict[str, Any]:
    path = c.out / "grid.json"
    doc = c.doc("grid", gpu=c.gpu_name, time_comparable=c.time_comparable, target_share_of_best=GRID_SHARE_TARGET,
                models=[], measured=[])

    def save() -> None:
        write_json(path, doc)

    with tempfile.TemporaryDirectory(prefix="optplan_campaign_grid_") as tmp:
        for model in grid_models(c.device, c.quick, Path(tmp)):
            if not c.wants(model.key):
                continue
            if c.left_s() < 30:
                doc["models"].append({"model": model.key, "skipped": "out of time"})
                continue
            try:
                grid_one(c, model, doc, save)
            except Exception as exc:  # noqa: BLE001 - one model's failure is data
                doc["models"].append({"model": model.key, "error": f"{type(exc).__name__}: {exc}"})
            save()
    shares = [m["pick_share_of_best"] for m in doc["models"] if "pick_share_of_best" in m]
    doc["summary"] = {"models": len(doc["models"]), "pick_share_of_best": shares,
                      "spearman": [m.get("spearman_predicted_vs_measured") for m in doc["models"]],
                      "meets_target": bool(shares) and all(s >= GRID_SHARE_TARGET for s in shares)}
    save()
    return doc


# ---------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------
PARTS: dict[str, tuple[tuple[str, Callable[[Campaign], dict[str, Any]]], ...]] = {
    "1": (("probes", part_probes), ("fidelity", part_fidelity), ("trace", part_trace), ("gpu_tests", part_gpu_tests)),
    "2": (("exports", part_exports), ("launch", part_launch), ("grid", part_grid)),
}
SECTIONS: dict[str, Callable[[Campaign], dict[str, Any]]] = {n: fn for part in PARTS.values() for n, fn in part}
MODEL_KEYS = tuple(dict.fromkeys(case.model for case in fidelity.SUITE))  # mlp, gpt2, llama, resnet, timm-vit, ...
ENGINE_KEYS = ("torch", "deepspeed")


def _listed(flag: str, value: str | None, allowed: Sequence[str]) -> tuple[str, ...] | str | None:
    """A comma-separated option's names in order, once each (None when not given), or its one-line error."""
    if value is None:
        return None
    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        return f"error: {flag} {value!r}: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(allowed)}"
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where to measure (default: cuda when torch sees a GPU, else cpu)")
    parser.add_argument("--quick", action="store_true", help="small subsets of every section: one 10-minute call")
    parser.add_argument("--part", choices=("1", "2", "all"), default="all",
                        help="1: probes + fidelity + calibration; 2: exports + grid; all: both (default)")
    parser.add_argument("--sections", default=None,
                        help="comma-separated sections to run, in this order, instead of --part's: "
                             + ", ".join(SECTIONS) + " (a GPU visit spends its minutes on what is not yet measured)")
    parser.add_argument("--models", default=None,
                        help="comma-separated models that fidelity, trace and grid keep: " + ", ".join(MODEL_KEYS))
    parser.add_argument("--cases", default=None,
                        help="comma-separated fidelity case filters, each a few words its tag must hold (precision, "
                             "mode, mbs<N>, none/selective/full, compile), e.g. 'compile,bf16 selective'; each "
                             "model's first case (its calibration probe) always runs")
    parser.add_argument("--engines", default=None,
                        help="comma-separated engines whose plans exports and launch keep: " + ", ".join(ENGINE_KEYS))
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON results (created)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="wall-clock budget of this call (s); runs not started in time are recorded as skipped")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print(f"error: --device cuda: torch {torch.__version__} sees no CUDA device; use --device cpu",
              file=sys.stderr)
        return 2
    if args.budget_s <= 0:
        print("error: --budget-s must be > 0 (seconds)", file=sys.stderr)
        return 2
    names = _listed("--sections", args.sections, tuple(SECTIONS))
    wanted = _listed("--models", args.models, MODEL_KEYS)
    engines = _listed("--engines", args.engines, ENGINE_KEYS)
    for listed in (names, wanted, engines):
        if isinstance(listed, str):
            print(listed, file=sys.stderr)
            return 2
    if names is not None:
        sections = [(n, SECTIONS[n]) for n in names]
    else:
        sections = [s for part in (("1", "2") if args.part == "all" else (args.part,)) for s in PARTS[part]]
    models = frozenset(wanted) if wanted is not None else None
    case_filters = None
    if args.cases is not None:
        case_filters = tuple(f.strip() for f in args.cases.split(",") if f.strip())
        words = {w for case in fidelity.SUITE for w in case_tag(case).split()}
        unknown = sorted({w for f in case_filters for w in f.split()} - words)
        if unknown or not case_filters:
            print(f"error: --cases {args.cases!r}: unknown word(s) {', '.join(unknown) or '(empty)'}; use words "
                  f"of a case's tag, e.g. {case_tag(fidelity.SUITE[-1])!r}", file=sys.stderr)
            return 2
    if args.out.exists() and not args.out.is_dir():
        print(f"error: --out {args.out} is a file: give a folder", file=sys.stderr)
        return 2
    started = time.perf_counter()
    gpu, gpu_note = fidelity.catalogue_gpu() if device == "cuda" else (None, "")
    log_lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        log_lines.append(line)
        with contextlib.suppress(OSError):
            (args.out / "campaign.log").write_text("\n".join(log_lines) + "\n")

    args.out.mkdir(parents=True, exist_ok=True)
    c = Campaign(device=device, out=args.out, env=env_record(device), deadline=started + args.budget_s,
                 quick=args.quick, gpu=gpu, log=log, models=models,
                 cases=case_filters, engines=frozenset(engines) if engines is not None else None)
    log(f"campaign: {device} {c.env['device_name']}; torch {c.env['torch']}, CUDA {c.env['cuda']}, driver "
        f"{c.env['driver']}; commit {c.env['commit']}; budget {args.budget_s:.0f} s"
        + (f"; {gpu_note}" if gpu_note else ""))
    written = []
    for name, fn in sections:
        t0 = time.perf_counter()
        try:
            fn(c)
            written.append(name)
        except Exception as exc:  # noqa: BLE001 - a section's crash is reported; the others still run
            log(f"{name}: failed: {type(exc).__name__}: {exc}")
            target = args.out / ("probes.json" if name == "gpu_tests" else f"{name}.json")
            try:  # keep what the section wrote before it crashed
                doc = json.loads(target.read_text())
            except (OSError, json.JSONDecodeError):
                doc = c.doc(name)
            doc["error"] = f"{type(exc).__name__}: {exc}"
            write_json(target, doc)
        log(f"{name}: {time.perf_counter() - t0:.0f} s")
    log(f"campaign: {', '.join(written) or 'nothing'} written to {args.out} in {time.perf_counter() - started:.0f} s")
    return 0 if len(written) == len(sections) else 1


if __name__ == "__main__":
    sys.exit(main())
