"""Stage 2 of the search: probe the best analytic candidates with real short runs, calibrate, re-rank.

After the analytic stage (``planner.search``), the top-k feasible candidates that a probe can run (torch
and DeepSpeed engines, data parallel only) are enqueued as trials of an Optuna study beside the search's
(``<study>-probes``, same storage) and each is run by ``optplan.probes.runtime.run_probe`` for a few
steps. What a probe runs is the candidate scaled to what is local:

* data-parallel degree ``min(dp, local processes)`` (local processes: the local GPUs; 1 on the CPU);
* gradient accumulation at most ``MAX_PROBE_ACCUM`` (the prediction it is compared with uses the same);
* on the CPU one sample per micro-batch and one accumulation step: a CPU probe checks that the plan's
  precision, checkpointing, optimizer and engine run this model and checks memory accounting; its times
  say nothing about a GPU.

Every probe's outcome (ok, oom, nan, timeout, error, pruned) is data. When the probes run on the GPU the
plan is for ("time comparable"):

* a probe whose first timed step is slower than ``prune_factor`` × the best measured seconds per sample
  so far is stopped ("pruned", Optuna's PRUNED state);
* the measured ratios fit a :class:`~optplan.estimators.calibration.Calibration` (``planner.calibrate``),
  stored in the cache so that later runs start calibrated;
* candidates that failed (oom, nan, error, timeout) are dropped from the pick, probed candidates are priced
  with their own measured ÷ predicted ratios (at the plan's own scale this reproduces the measurement),
  the rest with the fitted calibration, and the ranking is redone.

Off the target GPU (e.g. a CPU), probes are reported but do not re-rank: a CPU failure or timing says
nothing certain about an H100.

The total probe time is capped by ``budget_s``; each probe's timeout is the smaller of ``timeout_s`` and
what is left of the budget. Units: seconds, bytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import optuna
from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.calibration import Calibration
from optplan.estimators.compiled_loss import eager_loss_on
from optplan.estimators.errors import Cancelled, OptplanError
from optplan.estimators.estimate import Estimate, calibrate_estimate, estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.memory import memory_breakdown, usable_capacity_bytes
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.temporaries import AdamImpl
from optplan.estimators.units import gib
from optplan.planner.calibrate import (
    ProbeComparison,
    fit_calibration,
    load_calibration,
    profile_hash,
    profile_hashes,
    save_calibration,
    torch_version,
)
from optplan.planner.events import ProgressEvent
from optplan.planner.goal import Goal, rank
from optplan.planner.search import resolve_storage
from optplan.probes.runtime import ProbeResult, ProbeSpec, run_probe

DEFAULT_TOP_K = 4
DEFAULT_BUDGET_S = 600.0
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_PRUNE_FACTOR = 1.5
MAX_PROBE_ACCUM = 4
MIN_PROBE_S = 5.0
"""A probe is not started with less than this much of the budget left (seconds)."""
FAILED = ("oom", "nan", "error", "timeout")

Runner = Callable[..., ProbeResult]


class LocalDevices(BaseModel):
    """What the probes run on: the device kind, its name, how many processes, its catalogue GPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: Literal["cpu", "cuda"]
    name: str
    count: int = Field(ge=1)
    catalogue_name: str | None = None


class ProbeOptions(BaseModel):
    """``recommend --probe``: how many candidates, how long, on what."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    top_k: int = Field(default=DEFAULT_TOP_K, ge=1)
    budget_s: float = Field(default=DEFAULT_BUDGET_S, gt=0, description="total probe time (s)")
    timeout_s: float = Field(default=DEFAULT_TIMEOUT_S, gt=0, description="one probe's limit (s)")
    warmup_steps: int = Field(default=2, ge=0)
    timed_steps: int = Field(default=5, ge=1)
    prune_factor: float = Field(default=DEFAULT_PRUNE_FACTOR, gt=1)
    nproc: int | None = Field(default=None, ge=1, description="local processes; default: local GPUs, 1 on CPU")
    use_cache: bool = True
    cache_path: Path | None = None
    compile: bool = False
    model_name: str | None = None
    microbench: bool = Field(default=True, description="on the planned GPU, measure its ceilings first")


class ProbeReport(BaseModel):
    """The ``probes`` section of ``recommend --json``: every probe, what it changed, the calibration."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str
    device_name: str
    nproc: int
    time_comparable: bool = Field(description="the probes ran on the GPU the plan is for: they re-rank")
    budget_s: float
    spent_s: float
    probed: tuple[ProbeComparison, ...]
    skipped: tuple[str, ...] = Field(default=(), description="candidates not probed, each with why")
    calibration: Calibration | None = None
    cache_file: str | None = None
    reused: int = Field(default=0, description="probes taken from an earlier run's study")


def local_devices(nproc: int | None = None, *, detect: Callable[[], Any] | None = None) -> LocalDevices:
    """The local GPUs (NVML, then torch) or the CPU; ``nproc`` overrides the process count."""
    from optplan.probes.hardware import detect_gpus

    report = (detect or detect_gpus)()
    if getattr(report, "available", False) and report.devices:
        first = report.devices[0]
        return LocalDevices(device="cuda", name=first.name, count=nproc or len(report.devices),
                            catalogue_name=first.catalogue_name)
    import platform
    return LocalDevices(device="cpu", name=platform.processor() or platform.machine() or "cpu", count=nproc or 1)


def local_update(strategy: Strategy, local: LocalDevices) -> dict[str, Any]:
    """What running ``strategy`` here changes (probes and ``optplan validate``): its data-parallel degree to the local
    processes (HSDP on one process is FSDP), and on a CPU one sample per micro-batch without accumulation (a plan's
    micro-batch is sized for its GPU's memory, not the host's)."""
    update: dict[str, Any] = {"dp": min(strategy.dp, local.count)}
    if local.device == "cpu":
        update.update(mbs=1, grad_accum=1)
    if update["dp"] == 1 and strategy.fsdp == "hybrid":
        update["fsdp"] = "full"
    return update


def probe_strategy(strategy: Strategy, local: LocalDevices) -> tuple[Strategy | None, str]:
    """The strategy a probe of ``strategy`` runs here, or None and why it cannot be probed."""
    if strategy.engine == "megatron" or strategy.model_parallel:
        return None, "tensor/pipeline/context parallel plans run on Megatron-LM, which the probe does not start"
    if "nvme" in (strategy.offload_optimizer, strategy.offload_params):
        return None, "NVMe offload needs the plan's NVMe path on every node; not probed"
    if strategy.precision == "fp8":
        return None, "fp8 needs Transformer Engine; not probed"
    update = {"grad_accum": min(strategy.grad_accum, MAX_PROBE_ACCUM), **local_update(strategy, local)}
    try:
        return Strategy.model_validate({**strategy.model_dump(), **update}), ""
    except ValueError as exc:
        return None, f"cannot scale to {local.count} local process(es): {exc}"


def _probe_cluster(cluster: Cluster, probed: Strategy) -> Cluster:
    n = probed.world_size
    return cluster.model_copy(update={"gpus": n, "gpus_per_node": min(cluster.gpus_per_node, n)})


def compare_spec(profile: ModelProfile, cluster: Cluster, candidate: Strategy, probed: Strategy,
                 local: LocalDevices, time_comparable: bool, result: ProbeResult, *,
                 adam_impl: AdamImpl | None = None) -> ProbeComparison:
    """Predict the probed strategy the way the probe ran it and pair it with the measurement. ``adam_impl``:
    the AdamW the probe ran when it is not the engine's own (e.g. a torch client optimizer under DeepSpeed)."""
    small = _probe_cluster(cluster, probed)
    cap = usable_capacity_bytes(cluster.gpu.memory_bytes)
    memory = memory_breakdown(profile, eager_loss_on(probed, local.device), cap, gpus_per_node=small.gpus_per_node, device=local.device,
                              adam_impl=adam_impl, gpu=cluster.gpu.name)
    allocated = memory.total_bytes - memory.overhead_bytes
    step = on_device = comm = None
    if time_comparable:
        est = estimate(profile, small, probed, adam_impl=adam_impl)
        step, comm = est.time.step_s, est.time.exposed_comm_s
        on_device = step - comm
    total = memory.total_bytes if local.device == "cuda" else allocated
    return ProbeComparison(candidate=candidate, probed=probed, predicted_step_s=step, predicted_on_device_s=on_device,
                           predicted_exposed_comm_s=comm, predicted_allocated_bytes=allocated,
                           predicted_total_bytes=total, time_comparable=time_comparable, result=result)


def _ds_config(profile: ModelProfile, probed: Strategy, local: LocalDevices) -> dict[str, Any] | None:
    if probed.engine != "deepspeed":
        return None
    from optplan.planner.export.deepspeed import render_ds_config

    config = render_ds_config(probed, profile)
    if local.device == "cpu":
        config.pop("optimizer", None)  # a client torch optimizer: no fused-Adam JIT build on the CPU
    return config


def _probe_study(storage: str | Path | None, study_name: str) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.create_study(storage=resolve_storage(storage), study_name=f"{study_name}-probes",  # type: ignore[arg-type]
                                   direction="minimize", load_if_exists=True)
    except Exception as exc:  # noqa: BLE001 - any storage problem is the user's to fix
        raise OptplanError(f"cannot open the probe study in {storage} ({type(exc).__name__}: {exc}); "
                           "choose another --storage") from exc


def _probe_key(spec: ProbeSpec) -> str:
    return spec.model_dump_json(exclude={"stop_if_step_slower_than_s"})


def _earlier(study: optuna.Study) -> dict[str, ProbeResult]:
    done: dict[str, ProbeResult] = {}
    for t in study.get_trials(deepcopy=False):
        if not t.state.is_finished() or "probe_key" not in t.user_attrs or "result" not in t.user_attrs:
            continue
        try:
            done[t.user_attrs["probe_key"]] = ProbeResult.model_validate(t.user_attrs["result"])
        except ValueError:
            continue
    return done


def _tell(study: optuna.Study, spec: ProbeSpec, label: str, result: ProbeResult) -> None:
    study.enqueue_trial({}, user_attrs={"probe_key": _probe_key(spec), "label": label})
    trial = study.ask()
    trial.set_user_attr("result", result.model_dump(mode="json"))
    trial.set_user_attr("status", result.status)
    if result.status == "ok" and result.step_s and result.samples_per_step:
        study.tell(trial, result.step_s / result.samples_per_step)
    elif result.status == "pruned":
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


def run_probe_stage(profile: ModelProfile, cluster: Cluster, ranked: Sequence[Estimate], *,
                    options: ProbeOptions | None = None, local: LocalDevices | None = None,
                    storage: str | Path | None = None, study_name: str = "optplan",
                    runner: Runner = run_probe,
                    on_progress: Callable[[ProgressEvent], None] | None = None,
                    cancelled: Callable[[], bool] | None = None) -> ProbeReport:
    """Probe the top-k feasible candidates of ``ranked`` (best first); never raises for a probe's outcome.

    ``cancelled`` is checked before each probe and handed to the runner, which stops a running probe's
    processes when it turns true; then :class:`~optplan.estimators.errors.Cancelled` is raised (the probes
    told so far stay in the study)."""
    options = options or ProbeOptions()
    local = local or local_devices(options.nproc)
    notify = on_progress or (lambda _e: None)
    comparable = local.device == "cuda" and local.catalogue_name == cluster.gpu.name
    study = _probe_study(storage, study_name)
    earlier = _earlier(study)
    picked: list[tuple[Estimate, Strategy]] = []
    skipped: list[str] = []
    for e in ranked:
        if len(picked) >= options.top_k:
            break
        if not e.fits:
            continue
        probed, why = probe_strategy(e.strategy, local)
        if probed is None:
            skipped.append(f"{e.strategy.label()}: {why}")
            continue
        if any(p == probed for _, p in picked):
            continue
        picked.append((e, probed))
    started = time.monotonic()
    comparisons: list[ProbeComparison] = []
    best_s_per_sample = math.inf
    reused = 0
    block = profile.repeated_block.class_name if profile.repeated_block else None
    for i, (e, probed) in enumerate(picked):
        label = e.strategy.label()
        left = options.budget_s - (time.monotonic() - started)
        if left < MIN_PROBE_S:
            skipped.append(f"{label}: probe budget of {options.budget_s:g} s spent")
            continue
        notify(ProgressEvent(stage="probe", done=i, total=len(picked), message=f"probing {label}"))
        try:
            ds_config = _ds_config(profile, probed, local)
        except OptplanError as exc:
            skipped.append(f"{label}: {exc}")
            continue
        threshold = None
        if comparable and math.isfinite(best_s_per_sample):
            threshold = options.prune_factor * best_s_per_sample * probed.mbs * probed.grad_accum * probed.dp
        spec = ProbeSpec(model_path=profile.path, model_name=options.model_name, seq_len=profile.seq_len,
                         strategy=probed, block_class=block, ds_config=ds_config, device=local.device,
                         nproc=probed.dp, warmup_steps=options.warmup_steps, timed_steps=options.timed_steps,
                         stop_if_step_slower_than_s=threshold, compile=options.compile)
        key = _probe_key(spec)
        if key in earlier:
            result, reused = earlier[key], reused + 1
        else:
            if cancelled is not None and cancelled():
                raise Cancelled("cancelled between probes")
            stop = {} if cancelled is None else {"cancelled": cancelled}
            result = runner(spec, timeout_s=min(options.timeout_s, left), **stop)
            _tell(study, spec, label, result)
        comparison = compare_spec(profile, cluster, e.strategy, probed, local, comparable, result)
        comparisons.append(comparison)
        if result.status == "ok" and result.step_s and result.samples_per_step:
            best_s_per_sample = min(best_s_per_sample, result.step_s / result.samples_per_step)
        notify(ProgressEvent(stage="probe", done=i + 1, total=len(picked),
                             message=f"{label}: {describe_result(comparison)}"))
    gpu = cluster.gpu.name if comparable else local.device
    calibration = fit_calibration(comparisons, gpu=gpu, model_hash=profile_hash(profile), torch_version=torch_version())
    if calibration is not None:
        study.set_user_attr("calibration", calibration.model_dump(mode="json"))
    cache_file = None
    if calibration is not None and comparable and options.use_cache:
        cache_file = str(save_calibration(calibration, path=options.cache_path))
    return ProbeReport(device=local.device, device_name=local.name, nproc=local.count, time_comparable=comparable,
                       budget_s=options.budget_s, spent_s=time.monotonic() - started, probed=tuple(comparisons),
                       skipped=tuple(skipped), calibration=calibration, cache_file=cache_file, reused=reused)


def measured_cluster(cluster: Cluster, local: LocalDevices, *, bench: Callable[..., Any] | None = None,
                     cancelled: Callable[[], bool] | None = None) -> tuple[Cluster, list[str]]:
    """``cluster`` with the microbenchmarked ceilings of the local GPUs (matmul per dtype, copy bandwidth,
    all-reduce bus bandwidth) in place of the datasheet's, when the local GPUs are the planned ones; the
    lines say what was measured against the datasheet. Elsewhere ``cluster`` is returned unchanged.
    A failing microbenchmark keeps the datasheet figures and says why (it never stops the plan);
    ``cancelled`` turning true stops it (Cancelled, as ``run_probe_stage``)."""
    from optplan.estimators.ceilings import ceiling_report, gpu_with_measured_ceilings
    from optplan.probes.microbench import MicrobenchError, run_microbench

    if local.device != "cuda" or local.catalogue_name != cluster.gpu.name:
        return cluster, []
    ranks = min(local.count, cluster.gpus_per_node)
    try:
        stop = {} if cancelled is None else {"cancelled": cancelled}
        result = (bench or run_microbench)(device="cuda", quick=True, allreduce_nproc=ranks if ranks > 1 else 0,
                                           **stop)
    except MicrobenchError as exc:
        return cluster, [f"microbenchmarks failed, datasheet ceilings kept: {exc}"]
    measured = result.ceilings()
    gpu = gpu_with_measured_ceilings(cluster.gpu, measured)
    return cluster.model_copy(update={"gpu": gpu}), ceiling_report(cluster.gpu, measured)


def cached_calibration(profile: ModelProfile, cluster: Cluster, *, path: Path | None = None) -> Calibration | None:
    """The calibration an earlier probe run stored for this GPU, model and torch version (or None)."""
    return load_calibration(cluster.gpu.name, profile_hashes(profile), torch_version(), path=path)


def _measured(e: Estimate, c: ProbeComparison, calibration: Calibration | None) -> Estimate:
    """``e`` corrected by this candidate's own measured ÷ predicted ratios (time and memory)."""
    ratio = c.time_ratio or 1.0
    mem = c.memory_ratio
    own = Calibration(gpu=e.gpu, model_hash="probe", compute_scale=ratio, comm_scale=ratio,
                      allocated_scale=mem if mem is not None else 1.0,
                      fragmentation_fraction=calibration.fragmentation_fraction if calibration else None,
                      context_bytes=calibration.context_bytes if calibration else None,
                      time_probes=1 if c.time_ratio else 0, memory_probes=1 if mem is not None else 0)
    return calibrate_estimate(e, own)


def rerank(ranked: Sequence[Estimate], report: ProbeReport, goal: Goal,
           reprice: Callable[[Strategy], Estimate | None]) -> tuple[tuple[Estimate, ...], tuple[str, ...]]:
    """The ranking after probing, and one line per candidate the probes dropped.

    Only time-comparable probes re-rank. ``reprice`` prices a strategy with the fitted calibration (the
    planner's Pricer); the raw estimate in ``ranked`` is what a probed candidate's own ratios correct."""
    if not report.time_comparable:
        return tuple(ranked), ()
    by_candidate = {c.candidate: c for c in report.probed}
    out: list[Estimate] = []
    dropped: list[str] = []
    for e in ranked:
        c = by_candidate.get(e.strategy)
        if c is not None and c.result.status in FAILED:
            dropped.append(f"{e.strategy.label()}: probe {c.result.status}: {c.result.reason}")
            continue
        if c is not None and c.result.status == "ok":
            out.append(_measured(e, c, report.calibration))
        else:
            out.append(reprice(e.strategy) or e)
    return rank(out, goal), tuple(dropped)


def describe_result(c: ProbeComparison) -> str:
    """One line: status, measured vs predicted step time and peak memory."""
    r = c.result
    if r.status != "ok":
        return f"{r.status}: {r.reason}" if r.reason else r.status
    parts = []
    if r.step_s is not None:
        if c.predicted_step_s:
            parts.append(f"step {r.step_s:.3g} s (predicted {c.predicted_step_s:.3g} s, "
                         f"{100 * (r.step_s / c.predicted_step_s - 1):+.0f}%)")
        else:
            parts.append(f"step {r.step_s:.3g} s on {r.device_name or c.result.spec.device} (not the planned GPU: "
                         "no predicted time to compare)")
    if r.peak_allocated_bytes is not None:
        parts.append(f"peak {gib(r.peak_allocated_bytes):.2f} GiB (predicted {gib(c.predicted_allocated_bytes):.2f} "
                     f"GiB, {100 * ((c.memory_ratio or 1) - 1):+.1f}%)")
    return "ok: " + ", ".join(parts)


def probe_lines(report: ProbeReport, dropped: Sequence[str]) -> list[str]:
    """Rationale lines for the probe stage."""
    n_ok = sum(c.result.status == "ok" for c in report.probed)
    where = f"{report.nproc} x {report.device_name}" if report.device == "cuda" else f"the CPU ({report.device_name})"
    head = (f"probes: {len(report.probed)} candidate(s) run for real on {where} in {report.spent_s:.0f} s "
            f"({n_ok} ok); ")
    if report.time_comparable:
        head += "measured figures re-ranked the plans"
    else:
        head += ("not the planned GPU, so they checked that each plan runs and its memory accounting; "
                 "the ranking stays analytic")
    lines = [head]
    lines += [f"probe {c.candidate.label()}: {describe_result(c)}" for c in report.probed]
    lines += [f"dropped {d}" for d in dropped]
    cal = report.calibration
    if cal is not None and report.time_comparable:
        lines.append(f"calibration: compute × {cal.compute_scale:.3f}, communication × {cal.comm_scale:.3f}, "
                     f"allocated memory × {cal.allocated_scale:.3f}"
                     + (f", saved to {report.cache_file}" if report.cache_file else ""))
    return lines
