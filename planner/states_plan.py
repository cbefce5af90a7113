"""``recommend --params N``: the least sharding whose model states fit, when there is no model to time.

A parameter count gives model states (ZeRO paper §5: 16 bytes/param under mixed-precision Adam), buffers
and overhead, but no activations and no FLOPs, so no throughput to rank by. The plan follows DeepSpeed's
own guidance (ZeRO docs, "choosing a stage"; the ZeRO-Offload paper §1): use the lowest stage that fits,
because each step up adds communication (ZeRO-1 < ZeRO-2 < ZeRO-3, FSDP SHARD_GRAD_OP < FULL_SHARD), and
offload only when nothing else fits (it moves the optimizer step or the weights over PCIe). Among equals,
more headroom wins: activations still need room, which the plan says.
"""

from __future__ import annotations

from collections.abc import Sequence

from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import StatesEstimate, estimate_states
from optplan.estimators.hardware import Cluster
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.units import gib
from optplan.planner.space import SearchSpace, build_space, strategy_of

STATES_NOTE = ("--params prices model states, buffers and overhead only: activations and step time need a model "
               "FILE or --arch; keep the headroom shown for activations")


def _cost_rank(s: Strategy) -> tuple[int, int, int]:
    """Communication/transfer cost order: offload last, then the shard stage, DeepSpeed before torch."""
    offload = (s.offload_optimizer != "none") + 2 * (s.offload_params != "none")
    return (offload, s.shard_stage, 0 if s.engine == "deepspeed" else 1)


def rank_states(estimates: Sequence[StatesEstimate], space: SearchSpace) -> list[StatesEstimate]:
    """Feasible first, then the cheapest sharding, the preferred precision, and more headroom."""
    order = {p: i for i, p in enumerate(space.precisions)}
    return sorted(estimates, key=lambda e: (not e.fits, *_cost_rank(e.strategy), order[e.strategy.precision],
                                            -e.memory.headroom_bytes, e.strategy.label()))


def search_states(profile: ModelProfile, cluster: Cluster, *, global_batch: int | None,
                  precisions: Sequence[str] | None, engines: Sequence[str] | None,
                  offload: bool) -> tuple[SearchSpace, list[StatesEstimate]]:
    """Every data-parallel sharding/precision at micro-batch 1 (states do not depend on it), ranked."""
    space = build_space(profile, cluster, global_batch=global_batch, precisions=precisions,
                        engines=[e for e in (engines or ("deepspeed", "torch")) if e != "megatron"] or ["deepspeed"],
                        offload=offload, checkpointing=("none",))
    priced: list[StatesEstimate] = []
    for group in space.groups():
        mbs = space.micro_batches(group.layout)[:1]
        if not mbs:
            continue
        for gas in space.accumulations(group.layout, mbs[0]):
            s = strategy_of(group, mbs[0], gas)
            if s is None:
                continue
            try:
                priced.append(estimate_states(profile, cluster, s))
            except OptplanError:
                continue
    return space, rank_states(priced, space)


def _named(strategy: Strategy) -> str:
    """The plan's label with its engine, once: torch plans' labels carry ``[torch]`` already."""
    label = strategy.label()
    return label if f"[{strategy.engine}]" in label else f"{label} ({strategy.engine})"


def states_rationale(pick: StatesEstimate, ranked: Sequence[StatesEstimate]) -> list[str]:
    """Why this sharding: the cheaper ones that do not fit, with their GiB."""
    s, m = pick.strategy, pick.memory
    states = m.params_bytes + m.grads_bytes + m.optimizer_bytes
    lines = [f"least sharding whose model states fit, of {len(ranked)} priced: {_named(s)} holds {gib(states):.1f} GiB of states + {gib(m.buffers_bytes + m.overhead_bytes):.1f} "
             f"GiB buffers/overhead per GPU, {gib(m.headroom_bytes):.1f} GiB left for activations"]
    cheaper = [e for e in ranked if _cost_rank(e.strategy) < _cost_rank(s) and not e.fits]
    seen: set[tuple[int, int, int]] = set()
    for e in cheaper:
        key = _cost_rank(e.strategy)
        if key in seen:
            continue
        seen.add(key)
        lines.append(f"{_named(e.strategy)} needs {gib(e.memory.total_bytes):.1f} > "
                     f"{gib(e.memory.capacity_bytes):.1f} GiB per GPU")
    if m.host_bytes:
        lines.append(f"CPU offload: {gib(m.host_bytes):.1f} GiB host memory per GPU, "
                     f"{gib(m.host_bytes_per_node):.0f} GiB per node")
    lines.append(f"precision {s.precision}; mbs 1 x {s.grad_accum} x dp {s.dp}: micro-batch and checkpointing "
                 "depend on activations, which --params does not know")
    return lines
