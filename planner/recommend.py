"""recommend(): profile + cluster -> the best plan that fits, its runners-up, rationale, Pareto front.

A Python API with no printing: progress goes out through the ``on_progress`` callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.calibration import Calibration
from optplan.estimators.cost import training_cost
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import Estimate, StatesEstimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.params_only import is_params_only
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.planner.derive import file_precision
from optplan.planner.events import ProgressEvent
from optplan.planner.export.context import ExportPlan, export_plan_for
from optplan.planner.finetune import FinetuneChoice
from optplan.planner.goal import Goal, band_factor, pareto_front
from optplan.planner.probe_stage import (
    LocalDevices,
    ProbeOptions,
    ProbeReport,
    Runner,
    probe_lines,
    rerank,
    run_probe_stage,
)
from optplan.planner.rationale import rationale
from optplan.planner.search import Pricer, SearchMethod, search
from optplan.planner.space import build_space
from optplan.planner.suggest import what_would_fit

DEFAULT_ALTERNATIVES = 4
MODEL_SCOPE_NOTE = ("time model fitted on measured runs: A100 Megatron (vTrain; Narayanan et al. 2021 and Korthikanti "
                    "et al. 2022 tables; BigScience's BLOOM-176B runs on 384 GPUs, never fitted), A100 and H100 torch FSDP "
                    "(llm-foundry, torchtitan; IBM's fms-fsdp runs on 96-128 GPUs, never fitted), H100, B200, GB200 and GB300 Megatron fp8 "
                    "with its communication overlap (NVIDIA's Megatron-Bridge runs, 19, never fitted), H100 and GB200 "
                    "Megatron bf16 and fp8 (NVIDIA's DGX Cloud recipes, dgxc-nemo: 94 NeMo runs on 8-2,304 GPUs, never "
                    "fitted), B200 Megatron fp8 at 8K-1M tokens per sequence with context parallelism up to 16 (NeMo's "
                    "long-sequence sweep, 8 runs, never fitted); H200, B200, GB200, B300 and GB300 derived from H100 (Blackwell's GEMMs at their published "
                    "matmul ceilings where published, attention at cuDNN's measured speed on Hopper Megatron and "
                    "Blackwell), "
                    "the H200 also measured on one GPU by optplan's GPU campaign (torch and DeepSpeed at "
                    "world size 1, models up to 1.2B: benchmarks/results); MoE models judged by 23 published Megatron-"
                    "Core, NeMo and DeepSeek runs on H100 and B200 (benchmarks/fidelity_moe.py); models without a "
                    "transformer shape (convolution nets) judged by 46 published timm and DeepLearningExamples runs on "
                    "the RTX 3090, V100 and A100 (benchmarks/fidelity_convnets.py); other GPUs use their "
                    "datasheet peaks with "
                    "default efficiencies and a wide band until probes calibrate them; each estimate's band "
                    "(time.step_s_low-step_s_high) says how sure it is")
"""What the time model rests on: the measured sets and derived GPUs of estimators/data/time_domain.yaml and
the fitted GPUs of estimators/data/efficiency.yaml (a test keeps this in step with both)."""
MEGATRON_FILE_NOTE = ("a Megatron-LM plan runs Megatron's own GPT implementation with this model's shape (layers, "
                      "hidden, heads, MLP): the model file's code is not used by it")


class PlanEstimate(BaseModel):
    """A strategy and its estimate, as the ``alternatives`` and ``pareto`` entries of --json."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plan: Strategy
    estimate: Estimate | StatesEstimate


class SearchSummary(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str
    space_size: int
    evaluated: int
    feasible: int
    resumed: int = 0
    layouts: int = Field(default=0, description="parallel layouts in the space")
    layouts_screened_out: int = Field(default=0, description="layouts the screen priced only through their probe")
    objective: str = "throughput"
    study_name: str = ""
    storage: str | None = None


class ClusterSummary(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str
    gpus: int = Field(description="GPUs planned for; with a range of GPU counts the largest searched")
    gpus_per_node: int
    memory_bytes: int
    detected: bool
    gpu_counts: tuple[int, ...] | None = Field(default=None, description="the GPU counts searched (--gpus-range); "
                                                                        "None: gpus only")


class Recommendation(BaseModel):
    """The answer of ``optplan recommend``; ``model_dump(mode="json")`` is the stable --json document."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    model_path: str
    cluster: ClusterSummary
    fits: bool
    plan: Strategy | None
    estimate: Estimate | StatesEstimate | None = Field(
        description="as optplan estimate --json prints it (model states only under --params)")
    alternatives: tuple[PlanEstimate, ...]
    rationale: tuple[str, ...]
    pareto: tuple[PlanEstimate, ...]
    suggestions: tuple[str, ...]
    suggested: tuple[PlanEstimate, ...] = ()
    notes: tuple[str, ...]
    global_batch: int | None
    seq_len: int | None
    search: SearchSummary
    objective: str = "throughput"
    tokens: float | None = None
    deadline_s: float | None = None
    export: ExportPlan | None = None
    probes: ProbeReport | None = Field(default=None, description="recommend --probe: every probe run and its "
                                                                 "predicted vs measured figures")
    calibration: Calibration | None = Field(default=None, description="the calibration the estimates carry")
    finetune: FinetuneChoice | None = Field(
        default=None, description="the LoRA fine-tuning the plans were made with, by estimate's flag names (finetune, "
                                  "lora_rank, lora_alpha, lora_targets, lora_dropout; quant is the plan's): with "
                                  "``plan`` the flags that price the plan again; None: full training")


def with_cost(e: Estimate, goal: Goal, cluster: Cluster) -> Estimate:
    """``e`` with the time, GPU-hours, cost and energy of the goal's token budget (unchanged without one)."""
    if goal.tokens is None or not e.tokens_per_s:
        return e
    price = goal.price_per_gpu_hour if goal.price_per_gpu_hour is not None else cluster.price_per_gpu_hour
    cost = training_cost(tokens=goal.tokens, tokens_per_s=e.tokens_per_s, gpus=e.gpus,
                         gpu_power_w=cluster.power_w_per_gpu, price_per_gpu_hour=price,
                         step_band=(band_factor(e, "fast"), band_factor(e, "slow")))
    return e.model_copy(update={"cost": cost})


def _is_moe(profile: ModelProfile) -> bool:
    """An MoE profile (an --hf MoE config, planner/hf_moe.py, or a model file with MoE layers, probes/moe_layers.py):
    Megatron-LM's expert parallelism, which only it expresses, is searched beside DeepSpeed and torch, as for
    --arch; a Megatron plan for a model file says it runs Megatron's GPT with the file's shape."""
    return profile.transformer is not None and profile.transformer.moe is not None


def recommend(profile: ModelProfile, cluster: Cluster, *, global_batch: int | None = None,
              precisions: Sequence[str] | None = None, optimizers: Sequence[str] | None = None,
              engines: Sequence[str] | None = None, gpu_counts: Sequence[int] | None = None,
              goal: Goal | None = None, offload: bool = True, method: SearchMethod = "auto", seed: int = 0,
              n_trials: int | None = None, storage: str | Path | None = None,
              alternatives: int = DEFAULT_ALTERNATIVES, notes: Sequence[str] = (),
              on_progress: Callable[[ProgressEvent], None] | None = None,
              calibration: Calibration | None = None, probe: ProbeOptions | None = None,
              probe_local: LocalDevices | None = None, probe_runner: Runner | None = None,
              probe_bench: Callable[..., Any] | None = None,
              on_trial: Callable[[Estimate], None] | None = None,
              cancelled: Callable[[], bool] | None = None, quant: str = "none",
              compile_blocks: bool = False, checkpointing: Sequence[str] | None = None,
              fsdp_reduce_dtype: str = "auto") -> Recommendation:
    """Search the space of ``profile`` on ``cluster`` (or on each of ``gpu_counts``) and explain the pick.

    ``global_batch`` (samples) defaults to the model file's OPTPLAN value; None leaves it free. For a model
    file the engines default to DeepSpeed and torch (they run the file); Megatron-LM (tensor, pipeline, context and
    expert parallelism) joins for ``--arch`` shapes, MoE models (``--hf`` configs and model files with MoE layers:
    only it has expert parallelism) or when named in ``engines``.

    ``calibration`` (e.g. from the cache of an earlier probe run) corrects every estimate. ``probe`` runs the
    probe stage (``planner.probe_stage``) on a model file: the top candidates run for real on
    ``probe_local`` (default: the local GPUs, else the CPU) through ``probe_runner`` (default
    ``optplan.probes.runtime.run_probe``); on the planned GPU they recalibrate and re-rank.

    ``on_trial`` receives each candidate's Estimate as the search prices it (see ``search``): the
    dashboard's live table of trials. ``cancelled`` stops the microbenchmarks and the probe stage (their
    running child processes included) when it turns true, raising :class:`~optplan.estimators.errors.Cancelled`.

    ``compile_blocks`` makes the torch and DeepSpeed plans compile each repeated block with torch.compile (priced as
    fused elementwise kernels; the exports apply it); Megatron plans run their own fused kernels either way.

    ``fsdp_reduce_dtype`` is the dtype the user's trainer reduces FSDP gradients in (Strategy.fsdp_reduce_dtype; e.g.
    bf16 under accelerate, the Hugging Face Trainer or Lightning): the torch FSDP plans whose recipe takes it are
    priced with it (space.reduce_dtype_for); it is not searched.

    ``checkpointing`` limits the activation checkpointing modes searched (none, selective, full, moe; default: every
    mode the profile supports).

    ``quant`` holds the frozen base of a LoRA profile (finetune.QuantName); LoRA plans are not probed yet (the
    probe child trains the model as built), which a note says.
    """
    goal = goal or Goal()
    goal.check()
    if goal.price_per_gpu_hour is None and cluster.price_per_gpu_hour is not None and goal.tokens is not None:
        # the cluster file's price prices a token budget; without one it is unused (not a --price needing --tokens)
        goal = goal.model_copy(update={"price_per_gpu_hour": cluster.price_per_gpu_hour})
    gb = global_batch if global_batch is not None else profile.defaults.global_batch
    # the model file's precision is the one searched when none is named, as its optimizer is (derive.file_precision)
    precision, precision_note = file_precision(profile, cluster) if precisions is None else (None, None)
    if precision is not None:
        precisions = (precision,)
        precision_note = f"precision {precision} from the model file's OPTPLAN (--precision to search others)"
    if is_params_only(profile):
        return _recommend_states(profile, cluster, global_batch=gb, precisions=precisions, engines=engines,
                                 offload=offload, alternatives=alternatives, notes=notes, goal=goal)
    if engines is None and profile.model_file and not _is_moe(profile):
        engines = ("deepspeed", "torch")
    ceiling_notes: list[str] = []
    lora_notes: list[str] = []
    if quant != "none":
        from optplan.probes.adapters import quantisation_missing

        missing = quantisation_missing(quant)
        if missing:
            lora_notes.append(missing)
    if probe is not None and profile.adapter is not None:
        probe = None
        lora_notes.append("not probed: the probe runs train the model as built, without LoRA adapters, so the LoRA "
                          "plan's figures are predictions only")
    if probe is not None and profile.model_file and probe.microbench:
        from optplan.planner.probe_stage import local_devices, measured_cluster
        probe_local = probe_local or local_devices(probe.nproc)
        cluster, ceiling_notes = measured_cluster(cluster, probe_local, bench=probe_bench, cancelled=cancelled)
    space = build_space(profile, cluster, global_batch=gb, precisions=precisions, optimizers=optimizers,
                        engines=engines, gpu_counts=gpu_counts, offload=offload, quant=quant,
                        compile_blocks=compile_blocks, checkpointing=checkpointing,
                        fsdp_reduce_dtype=fsdp_reduce_dtype)
    if not space.layouts:
        raise OptplanError(f"no parallel layout uses {cluster.gpus} GPUs for {profile.name}: change --gpus")
    if gb is not None and not any(gb % lay.dp == 0 for lay in space.layouts):
        dps = sorted({lay.dp for lay in space.layouts})
        source = " (from the model file's OPTPLAN)" if global_batch is None else ""
        raise OptplanError(f"global batch {gb}{source} is not divisible by any data-parallel degree the layouts "
                           f"allow ({', '.join(map(str, dps[:8]))}): use a multiple of {dps[0]} for --global-batch")
    result = search(profile, cluster, space, goal=goal, method=method, seed=seed, n_trials=n_trials,
                    storage=storage, on_progress=on_progress, calibration=calibration, on_trial=on_trial)
    ranked = result.ranked
    report: ProbeReport | None = None
    probe_text: list[str] = []
    if probe is not None and profile.model_file and result.feasible:
        kwargs = {"runner": probe_runner} if probe_runner is not None else {}
        report = run_probe_stage(profile, cluster, ranked, options=probe, local=probe_local, storage=storage,
                                 study_name=result.study.study_name, on_progress=on_progress,
                                 cancelled=cancelled, **kwargs)
        dropped: tuple[str, ...] = ()
        if report.time_comparable:
            calibration = report.calibration or calibration
            ranked, dropped = rerank(ranked, report, goal, Pricer(profile, cluster, calibration))
        probe_text = probe_lines(report, dropped)
    feasible = tuple(e for e in ranked if e.fits)
    pricer = Pricer(profile, cluster, calibration)
    pricer.priced.update({e.strategy: e for e in ranked})
    all_notes = (list(notes) + list(profile.notes) + [MODEL_SCOPE_NOTE] + [f"measured: {n}" for n in ceiling_notes]
                 + lora_notes)
    if gb is not None and profile.defaults.global_batch == gb and global_batch is None:
        all_notes.append(f"global batch {gb} from the model file's OPTPLAN")
    if precision_note is not None:
        all_notes.append(precision_note)
    summary = SearchSummary(method=result.method, space_size=result.space_size, evaluated=result.evaluated,
                            feasible=len(feasible), resumed=result.resumed, layouts=len(space.layouts),
                            layouts_screened_out=result.layouts_screened_out, objective=goal.objective,
                            study_name=result.study.study_name, storage=None if storage is None else str(storage))
    counts = space.gpu_counts
    cluster_summary = ClusterSummary(gpu=cluster.gpu.name, gpus=max(counts),
                                     gpus_per_node=cluster.gpus_per_node, memory_bytes=cluster.gpu.memory_bytes,
                                     detected=cluster.detected, gpu_counts=counts if len(counts) > 1 else None)
    common = dict(model=profile.name, model_path=profile.path, cluster=cluster_summary, global_batch=gb,
                  seq_len=profile.seq_len, search=summary, objective=goal.objective, tokens=goal.tokens,
                  deadline_s=goal.deadline_s, probes=report, calibration=calibration,
                  finetune=FinetuneChoice.of_adapter(profile.adapter, quant) if profile.adapter is not None else None)
    if feasible:
        pick = with_cost(feasible[0], goal, cluster)
        if pick.strategy.engine == "megatron" and profile.model_file:
            all_notes.append(MEGATRON_FILE_NOTE)
        level = goal.deadline_class(pick)  # 0 without a deadline
        if level == 2:
            all_notes.append(f"no searched plan trains {goal.tokens:.3g} tokens within the deadline: this is the "
                             "fastest; widen --gpus-range or relax --deadline")
        elif level == 1:
            all_notes.append(f"no searched plan meets the deadline at its band's slow end ({goal.train_time_s(pick, 'slow') / 86400:.1f} "
                             f"days for this one): this one meets it at its nominal time only; widen --gpus-range or "
                             "relax --deadline for a margin")
        lines = rationale(pick, ranked, pricer, space, goal, result.evaluated + result.resumed) + probe_text
        return Recommendation(
            **common, fits=True, plan=pick.strategy, estimate=pick,  # type: ignore[arg-type]
            alternatives=tuple(PlanEstimate(plan=e.strategy, estimate=with_cost(e, goal, cluster))
                               for e in feasible[1:1 + alternatives]),
            rationale=tuple(lines),
            pareto=tuple(PlanEstimate(plan=e.strategy, estimate=with_cost(e, goal, cluster))
                         for e in pareto_front(feasible, goal)),
            suggestions=(), notes=tuple(all_notes),
            export=export_plan_for(pick.strategy, profile, pricer.cluster_for(pick.gpus), shown=pick))
    closest = min(ranked, key=lambda e: e.memory.total_bytes) if ranked else None
    gpus = max(space.gpu_counts)
    why = (f"no searched plan fits {gpus} x {cluster.gpu.name}: the leanest needs "
           f"{closest.memory.total_bytes / 2**30:.1f} GiB per GPU ({closest.strategy.label()}) of "
           f"{closest.memory.capacity_bytes / 2**30:.1f} GiB usable") if closest is not None else (
           f"no searched plan can run {profile.name} on {gpus} x {cluster.gpu.name}")
    big = pricer.cluster_for(gpus)
    lines, behind = what_would_fit(profile, big, space)
    return Recommendation(
        **common, fits=False, plan=None, estimate=None, alternatives=(), rationale=(why,),  # type: ignore[arg-type]
        pareto=(), suggestions=tuple(lines), suggested=tuple(PlanEstimate(plan=e.strategy, estimate=e) for e in behind),
        notes=tuple(all_notes))


def _recommend_states(profile: ModelProfile, cluster: Cluster, *, global_batch: int | None,
                      precisions: Sequence[str] | None, engines: Sequence[str] | None, offload: bool,
                      alternatives: int, notes: Sequence[str], goal: Goal) -> Recommendation:
    """``--params``: the least sharding whose model states fit (no time model: see states_plan)."""
    from optplan.planner.states_plan import STATES_NOTE, search_states, states_rationale

    if goal.objective != "throughput" or goal.tokens is not None:
        raise OptplanError("--params gives model states only, with no step time: --objective time/cost and "
                           "--tokens need a model FILE or --arch")
    space, ranked = search_states(profile, cluster, global_batch=global_batch, precisions=precisions,
                                  engines=engines, offload=offload)
    if not ranked:  # e.g. a global batch that no data-parallel degree of these GPUs divides
        fix = (f"use a --global-batch divisible by the data-parallel degree (at most {cluster.gpus})"
               if global_batch is not None else "change --gpus")
        raise OptplanError(f"no plan of {profile.name}'s model states on {cluster.gpus} GPUs"
                           + (f" at global batch {global_batch}" if global_batch is not None else "") + f": {fix}")
    feasible = [e for e in ranked if e.fits]
    summary = SearchSummary(method="enumerate", space_size=len(ranked), evaluated=len(ranked),
                            feasible=len(feasible), objective="states")
    cluster_summary = ClusterSummary(gpu=cluster.gpu.name, gpus=cluster.gpus, gpus_per_node=cluster.gpus_per_node,
                                     memory_bytes=cluster.gpu.memory_bytes, detected=cluster.detected)
    common = dict(model=profile.name, model_path=profile.path, cluster=cluster_summary, global_batch=global_batch,
                  seq_len=None, search=summary, objective="states", notes=(*notes, STATES_NOTE))
    if feasible:
        pick = feasible[0]
        return Recommendation(
            **common, fits=True, plan=pick.strategy, estimate=pick,  # type: ignore[arg-type]
            alternatives=tuple(PlanEstimate(plan=e.strategy, estimate=e) for e in feasible[1:1 + alternatives]),
            rationale=tuple(states_rationale(pick, ranked)), pareto=(), suggestions=(),
            export=export_plan_for(pick.strategy, profile, cluster))
    leanest = min(ranked, key=lambda e: e.memory.total_bytes)
    why = (f"no sharding fits the model states of {profile.params:,} parameters on {cluster.gpus} x "
           f"{cluster.gpu.name}: the leanest ({leanest.strategy.label()}) needs "
           f"{leanest.memory.total_bytes / 2**30:.1f} GiB per GPU of {leanest.memory.capacity_bytes / 2**30:.1f}")
    lines, behind = what_would_fit(profile, cluster, space, states_only=True)
    return Recommendation(**common, fits=False, plan=None, estimate=None, alternatives=(),  # type: ignore[arg-type]
                          rationale=(why,), pareto=(), suggestions=tuple(lines),
                          suggested=tuple(PlanEstimate(plan=e.strategy, estimate=e) for e in behind))
