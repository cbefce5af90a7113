"""``optplan validate DIR_OR_FILE model.py``: run the exported launch config itself for a few steps.

Checking a config with its trainer's loader (planner/validate.py) proves that it parses; this proves that
it starts and fits. Each exported file that drives a run is run through the probe child
(``optplan.probes.runtime``) with the model file's example batch:

* ``ds_config.json``: the config as written, through ``deepspeed.initialize`` (the DeepSpeed engine); the
  strategy comes from plan.json beside it, else is read from the config (ZeRO stage, bf16/fp16, batch
  triple, offload, activation checkpointing).
* ``launch.sh``: its torchrun (or deepspeed launcher) arguments are read without running the script
  (``launch_argv``); the plan's processes per node are started by torchrun here, single node, with the
  plan's strategy (from plan.json) in place of the training script.
* ``accelerate.yaml``: started with ``accelerate launch --config_file accelerate.yaml`` so that accelerate's
  own launcher reads it; the probe child prepares the model through ``Accelerator``.

The run uses the local devices: at most as many processes as there are local GPUs (1 on the CPU unless
``nproc`` says otherwise). When that is fewer than the plan's data-parallel degree, the batch triple is
scaled to the local world (``train_batch_size = mbs × accumulation × processes``) and the report says so;
predictions are made for what actually ran. Units: seconds and bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.planner.calibrate import ProbeComparison
from optplan.planner.export.context import FILE_NAMES, ExportPlan
from optplan.planner.probe_stage import (
    LocalDevices,
    compare_spec,
    describe_result,
    local_devices,
    local_update,
)
from optplan.probes.device_lock import DEVICE_LOCK_ENV, lock_from_env
from optplan.probes.host_quiet import QUIET_ENV, group_from_env, owned_group
from optplan.probes.runtime import ProbeResult, ProbeSpec, run_probe

RUNNABLE = ("ds_config.json", "launch.sh", "accelerate.yaml")
DEFAULT_TIMEOUT_S = 600.0


class ValidationRun(BaseModel):
    """One exported file run for real: did it start, did it fit, how fast against the prediction."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str
    how: str = Field(description="what was started, e.g. 'deepspeed.initialize, 2 processes (plan: 8)'")
    started: bool
    fits: bool | None = Field(description="None when it did not get far enough to tell")
    comparison: ProbeComparison
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.comparison.result.status == "ok"

    def line(self) -> str:
        return f"{self.file}: {self.how}: {describe_result(self.comparison)}"


class ValidationReport(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str
    model_path: str
    device: str
    runs: tuple[ValidationRun, ...]

    @property
    def ok(self) -> bool:
        return bool(self.runs) and all(r.ok for r in self.runs)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OptplanError(f"{path} does not exist: give the folder recommend --out wrote, or one of its files") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OptplanError(f"cannot read {path} ({exc}): check its permissions") from None
    except json.JSONDecodeError as exc:
        raise OptplanError(f"{path} is not JSON ({exc.msg} at line {exc.lineno}): re-export it") from None
    if not isinstance(doc, dict):
        raise OptplanError(f"{path} is not a JSON object: re-export it")
    return doc


def _plan_beside(folder: Path) -> ExportPlan | None:
    plan_file = folder / FILE_NAMES["plan"]
    if not plan_file.exists():
        return None
    from optplan.planner.export.report import load_plan_json

    _rec, export = load_plan_json(plan_file.read_text(encoding="utf-8"), str(plan_file))
    return export


def check_same_model(plan: ExportPlan, profile: ModelProfile, path: Path) -> None:
    """One line when the plan.json beside ``path`` was planned for another model file than the one given: its
    predictions (and the launch files' batch and sharding) are that model's, so a run of this one checks nothing.
    A file of the same name elsewhere (a copied folder) is taken as the same model."""
    planned, given = plan.model_path, profile.path
    if not planned or not given:
        return
    a, b = Path(planned), Path(given)
    if a.name == b.name or a.resolve() == b.resolve():
        return
    raise OptplanError(f"{path.parent / 'plan.json'} was planned for {planned}, not {given}: validate with that model "
                       "file, or re-plan for this one (optplan recommend MODEL --out DIR)")


def strategy_from_ds_config(cfg: dict[str, Any], source: str = "ds_config.json") -> Strategy:
    """The Strategy a ds_config.json describes (data parallel, DeepSpeed engine)."""
    try:
        mbs = int(cfg["train_micro_batch_size_per_gpu"])
        accum = int(cfg.get("gradient_accumulation_steps", 1))
        batch = int(cfg["train_batch_size"])
    except (KeyError, TypeError, ValueError):
        raise OptplanError(f"{source} has no usable batch triple (train_batch_size, train_micro_batch_size_per_gpu, "
                           "gradient_accumulation_steps): re-export it") from None
    if mbs < 1 or accum < 1 or batch % (mbs * accum):
        raise OptplanError(f"{source}: train_batch_size {batch} is not micro-batch {mbs} x accumulation {accum} x "
                           "GPUs: fix the batch triple or re-export it")
    zero = cfg.get("zero_optimization") or {}
    from optplan.probes.trainloop import ds_config_recipe  # the one reading of bf16 / fp16 / torch_autocast

    precision = ds_config_recipe(cfg)
    kind = str((cfg.get("optimizer") or {}).get("type") or "adamw").lower()
    optimizer = "sgd" if kind == "sgd" else "adamw"
    offload_opt = ((zero.get("offload_optimizer") or {}).get("device") or "none")
    offload_par = ((zero.get("offload_param") or {}).get("device") or "none")
    try:
        return Strategy(precision=precision, optimizer=optimizer, zero=int(zero.get("stage", 0)), mbs=mbs,  # type: ignore[arg-type]
                        grad_accum=accum, dp=batch // (mbs * accum), engine="deepspeed",
                        checkpointing="full" if "activation_checkpointing" in cfg else "none",
                        offload_optimizer=offload_opt, offload_params=offload_par)
    except ValueError as exc:
        raise OptplanError(f"{source} describes no strategy optplan can run ({exc}): re-export it") from None


def _scaled_ds_config(cfg: dict[str, Any], strategy: Strategy) -> dict[str, Any]:
    """``cfg``'s batch triple as ``strategy`` runs it here (its process count; on a CPU one sample per micro-batch):
    DeepSpeed checks train_batch_size = micro-batch x accumulation x world size."""
    out = dict(cfg)
    out.update(train_batch_size=strategy.mbs * strategy.grad_accum * strategy.dp,
               train_micro_batch_size_per_gpu=strategy.mbs, gradient_accumulation_steps=strategy.grad_accum)
    return out


def _runnable_ds_config(cfg: dict[str, Any], local: LocalDevices, notes: list[str]) -> dict[str, Any]:
    """Where DeepSpeed's own Adam would JIT-build its fused kernel it cannot or should not build, ask for
    torch's Adam (same states): on the CPU (~40 s of build), and on a GPU machine without ``nvcc`` (the
    build fails there; a DeepSpeed wheel ships no prebuilt ops)."""
    if not isinstance(cfg.get("optimizer"), dict):
        return cfg
    if local.device == "cpu":
        why = "on the CPU the optimizer runs as torch's Adam (torch_adam: true) instead of DeepSpeed's fused kernel, " \
              "which the CPU would JIT-build"
    elif shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        why = "no nvcc here: the optimizer runs as torch's Adam (torch_adam: true) instead of DeepSpeed's fused " \
              "kernel, which DeepSpeed would JIT-build with nvcc (same optimizer states)"
    else:
        return cfg
    section = dict(cfg["optimizer"])
    section["params"] = {**(section.get("params") or {}), "torch_adam": True}
    if why not in notes:  # an accelerate.yaml run reaches here twice (its plan's ds_config and the file's)
        notes.append(why)
    return {**cfg, "optimizer": section}


def _accelerate_config_for_run(path: Path, folder: Path, local: LocalDevices, notes: list[str]) -> Path:
    """``path``, or a copy in ``folder`` whose ``deepspeed_config_file`` is absolute (accelerate resolves a
    relative one against the working folder, and the run starts from the model's, not the export's) and
    points at a copy of that ds_config with torch's Adam where the fused one cannot be built
    (``_runnable_ds_config``)."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return path  # the loader check (planner/validate.py) reports a bad file
    ds = doc.get("deepspeed_config") if isinstance(doc, dict) else None
    ref = ds.get("deepspeed_config_file") if isinstance(ds, dict) else None
    if not isinstance(ref, str):
        return path
    ds_file = Path(ref) if Path(ref).is_absolute() else (path.parent / ref).resolve()
    try:
        cfg = json.loads(ds_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        cfg = None  # accelerate reports a missing or broken file itself
    run_cfg = _runnable_ds_config(cfg, local, notes) if isinstance(cfg, dict) else cfg
    if run_cfg is not cfg:
        ds_file = folder / ds_file.name
        ds_file.write_text(json.dumps(run_cfg, indent=2), encoding="utf-8")
    elif Path(ref).is_absolute():
        return path
    ds["deepspeed_config_file"] = str(ds_file)
    copy = folder / path.name
    copy.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return copy


def _local_strategy(strategy: Strategy, local: LocalDevices) -> tuple[Strategy, list[str]]:
    notes = []
    update = local_update(strategy, local)
    dp = update["dp"]
    if dp != strategy.dp:
        notes.append(f"ran {dp} of the plan's {strategy.dp} data-parallel processes (the local devices); the batch "
                     "triple was scaled to match")
    if strategy.model_parallel or strategy.engine == "megatron":
        raise OptplanError("this plan runs on Megatron-LM (tensor/pipeline/context parallelism), which optplan "
                           "validate does not start: run the exported launch.sh on the cluster")
    if "mbs" in update and (strategy.mbs, strategy.grad_accum) != (update["mbs"], update["grad_accum"]):  # a CPU
        notes.append(f"on the CPU one sample per micro-batch, no accumulation (the plan: {strategy.mbs} x "
                     f"{strategy.grad_accum}, sized for its GPU's memory): this checks that the file launches and "
                     "trains, and the memory at this batch against its own prediction")
    return Strategy.model_validate({**strategy.model_dump(), **update}), notes


def _cluster_for(plan: ExportPlan | None, strategy: Strategy) -> Cluster:
    gpu = find_gpu(plan.gpu) if plan is not None else find_gpu("H100-SXM")
    per_node = plan.gpus_per_node if plan is not None else min(8, strategy.world_size)
    return Cluster(gpu=gpu, gpus=strategy.world_size, gpus_per_node=max(1, min(per_node, strategy.world_size)))


def planned_seq_len(target: Path) -> int | None:
    """The sequence length of the plan.json beside ``target`` (a folder recommend --out wrote, or one of its files):
    what its launch files and predictions are for; None without a plan.json or for a model of no sequence."""
    plan = _plan_beside(target if target.is_dir() else target.parent)
    return plan.seq_len if plan is not None else None


def files_to_run(target: Path) -> list[Path]:
    """The runnable exported files of a folder (or the one file given)."""
    if target.is_dir():
        found = [target / name for name in RUNNABLE if (target / name).exists()]
        if not found:
            raise OptplanError(f"{target} has none of {', '.join(RUNNABLE)}: give the folder recommend --out wrote")
        return found
    if not target.exists():
        raise OptplanError(f"{target} does not exist: give the folder recommend --out wrote, or one of its files")
    if target.name == FILE_NAMES["plan"]:
        return files_to_run(target.parent)
    if target.name not in RUNNABLE and target.suffix not in (".json", ".sh", ".yaml", ".yml"):
        raise OptplanError(f"{target.name} is not a launch config optplan can run: give ds_config.json, launch.sh "
                           "or accelerate.yaml")
    return [target]


def _kind(path: Path) -> str:
    if path.suffix == ".json":
        return "deepspeed"
    if path.suffix == ".sh":
        return "launch"
    return "accelerate"


@dataclass(frozen=True)
class _Prepared:
    """One exported file, ready to run: the spec, and what the report says of it."""

    path: Path
    how: str
    plan: ExportPlan | None
    strategy: Strategy
    probed: Strategy
    notes: tuple[str, ...]
    spec: ProbeSpec


def _prepare(path: Path, profile: ModelProfile, model_name: str | None, local: LocalDevices, scratch: Path,
             warmup_steps: int, timed_steps: int) -> _Prepared:
    """Read one exported file (and plan.json beside it) into the probe spec that runs it."""
    block = profile.repeated_block.class_name if profile.repeated_block else None
    plan = _plan_beside(path.parent)
    if plan is not None:
        check_same_model(plan, profile, path)
    kind = _kind(path)
    ds_config = None
    extra: dict[str, Any] = {}
    if kind == "deepspeed":
        cfg = _read_json(path)
        if plan is not None and plan.strategy.engine != "deepspeed":
            raise OptplanError(f"{path} is not the plan's beside it (plan.json: {plan.strategy.label()}, no "
                               "DeepSpeed): it is left from an earlier plan; remove it, or validate a folder "
                               "that recommend --out wrote for it")
        strategy = plan.strategy if plan is not None else strategy_from_ds_config(cfg, str(path))
        probed, notes = _local_strategy(strategy, local)
        ds_config = _scaled_ds_config(cfg, probed)
        ds_config = _runnable_ds_config(ds_config, local, notes)
        how = f"deepspeed.initialize with {path.name}, {probed.dp} process(es) (plan: {strategy.dp})"
    else:
        if plan is None:
            raise OptplanError(f"{path} needs the plan.json beside it (the strategy it launches): validate the "
                               "folder recommend --out wrote")
        strategy = plan.strategy
        cpu_accelerate = kind != "launch" and local.device == "cpu" and local.count > 1
        # `accelerate launch --cpu` starts one process whatever --num_processes says (its multi-CPU launch is
        # mpirun's): one process, said so, rather than a second rank that never starts
        probed, notes = _local_strategy(strategy, local.model_copy(update={"count": 1}) if cpu_accelerate else local)
        if cpu_accelerate and strategy.dp > 1:
            notes.append("accelerate launch --cpu starts one process (several CPU processes need its mpirun "
                         "launcher): this file ran 1")
        if probed.engine == "deepspeed":
            from optplan.planner.export.deepspeed import render_ds_config
            ds_config = _runnable_ds_config(render_ds_config(probed, plan.buckets), local, notes)
        if kind == "launch":
            from optplan.planner.export.launch_check import launch_argv
            argv = launch_argv(path.read_text(encoding="utf-8"))
            how = f"{Path(argv[0]).name} from {path.name}, {probed.dp} process(es) (plan: {strategy.dp})"
        else:
            run_yaml = _accelerate_config_for_run(path, scratch, local, notes)
            extra["accelerate_config"] = str(run_yaml.resolve())
            if local.device == "cpu":
                notes.append("on the CPU `accelerate launch --cpu` runs without the config's FSDP/DeepSpeed "
                             "plugin: this checks that accelerate reads the file and the model trains, "
                             "not the sharding")
            how = f"accelerate launch --config_file {path.name}, {probed.dp} process(es) (plan: {strategy.dp})"
    spec = ProbeSpec(model_path=profile.path, model_name=model_name, seq_len=profile.seq_len, strategy=probed,
                     block_class=block, ds_config=ds_config, device=local.device, nproc=probed.dp,
                     warmup_steps=warmup_steps, timed_steps=timed_steps, **extra)
    return _Prepared(path=path, how=how, plan=plan, strategy=strategy, probed=probed, notes=tuple(notes), spec=spec)


def _run_together(specs: list[ProbeSpec], runner: Callable[..., ProbeResult], timeout_s: float,
                  jobs: int, lock: str) -> list[ProbeResult]:
    """``runner(spec)`` for every spec, ``jobs`` at a time, results in order: each one-process run takes the device
    ``lock`` in turn (``$OPTPLAN_DEVICE_LOCK`` for it: its child waits after its imports, probes/device_lock.py), all
    in one quiet group (``$OPTPLAN_QUIET_GROUP``, the caller's if set, else one of this call's own: the run holding
    the device stops the others for its timed steps, probes/host_quiet.py, so that its step times read as when run
    alone). An interrupt (Ctrl-C) or any error in this thread cancels the runs not started and stops the running
    ones (``run_probe``'s ``cancelled``: their whole process trees), then propagates."""
    with contextlib.ExitStack() as stack:
        group = group_from_env() or stack.enter_context(  # a group of this call's own, watched while it runs
            owned_group(stack.enter_context(tempfile.TemporaryDirectory(prefix="optplan_quiet_"))))
        env = {DEVICE_LOCK_ENV: lock, QUIET_ENV: group}
        stop = threading.Event()
        pool = ThreadPoolExecutor(max_workers=min(jobs, len(specs)))
        try:
            futures = [pool.submit(runner, spec, timeout_s=timeout_s, cancelled=stop.is_set, env=env)
                       for spec in specs]
            return [f.result() for f in futures]
        except BaseException:
            stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # after a normal return every future is done already


def validate_exports(target: Path, profile: ModelProfile, *, model_name: str | None = None,
                     local: LocalDevices | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, warmup_steps: int = 1,
                     timed_steps: int = 3, runner: Callable[..., ProbeResult] = run_probe,
                     jobs: int = 1) -> ValidationReport:
    """Run every runnable exported file under ``target`` with the model of ``profile`` for a few steps.

    ``jobs`` > 1: that many files run at once when each runs as one process, taking the device in turn
    (probes/device_lock.py: ``$OPTPLAN_DEVICE_LOCK``, else a lock of this call's own): their imports overlap, their
    device work, step times and memory figures do not. Runs of several processes cannot share the device so (the
    ranks of one run would wait on each other): they run one at a time, as with ``jobs=1``."""
    if jobs < 1:
        raise OptplanError(f"jobs must be >= 1 (got {jobs})")
    target = Path(target)
    files = files_to_run(target)
    local = local or local_devices()
    with tempfile.TemporaryDirectory(prefix="optplan_validate_") as scratch:
        prepared = [_prepare(path, profile, model_name, local, Path(scratch), warmup_steps, timed_steps)
                    for path in files]
        together = jobs > 1 and len(prepared) > 1 and all(p.spec.nproc == 1 for p in prepared)
        if together:  # $OPTPLAN_DEVICE_LOCK (a caller sharing the device with more), else a lock of this call's own
            lock = lock_from_env() or str(Path(scratch) / "device.lock")
            results = _run_together([p.spec for p in prepared], runner, timeout_s, jobs, lock)
        else:
            if jobs > 1 and len(prepared) > 1:
                prepared = [replace(p, notes=(*p.notes, f"run one at a time, not --jobs {jobs}: a run of several "
                                                         "processes cannot share the device in turn"))
                            for p in prepared]
            results = [runner(p.spec, timeout_s=timeout_s) for p in prepared]
    runs: list[ValidationRun] = []
    for p, result in zip(prepared, results, strict=True):
        cluster = _cluster_for(p.plan, p.strategy)
        comparable = local.device == "cuda" and local.catalogue_name == cluster.gpu.name
        comparison = compare_spec(profile, cluster, p.strategy, p.probed, local, comparable, result)
        started = result.status in ("ok", "oom", "nan", "pruned") or bool(result.step_times_s)
        fits = True if result.status in ("ok", "nan", "pruned") else False if result.status == "oom" else None
        runs.append(ValidationRun(file=str(p.path), how=p.how, started=started, fits=fits, comparison=comparison,
                                  notes=(*p.notes, *result.notes)))
    return ValidationReport(target=str(target), model_path=profile.path, device=local.device, runs=tuple(runs))


def report_lines(report: ValidationReport) -> Sequence[str]:
    return [r.line() for r in report.runs]
