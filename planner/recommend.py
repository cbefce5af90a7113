"""recommend(): profile + cluster -> the fastest plan that fits, its runners-up, rationale, Pareto front.

A Python API with no printing: progress goes out through the ``on_progress`` callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict

from optplan.estimators.estimate import Estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.planner.events import ProgressEvent
from optplan.planner.rationale import rationale
from optplan.planner.search import SearchMethod, pareto_front, search
from optplan.planner.space import build_space
from optplan.planner.suggest import what_would_fit

DEFAULT_ALTERNATIVES = 4
MODEL_SCOPE_NOTE = ("search: data-parallel plans (ZeRO 0-3, DeepSpeed); price tensor/pipeline/context-parallel and "
                    "FSDP plans with optplan estimate; time model fitted on A100 Megatron runs (vTrain), other GPUs use "
                    "the same efficiencies on their datasheet peaks until probes calibrate them")


class PlanEstimate(BaseModel):
    """A strategy and its estimate, as the ``alternatives`` and ``pareto`` entries of --json."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    plan: Strategy
    estimate: Estimate


class SearchSummary(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str
    space_size: int
    evaluated: int
    feasible: int


class ClusterSummary(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str
    gpus: int
    gpus_per_node: int
    memory_bytes: int
    detected: bool


class Recommendation(BaseModel):
    """The answer of ``optplan recommend``; ``model_dump(mode="json")`` is the stable --json document."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    model_path: str
    cluster: ClusterSummary
    fits: bool
    plan: Strategy | None
    estimate: Estimate | None
    alternatives: tuple[PlanEstimate, ...]
    rationale: tuple[str, ...]
    pareto: tuple[PlanEstimate, ...]
    suggestions: tuple[str, ...]
    suggested: tuple[PlanEstimate, ...] = ()
    notes: tuple[str, ...]
    global_batch: int | None
    seq_len: int | None
    search: SearchSummary


def _pair(e: Estimate) -> PlanEstimate:
    return PlanEstimate(plan=e.strategy, estimate=e)


def recommend(profile: ModelProfile, cluster: Cluster, *, global_batch: int | None = None,
              precisions: Sequence[str] | None = None, method: SearchMethod = "auto", seed: int = 0,
              alternatives: int = DEFAULT_ALTERNATIVES, notes: Sequence[str] = (),
              on_progress: Callable[[ProgressEvent], None] | None = None) -> Recommendation:
    """Search the data-parallel space of ``profile`` on ``cluster`` and explain the pick.

    ``global_batch`` (samples) defaults to the model file's OPTPLAN value; None leaves it free.
    """
    gb = global_batch if global_batch is not None else profile.defaults.global_batch
    space = build_space(profile, cluster, global_batch=gb, precisions=precisions)
    result = search(profile, cluster, space, method=method, seed=seed, on_progress=on_progress)
    feasible = result.feasible
    priced = {e.strategy: e for e in result.ranked}
    all_notes = list(notes) + list(profile.notes) + [MODEL_SCOPE_NOTE]
    if gb is not None and profile.defaults.global_batch == gb and global_batch is None:
        all_notes.append(f"global batch {gb} from the model file's OPTPLAN")
    summary = SearchSummary(method=result.method, space_size=result.space_size, evaluated=result.evaluated,
                            feasible=len(feasible))
    cluster_summary = ClusterSummary(gpu=cluster.gpu.name, gpus=cluster.gpus, gpus_per_node=cluster.gpus_per_node,
                                     memory_bytes=cluster.gpu.memory_bytes, detected=cluster.detected)
    if feasible:
        pick = feasible[0]
        return Recommendation(
            model=profile.name, model_path=profile.path, cluster=cluster_summary, fits=True,
            plan=pick.strategy, estimate=pick,
            alternatives=tuple(_pair(e) for e in feasible[1:1 + alternatives]),
            rationale=tuple(rationale(pick, priced, space)),
            pareto=tuple(_pair(e) for e in pareto_front(feasible)), suggestions=(), notes=tuple(all_notes),
            global_batch=gb, seq_len=profile.seq_len, search=summary)
    closest = min(result.ranked, key=lambda e: e.memory.total_bytes)
    why = (f"no searched plan fits {cluster.gpus} x {cluster.gpu.name}: the leanest needs "
           f"{closest.memory.total_bytes / 2**30:.1f} GiB per GPU ({closest.strategy.label()}) of "
           f"{cluster.gpu.memory_bytes / 2**30:.1f} GiB")
    lines, behind = what_would_fit(profile, cluster, space)
    return Recommendation(
        model=profile.name, model_path=profile.path, cluster=cluster_summary, fits=False, plan=None,
        estimate=None, alternatives=(), rationale=(why,), pareto=(), suggestions=tuple(lines),
        suggested=tuple(_pair(e) for e in behind), notes=tuple(all_notes),
        global_batch=gb, seq_len=profile.seq_len, search=summary)
