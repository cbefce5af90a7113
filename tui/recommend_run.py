"""``recommend``'s options checked together and run: shared by ``optplan recommend`` and ``optplan dashboard``.

The faces differ in how they show progress and results; how the options are checked (one line per mistake,
before the model is profiled) and how the pipeline runs is here, once. No textual, no printing: checks
raise OptplanError, progress goes out through callbacks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import Estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.params_only import is_params_only
from optplan.estimators.profile import ModelProfile
from optplan.planner.events import ProgressEvent
from optplan.planner.export.registry import ExportOptions
from optplan.planner.finetune import FinetuneChoice
from optplan.planner.goal import Goal
from optplan.planner.recommend import Recommendation
from optplan.tui.recommend_args import (
    ENGINES,
    LAUNCHERS,
    METHODS,
    OPTIMIZERS,
    PRECISIONS,
    REDUCE_DTYPES,
    RecommendArgs,
    check_choice,
    check_finite,
    parse_duration_s,
)


def _deepspeed_launcher_engines(a: RecommendArgs) -> tuple[RecommendArgs, str]:
    """``--launcher deepspeed`` starts DeepSpeed-engine plans only (planner/export/launch.py): the search keeps to
    that engine, or the flags that contradict it are one error line (a torch pick would leave no launch.sh)."""
    others = [e for e in (a.engine or ()) if e != "deepspeed"]
    if others:
        raise OptplanError(f"--launcher deepspeed starts DeepSpeed-engine plans only, and --engine names "
                           f"{', '.join(others)}: drop those engines, or use --launcher torchrun")
    if finetune_choice(a).adapters:
        raise OptplanError("--launcher deepspeed starts DeepSpeed-engine plans only, and a LoRA/QLoRA plan runs on "
                           "the torch engine: use --launcher torchrun")
    return a.model_copy(update={"engine": ("deepspeed",)}), \
        "--launcher deepspeed: only DeepSpeed-engine plans are searched (its launcher starts no other)"


class PreparedRecommend(BaseModel):
    """Checked options: the cluster to plan for (with notes), the GPU counts, the goal, the study storage."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    args: RecommendArgs
    cluster: Cluster
    notes: tuple[str, ...]
    gpu_counts: tuple[int, ...] | None
    goal: Goal
    storage: str | None
    export_options: ExportOptions


def prepare_recommend(args: RecommendArgs, *, check_out: bool = True) -> PreparedRecommend:
    """Check every option that can be checked before the model is profiled (OptplanError: one line).

    ``check_out``: fail when ``--out`` already has export files and ``--force`` is not given (the
    dashboard asks instead). With ``--out`` and no ``--storage`` the study goes to DIR/optplan-study.log
    (the folder is created).
    """
    from optplan.planner.api import check_out_dir, check_search_options, resolve_cluster
    from optplan.planner.goal import OBJECTIVES
    from optplan.planner.space import parse_gpus_range

    a = args
    finetune_choice(a).check(runs_a_model=a.runs_a_model)
    if finetune_choice(a).quant_name() != "none" and "fp8" in (a.precision or ()):
        from optplan.estimators.strategy import QUANT_FP8_PROBLEM

        raise OptplanError(f"{QUANT_FP8_PROBLEM}: drop fp8 from --precision")
    check_choice("--objective", a.objective, OBJECTIVES)
    check_choice("--method", a.method, METHODS)
    check_choice("--launcher", a.launcher, LAUNCHERS)
    check_choice("--fsdp-reduce-dtype", a.fsdp_reduce_dtype, REDUCE_DTYPES)
    for value in a.precision or ():
        check_choice("--precision", value, PRECISIONS)
    for value in a.optimizer or ():
        check_choice("--optimizer", value, OPTIMIZERS)
    for value in a.checkpointing or ():
        check_choice("--checkpointing", value, ("none", "selective", "full", "partial", "moe"))
    for value in a.engine or ():
        check_choice("--engine", value, ENGINES)
    finetune_choice(a).check_engines(a.engine)
    for flag, number in (("params", a.params), ("tokens", a.tokens), ("global-batch-tokens", a.global_batch_tokens)):
        check_finite(flag, number)
    check_finite("price", a.price, allow_zero=True)
    if a.trials is not None and a.trials < 1:
        raise OptplanError(f"--trials must be >= 1 (got {a.trials})")
    check_finite("probe-budget", a.probe_budget)
    check_finite("probe-timeout", a.probe_timeout)
    for flag, count in (("probe-top-k", a.probe_top_k), ("probe-steps", a.probe_steps), ("probe-nproc", a.probe_nproc)):
        if count is not None and count < 1:
            raise OptplanError(f"--{flag} must be >= 1 (got {count})")
    if a.probe and not a.runs_a_model:
        raise OptplanError("--probe runs the model FILE for real: give a model file or --hf (not --arch/--params) "
                           "or drop --probe")
    if a.global_batch is not None and a.global_batch_tokens is not None:
        raise OptplanError("give --global-batch (samples) or --global-batch-tokens, not both")
    if a.global_batch is not None and a.global_batch < 1:
        raise OptplanError(f"--global-batch must be >= 1 (got {a.global_batch})")
    goal = Goal(objective=a.objective, tokens=a.tokens, price_per_gpu_hour=a.price,  # type: ignore[arg-type]
                deadline_s=parse_duration_s(a.deadline) if a.deadline is not None else None)
    if a.tokens is not None or not a.runs_a_model:
        goal.check()  # a model file's OPTPLAN["tokens"] may still give the budget: checked once it is read
    if a.gpus_range is not None and a.gpus is not None:
        raise OptplanError("give --gpus or --gpus-range, not both")
    target, notes = resolve_cluster(gpu=a.gpu, gpus=a.gpus, gpus_per_node=a.gpus_per_node, cluster_file=a.cluster)
    counts = None
    if a.gpus_range is not None:
        counts = parse_gpus_range(a.gpus_range, target.gpus_per_node)
        target = target.model_copy(update={"gpus": max(counts)})
        span = f"{min(counts)}-{max(counts)}"  # the count is searched: say so where the note gave one count
        notes = [f"planning for {span} x {target.gpu.name} (--gpus-range: the GPU count is searched)"
                 if n.startswith("planning for ") else
                 re.sub(r"planning for \d+ x ", f"planning for {span} x ", n) for n in notes]
    check_search_options(target, global_batch=a.global_batch, precisions=a.precision)
    if a.global_batch is not None and a.runs_a_model and "megatron" not in (a.engine or ()):
        # a model file trains data-parallel (DeepSpeed/torch): dp is the GPU count, known before profiling
        if not any(a.global_batch % n == 0 for n in (counts or (target.gpus,))):
            n = min(counts or (target.gpus,))
            raise OptplanError(f"global batch {a.global_batch} is not divisible by {n} GPUs: use a multiple of "
                               f"{n} for --global-batch or change --gpus")
    if a.launcher == "deepspeed":
        a, launcher_note = _deepspeed_launcher_engines(a)
        notes = [*notes, launcher_note]
    options = ExportOptions(launcher=a.launcher)  # type: ignore[arg-type]
    study = a.storage
    if study is not None and "://" not in study:
        from optplan.planner.search import check_storage_file
        check_storage_file(Path(study))  # a garbage --storage file fails before profiling
        folder = Path(study).parent
        if not folder.is_dir() and (a.out is None or folder.resolve() != a.out.resolve()):  # --out's is created later
            raise OptplanError(f"--storage {study}: the folder {folder} does not exist: create it, or choose another "
                               "--storage")
    if a.out is not None:
        if check_out:
            check_out_dir(a.out, force=a.force)
        if study is None:  # the folder is created when the search starts (nothing is written for bad input)
            study = str(a.out / "optplan-study.log")
    return PreparedRecommend(args=a, cluster=target, notes=tuple(notes),
                             gpu_counts=None if counts is None else tuple(counts), goal=goal, storage=study,
                             export_options=options)


def profile_for(prepared: PreparedRecommend, *, cancelled: Callable[[], bool] | None = None) -> ModelProfile:
    """Profile the model the options name (a model file runs in a child process: seconds); ``cancelled()``
    turning true kills that child and raises Cancelled."""
    from optplan.planner.api import resolve_model

    a = prepared.args
    return resolve_model(a.model, arch=a.arch, seq_len=a.seq_len, model_name=a.model_name, params=a.params,
                         hf=a.hf, hf_class=a.hf_class, cancelled=cancelled, lora=finetune_choice(a).lora_request())


def finetune_choice(args: RecommendArgs) -> FinetuneChoice:
    """The fine-tuning flags of ``args`` (RecommendArgs carries them as a FinetuneChoice)."""
    return args


def global_batch_for(prepared: PreparedRecommend, prof: ModelProfile) -> int | None:
    """--global-batch, or --global-batch-tokens in samples of the profile's sequence length."""
    a = prepared.args
    if a.global_batch_tokens is None:
        return a.global_batch
    seq = prof.tokens_per_sample
    if not seq:
        raise OptplanError(f"--global-batch-tokens needs a token model; {prof.name} takes {prof.input_kind} "
                           "inputs: use --global-batch")
    if a.global_batch_tokens % seq:
        raise OptplanError(f"--global-batch-tokens {a.global_batch_tokens:g} is not a multiple of the sequence "
                           f"length {seq}: use a multiple of {seq}")
    return int(a.global_batch_tokens // seq)


def gpu_present() -> bool:
    """True when NVML (or torch) sees a GPU here: ``recommend`` probes by default then."""
    from optplan.planner.api import detect_hardware
    return detect_hardware().available


def goal_for(prepared: PreparedRecommend, prof: ModelProfile) -> Goal:
    """The options' goal, its token budget from the model file's ``OPTPLAN["tokens"]`` when --tokens is not given
    (README: the file's defaults), checked (one line when a goal still lacks the budget it needs)."""
    goal = prepared.goal
    if goal.tokens is not None and not prof.tokens_per_sample and not is_params_only(prof):
        # the budget, the time and the cost are counted in tokens: a model of images has none to count (estimate
        # refuses the same, planner/api.py)
        uses = [flag for flag, used in (("--objective " + goal.objective, goal.objective != "throughput"),
                                        ("--price", goal.price_per_gpu_hour is not None),
                                        ("--deadline", goal.deadline_s is not None)) if used]
        raise OptplanError(f"--tokens needs a token model; {prof.name} takes {prof.input_kind} inputs: drop --tokens"
                           + (f" and {', '.join(uses)}" if uses else "") + " (a training budget is counted in tokens)")
    if goal.tokens is None and prof.defaults.tokens and prof.tokens_per_sample:
        goal = goal.model_copy(update={"tokens": float(prof.defaults.tokens)})
    goal.check()
    return goal


def run_recommend(prepared: PreparedRecommend, prof: ModelProfile, *,
                  on_progress: Callable[[ProgressEvent], None] | None = None,
                  on_trial: Callable[[Estimate], None] | None = None,
                  gpu_here: Callable[[], bool] = gpu_present,
                  cancelled: Callable[[], bool] | None = None) -> Recommendation:
    """Search, (probe,) explain: ``planner.recommend.recommend`` with the options' values (``cancelled``:
    stops a running probe, see ``recommend``)."""
    from optplan.planner.recommend import recommend

    a = prepared.args
    goal = goal_for(prepared, prof)
    gb = global_batch_for(prepared, prof)
    if a.out is not None:  # the search writes its study there (by default) and the exports after it
        try:
            a.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OptplanError(f"cannot create --out {a.out} ({exc.strerror or exc}): choose a writable directory") from None
    probe_options = None
    if a.runs_a_model and (a.probe or (a.probe is None and gpu_here())):
        from optplan.planner.probe_stage import ProbeOptions
        probe_options = ProbeOptions(top_k=a.probe_top_k, budget_s=a.probe_budget, timeout_s=a.probe_timeout,
                                     timed_steps=a.probe_steps, nproc=a.probe_nproc, model_name=a.model_name)
    cal = None
    if a.calibration and a.runs_a_model:
        from optplan.planner.probe_stage import cached_calibration
        cal = cached_calibration(prof, prepared.cluster)
    choice = finetune_choice(a)
    precisions = a.precision or choice.precisions(prepared.cluster.gpu.supports_bf16)
    notes = prepared.notes
    if prepared.goal.tokens is None and goal.tokens is not None:
        notes = (*notes, f"token budget {goal.tokens:.3g} from the model file's OPTPLAN (--tokens to change it)")
    return recommend(prof, prepared.cluster, global_batch=gb, precisions=precisions, optimizers=a.optimizer,
                     engines=a.engine, gpu_counts=prepared.gpu_counts, goal=goal, offload=a.offload,
                     compile_blocks=a.compile_, checkpointing=a.checkpointing,
                     fsdp_reduce_dtype=a.fsdp_reduce_dtype,
                     method=a.method, seed=a.seed, n_trials=a.trials,  # type: ignore[arg-type]
                     storage=prepared.storage, notes=notes, calibration=cal, probe=probe_options,
                     on_progress=on_progress, on_trial=on_trial, cancelled=cancelled, quant=choice.quant_name())
