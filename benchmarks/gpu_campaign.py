"""One command that measures everything a GPU can tell optplan, and keeps the results (issue 16).

GPU time comes in short visits (one H100 or H200, ten minutes a command, no package index), so every
measurement is scripted here and every result is written as JSON under ``--out`` as soon as it exists
(a killed run keeps what it measured). Sections, each one file:

* ``probes.json`` (part 1): the GPU paths of the probes: a CUDA OOM becomes data (a probe under a memory
  cap ends with status "oom", not a crash), the microbenchmarks (matmul per dtype, copy bandwidth,
  a head's GEMMs with an odd vocabulary against a padded one and the alignment exponent they give, causal SDPA
  by backend at 4k-64k tokens: the attention fractions the time model prices) against the catalogue's peaks, and the GPU-only probe tests of ``tests/probes`` (allocator figures, the OOM cap, the hung
  probe's memory freed after its kill), run by pytest.
* ``fidelity.json`` (part 1): ``benchmarks/fidelity.py``'s suite (GPT-2 small, Llama-3 1B, ResNet-50,
  the MLP; fp32, amp-bf16, bf16, bf16-pure; checkpointing on and off; torch single process and DeepSpeed
  ZeRO-0..3 at world size 1): predicted allocated bytes against ``max_memory_allocated``, the
  ``max_memory_reserved`` margin (the fragmentation margin's first measurement), and step times against
  the uncalibrated and the calibrated prediction. Then ``calibration``: the results are fitted into a
  calibration cache (``planner/results.py``, what ``optplan calibrate fidelity.json`` does), read back and
  used for an estimate, and the step-time error before and after is recorded.
* ``trace.json`` (part 1, benchmarks/campaign_trace.py): where the step time goes: a few of the fidelity suite's
  runs (those the H200 visits' time errors were largest on) with two extra steps under ``torch.profiler`` after their
  timed steps (``ProbeSpec.trace_steps``, probes/step_trace.py), their kernel time per step by category (GEMM,
  attention, optimizer, communication, other) beside the predicted step's parts (compute, memory-bound, optimizer,
  host). The fidelity section traces these runs in its own probes; the trace section runs only the rest.
* ``exports.json`` (part 2, benchmarks/campaign_exports.py): ``optplan recommend --out`` for a DeepSpeed and a torch plan of a model file
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

This file holds the probes and fidelity (with the calibration round trip) sections and the command line; the others
have modules of their own beside it: ``campaign_trace.py``, ``campaign_exports.py``, ``campaign_launch.py``,
``campaign_grid.py``,
with ``campaign_core.py`` (the ``Campaign`` a section is handed, the env record) and ``campaign_io.py`` (atomic JSON
writes, commands run with a timeout).

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

A part runs in stages (``PARTS``): part 1 the probes, then the GPU tests beside fidelity, then trace; part 2 exports,
launch and grid at once. With ``--jobs`` > 1 a stage's sections run together and every probe of the campaign takes
one device lock (``$OPTPLAN_DEVICE_LOCK``, set for the run: a GPU test holds it for its body, tests/probes/conftest.py;
a launch around its train.py), so their host work overlaps and their device work does not; ``--jobs 1`` runs them
one after another. ``--sections`` (probes, gpu_tests, fidelity, trace, exports, launch, grid) replaces ``--part``'s
list, one at a time in the order given, so that a visit spends its minutes on what earlier visits left unmeasured; ``--models`` (mlp, gpt2, llama, resnet, timm-vit, timm-resnet) keeps only
those models in fidelity, trace and grid; ``--engines`` (torch, deepspeed) keeps those plans in exports and launch.

``--budget-s`` (default 480) bounds one call: runs not started in time are recorded as "out of time".
``--jobs`` (default 4 on a GPU, 3 on the CPU) runs that many probes of fidelity, trace and grid at once: each imports while another steps,
and each takes the device in turn after its imports (benchmarks/probe_pool.py; the visits' probes spent 6-15 s before
their first step and 1-3 s stepping); the models are profiled ahead, four at once. ``--jobs 1``: one at a time.
With ``--jobs`` > 1 the campaign names a quiet group (``$OPTPLAN_QUIET_GROUP``, probes/host_quiet.py): the probe holding
the device stops the campaign's other processes (imports, profiles) for its timed and traced steps, so that a step
paced by the host reads as when run alone (the seventh visit's host-paced steps read 12 % slower in median, up to
1.79x, without it). Each probe records the host's speed there (``host_op_s``) and the env record the host CPU.
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
pick outside it is named, not run. About 280 s of CPU in all (fidelity 95 with its 6 single-process cases, exports 65, grid 40, launch 25, gpu_tests
20, probes 12, trace 9, start 8), about 450 s wall on 2 cores at twice their load:
the test passes ``--budget-s 1500``, as the 480 s default is a GPU visit's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity  # noqa: E402
import fidelity_report  # noqa: E402
import fidelity_suite  # noqa: E402
from campaign_core import (  # noqa: E402
    DEFAULT_BUDGET_S,
    DEFAULT_JOBS,
    EXAMPLES,
    Campaign,
    case_tag,
    device_held_s,
    env_record,
    measured_case,
    median_max,
    pct,
    spread,
)
from campaign_exports import part_exports  # noqa: E402
from campaign_grid import part_grid  # noqa: E402
from campaign_io import ROOT, run_command, write_json  # noqa: E402
from campaign_launch import part_launch  # noqa: E402
from campaign_trace import part_trace, trace_steps_for  # noqa: E402

from optplan.estimators.estimate import estimate  # noqa: E402
from optplan.estimators.profile import ModelProfile  # noqa: E402
from optplan.estimators.strategy import Strategy  # noqa: E402
from optplan.planner.calibrate import load_calibration, profile_hash, save_calibration  # noqa: E402
from optplan.planner.results import calibrations_from_results  # noqa: E402
from optplan.probes.device_lock import DEVICE_LOCK_ENV  # noqa: E402
from optplan.probes.host_quiet import QUIET_ENV, owned_group  # noqa: E402
from optplan.probes.runtime import ProbeSpec, run_probe  # noqa: E402


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
        # fp8 with fast accumulation (Transformer Engine's forward GEMMs): beside gemm_measured.yaml's fp8 fraction
        doc["fast_accum_share_of_catalogue_peak"] = {d: v / c.gpu.peak_flops[d]  # type: ignore[index]
                                                     for d, v in bench.matmul_fast_accum_flops_per_s.items()
                                                     if c.gpu.peak_flops.get(d)}  # type: ignore[call-overload]
        doc["copy_share_of_catalogue_hbm"] = bench.copy_bytes_per_s / c.gpu.memory_bandwidth_bytes_per_s
        # causal SDPA by backend and sequence: the fractions estimators/data/attention_kernels.yaml tabulates
        doc["attention_fractions_of_bf16_peak"] = {
            name: {str(seq): list(pair) for seq, pair in by_seq.items()}
            for name, by_seq in bench.attention_fractions(c.gpu.peak_flops_for("bf16")).items()}
    # the alignment exponent the time model takes from the odd-vocabulary GEMMs (their slowdown is in the result)
    from optplan.estimators.ceilings import measured_alignment

    alignment = measured_alignment(bench.ceilings())
    doc["alignment_exponent"] = None if alignment is None else {"dtype": alignment[0], "gamma": alignment[1]}
    return doc


def gpu_tests(c: Campaign) -> dict[str, Any]:
    """The GPU-only probe tests (skipped on a machine without CUDA): each test's outcome, from pytest's
    JUnit XML report."""
    import xml.etree.ElementTree as ET

    with tempfile.TemporaryDirectory(prefix="optplan_campaign_pytest_") as tmp:
        report = Path(tmp) / "junit.xml"
        # the microbenchmark test repeats what microbench() measured: left out on the GPU to save its time.
        # One process (-n 0): pyproject's -n auto would start up to four workers, each importing torch beside the
        # fidelity section's probes, for tests that run one after another anyway (one file; each holds the lock)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               "tests/probes", "-k", "(cuda and not microbench) or hung" if c.device == "cuda" else "cuda",
               "-n", "0"]
        code, out, err = run_command(cmd, max(30.0, min(300.0, c.left_s())))
        text = out + err
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
        shown = {k: v for k, v in doc[name].items()
                 if k in ("status", "ok", "counts", "error", "skipped", "alignment_exponent")}
        c.log(f"probes: {name}: {json.dumps(shown)}")
        write_json(path, doc)
    return doc


def part_gpu_tests(c: Campaign) -> dict[str, Any]:
    """The GPU-only tests, second in part 1 (about a minute, the hung-probe test waiting out its 30 s timeout; last,
    they fell out of the fifth and sixth visits' time): added to probes.json."""
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
PROBE_FIELDS = ("non_torch_bytes", "setup_s", "device_wait_s", "timeline_s", "device_handed_over",
                "device_residue_bytes", "previous_exit_wait_s", "cuda_initialized_before_lock", "host_op_s",
                "quieted_processes")
"""ProbeResult fields a fidelity case's record copies as they are (None without a probe)."""


def row_record(row: fidelity_report.Row) -> dict[str, Any]:
    r = row.result
    ok = r is not None and row.ok
    return {
        "model": row.model, "label": row.label, "nproc": row.nproc,
        "status": r.status if r is not None else "skipped", "reason": (r.reason if r is not None else row.skipped),
        "predicted_allocated_bytes": row.pred_bytes,
        "measured_allocated_bytes": row.meas_bytes if row.ok else None,
        "measured_reserved_bytes": r.peak_reserved_bytes if ok else None,
        "reserved_margin": ((r.peak_reserved_bytes / r.peak_allocated_bytes - 1)
                            if ok and r.peak_reserved_bytes and r.peak_allocated_bytes else None),
        "memory_error_pct": pct(row.pred_bytes, row.meas_bytes) if row.ok else None,
        "predicted_step_s": row.pred_step_s, "calibrated_step_s": row.cal_step_s,
        "measured_step_s": r.step_s if ok else None,
        "time_error_pct": pct(row.pred_step_s, r.step_s) if ok else None,
        "calibrated_time_error_pct": pct(row.cal_step_s, r.step_s) if ok and not row.is_calibration else None,
        "is_calibration_probe": row.is_calibration, "probe_wall_s": r.wall_s if r is not None else None,
        "device_held_s": device_held_s(r),
        **{name: getattr(r, name) if r is not None else None for name in PROBE_FIELDS},
        "traced": r is not None and r.step_trace is not None, "note": row.time_note,
    }


def part_fidelity(c: Campaign) -> dict[str, Any]:
    path = c.out / "fidelity.json"
    profiles: dict[str, ModelProfile] = {}
    rows: list[fidelity_report.Row] = []
    doc = c.doc("fidelity", gpu=c.gpu_name, targets={
        "cpu_memory_pct": fidelity.CPU_MEMORY_TARGET, "gpu_memory_median_max_pct": fidelity.GPU_MEMORY_TARGET,
        "gpu_time_calibrated_median_pct": fidelity.GPU_TIME_TARGET}, cases=[], measured=[])

    def on_model(key: str, model: fidelity_suite.Model, profile: ModelProfile | None, profile_s: float) -> None:
        if profile is not None:
            profiles[key] = profile
        c.log(f"fidelity: {key}: {'profiled' if profile else 'profiling failed'} in {profile_s:.1f} s")

    def on_row(row: fidelity_report.Row) -> None:
        rows.append(row)
        if row.result is not None and row.result.spec.trace_steps and row.model in profiles:
            c.traced[(row.model, row.label)] = (profiles[row.model], row.result)  # the trace section's, even failed
        doc["cases"].append(row_record(row))
        if row.comparison is not None and row.result is not None and row.model in profiles:
            doc["measured"].append(measured_case(c, row.model, profiles[row.model], row.comparison))
        c.log("fidelity: " + fidelity_report.format_row(row, c.device))
        doc["summary"] = fidelity_summary(doc["cases"])
        write_json(path, doc)

    ds_error = c.deepspeed_error
    doc["deepspeed_optimizer"] = ("torch AdamW (foreach) as the client optimizer: no fused-Adam JIT build "
                                  "(no nvcc or time for it on a visit); the prediction follows")
    wanted = None if c.models is None else {case.model for case in fidelity_suite.SUITE if c.wants(case.model)}
    suite = fidelity.select_cases(c.device, c.quick, wanted)
    firsts = {id(next(x for x in suite if x.model == key)) for key in {x.model for x in suite}}

    def skip(case: fidelity_suite.Case) -> str | None:
        if not c.keeps_case(case, id(case) in firsts):
            return "not in --cases"
        return ds_error if ds_error and case.mode.startswith("zero") else None

    fidelity.run_suite(c.device, quick=c.quick, wanted=wanted, timeout_s=300.0, deadline=c.deadline,
                       ds_torch_optimizer=True, on_model=on_model, on_row=on_row, skip=skip, jobs=c.jobs,
                       trace=trace_steps_for(c))
    doc["summary"] = fidelity_summary(doc["cases"])
    write_json(path, doc)
    held = doc["summary"]["device_held_s"]
    if held["n"]:
        c.log(f"fidelity: device lock held {held['sum']:.0f} s over {held['n']} probes (median {held['median']:.1f} s, "
              f"{held['min']:.1f}-{held['max']:.1f} s); handed over before exit: "
              f"{sum(x.get('device_handed_over') is True for x in doc['cases'])}; CUDA touched before the lock: "
              f"{sum(x.get('cuda_initialized_before_lock') is True for x in doc['cases'])}; quiet host: "
              f"{doc['summary']['quieted']}; host op {doc['summary']['host_op_us']['median'] or 0:.2f} us median")
    doc["calibration"] = calibration_round_trip(c, path, rows, profiles)
    write_json(path, doc)
    return doc




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
        "device_held_s": spread([x["device_held_s"] for x in cases if x.get("device_held_s") is not None]),
        "host_op_us": spread([x["host_op_s"] * 1e6 for x in cases if x.get("host_op_s") is not None]),
        "quieted": sum(x.get("quieted_processes") is not None for x in cases),
    }


def calibration_round_trip(c: Campaign, results: Path, rows: list[fidelity_report.Row],
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
# main
# ---------------------------------------------------------------------------------------------------
SECTIONS: dict[str, Callable[[Campaign], dict[str, Any]]] = {
    "probes": part_probes, "gpu_tests": part_gpu_tests, "fidelity": part_fidelity, "trace": part_trace,
    "exports": part_exports, "launch": part_launch, "grid": part_grid,
}
PARTS: dict[str, tuple[tuple[str, ...], ...]] = {
    # stages in order; a stage's sections run at once with --jobs > 1 (one after another with --jobs 1), sharing the
    # device through one lock: the GPU tests (a minute, 30 s of it a hung probe waited out; last in part 1 they fell
    # out of the fifth and sixth visits' time) beside fidelity; exports, launch and grid together (their recommend,
    # calibrate and profiles on the host, 325 s one after another on the seventh visit, the Llama grid left out)
    "1": (("probes",), ("gpu_tests", "fidelity"), ("trace",)),
    "2": (("exports", "launch", "grid"),),
}
MODEL_KEYS = tuple(dict.fromkeys(case.model for case in fidelity_suite.SUITE))  # mlp, gpt2, llama, resnet, timm-vit, ...
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
    parser.add_argument("--jobs", type=int, default=None,
                        help=f"probes at once in fidelity, trace and grid (default {DEFAULT_JOBS['cuda']} on a GPU, "
                             f"{DEFAULT_JOBS['cpu']} on the CPU): each imports while another steps, and takes the "
                             "device in turn (benchmarks/probe_pool.py); 1: one at a time")
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
    if args.jobs is None:
        args.jobs = DEFAULT_JOBS[device]
    if args.jobs < 1:
        print(f"error: --jobs must be >= 1 (got {args.jobs}); 1 runs one probe at a time", file=sys.stderr)
        return 2
    names = _listed("--sections", args.sections, tuple(SECTIONS))
    wanted = _listed("--models", args.models, MODEL_KEYS)
    engines = _listed("--engines", args.engines, ENGINE_KEYS)
    for listed in (names, wanted, engines):
        if isinstance(listed, str):
            print(listed, file=sys.stderr)
            return 2
    if names is not None:  # one at a time, in the order given
        stages: list[tuple[str, ...]] = [(n,) for n in names]
    else:
        stages = [stage for part in (("1", "2") if args.part == "all" else (args.part,)) for stage in PARTS[part]]
    models = frozenset(wanted) if wanted is not None else None
    case_filters = None
    if args.cases is not None:
        case_filters = tuple(f.strip() for f in args.cases.split(",") if f.strip())
        words = {w for case in fidelity_suite.SUITE for w in case_tag(case).split()}
        unknown = sorted({w for f in case_filters for w in f.split()} - words)
        if unknown or not case_filters:
            print(f"error: --cases {args.cases!r}: unknown word(s) {', '.join(unknown) or '(empty)'}; use words "
                  f"of a case's tag, e.g. {case_tag(fidelity_suite.SUITE[-1])!r}", file=sys.stderr)
            return 2
    if args.out.exists() and not args.out.is_dir():
        print(f"error: --out {args.out} is a file: give a folder", file=sys.stderr)
        return 2
    started = time.perf_counter()
    gpu, gpu_note = fidelity_report.catalogue_gpu() if device == "cuda" else (None, "")
    log_lines: list[str] = []

    log_guard = threading.Lock()  # sections log from worker threads (exports, launch)

    def log(line: str) -> None:
        with log_guard:
            print(line, flush=True)
            log_lines.append(line)
            with contextlib.suppress(OSError):
                (args.out / "campaign.log").write_text("\n".join(log_lines) + "\n")

    args.out.mkdir(parents=True, exist_ok=True)
    c = Campaign(device=device, out=args.out, env=env_record(device), deadline=started + args.budget_s,
                 quick=args.quick, gpu=gpu, log=log, models=models,
                 cases=case_filters, engines=frozenset(engines) if engines is not None else None, jobs=args.jobs)
    log(f"campaign: {device} {c.env['device_name']}; torch {c.env['torch']}, CUDA {c.env['cuda']}, driver "
        f"{c.env['driver']}; commit {c.env['commit']}; budget {args.budget_s:.0f} s; jobs {args.jobs}"
        + ("; quiet host" if args.jobs > 1 else "")
        + (f"; {gpu_note}" if gpu_note else ""))
    written: list[str] = []

    def run_section(name: str) -> None:
        t0 = time.perf_counter()
        try:
            SECTIONS[name](c)
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

    with tempfile.TemporaryDirectory(prefix="optplan_campaign_") as tmp, shared_host(args.jobs, Path(tmp)):
        for stage in stages:
            if args.jobs == 1 or len(stage) == 1:
                for name in stage:
                    run_section(name)
            else:
                with ThreadPoolExecutor(max_workers=len(stage), thread_name_prefix="section") as pool:
                    list(pool.map(run_section, stage))
    order = [n for stage in stages for n in stage]
    written.sort(key=order.index)
    log(f"campaign: {', '.join(written) or 'nothing'} written to {args.out} in {time.perf_counter() - started:.0f} s")
    return 0 if len(written) == len(order) else 1


@contextlib.contextmanager
def shared_host(jobs: int, folder: Path) -> Iterator[None]:
    """With ``jobs`` > 1, for the block: one device lock for every section (``$OPTPLAN_DEVICE_LOCK``, in
    ``folder``: probes of sections run at once take the device in turn) and a quiet group (``$OPTPLAN_QUIET_GROUP``:
    the lock's holder stops the others for its timed steps, probes/host_quiet.py). Every process the sections start
    inherits both; this one, their ancestor, is never stopped. A variable already set is kept (the caller's)."""
    if jobs == 1:
        yield
        return
    with contextlib.ExitStack() as stack:
        wanted = {DEVICE_LOCK_ENV: str(folder / "device.lock")}
        if QUIET_ENV not in os.environ:  # this campaign owns the group: it continues what a killed holder stopped
            wanted[QUIET_ENV] = stack.enter_context(owned_group(folder / "quiet"))
        added = {k: v for k, v in wanted.items() if k not in os.environ}
        os.environ.update(added)
        try:
            yield
        finally:
            for key in added:
                os.environ.pop(key, None)


if __name__ == "__main__":
    sys.exit(main())
