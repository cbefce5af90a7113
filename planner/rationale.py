"""Rationale: one line per decision of the chosen plan, each naming the number that drove it."""

from __future__ import annotations

from collections.abc import Mapping

from optplan.estimators.estimate import Estimate
from optplan.estimators.precision import get_recipe
from optplan.estimators.strategy import Strategy
from optplan.estimators.units import gib
from optplan.planner.space import SearchSpace


def _gib(n: float) -> str:
    return f"{gib(n):.1f} GiB"


def _neighbour(priced: Mapping[Strategy, Estimate], pick: Strategy, **change: object) -> Estimate | None:
    """The priced candidate equal to ``pick`` except for ``change`` (grad_accum kept consistent)."""
    want = pick.model_copy(update=change)
    for strategy, est in priced.items():
        if (strategy.precision, strategy.zero, strategy.mbs, strategy.checkpointing) == (
                want.precision, want.zero, want.mbs, want.checkpointing):
            return est
    return None


def _precision_line(pick: Estimate, priced: Mapping[Strategy, Estimate], space: SearchSpace) -> str:
    s = pick.strategy
    recipe = get_recipe(s.precision)
    head = f"precision {s.precision} ({recipe.description})"
    others = [e for p in space.precisions if p != s.precision
              if (e := _neighbour(priced, s, precision=p)) is not None]
    if not others:
        return f"{head}: the only precision searched"
    faster_unfit = [e for e in others if not e.fits and e.samples_per_s > pick.samples_per_s]
    fitting = [e for e in others if e.fits]
    parts = []
    if fitting:
        best = max(fitting, key=lambda e: e.samples_per_s)
        ratio = pick.samples_per_s / best.samples_per_s
        parts.append(f"{ratio:.2f}x the samples/s of {best.strategy.precision} at the same settings "
                     f"({pick.samples_per_s:.1f} vs {best.samples_per_s:.1f})")
    for e in faster_unfit:
        parts.append(f"{e.strategy.precision} would be faster but needs {_gib(e.memory.total_bytes)}")
    if not parts:
        parts.append("the other precisions do not fit at these settings")
    return f"{head}: " + "; ".join(parts)


def _zero_line(pick: Estimate, priced: Mapping[Strategy, Estimate]) -> str:
    s = pick.strategy
    m = pick.memory
    if s.zero == 0:
        states = m.params_bytes + m.grads_bytes + m.optimizer_bytes
        line = f"ZeRO-0 (plain data parallel): model states of {_gib(states)}/GPU fit unsharded"
        higher = _neighbour(priced, s, zero=1)
        if higher is not None and higher.fits and higher.samples_per_s <= pick.samples_per_s:
            line += f"; sharding (ZeRO-1) would not be faster ({higher.samples_per_s:.1f} samples/s)"
        return line
    lower = _neighbour(priced, s, zero=s.zero - 1)
    if lower is None:
        return f"ZeRO-{s.zero}: shards model states over {s.dp} GPUs"
    sharded = {1: ("optimizer states", lower.memory.optimizer_bytes),
               2: ("gradients", lower.memory.grads_bytes),
               3: ("weights", lower.memory.params_bytes)}[s.zero]
    if not lower.fits:
        return (f"ZeRO-{s.zero}: under ZeRO-{s.zero - 1} at mbs {s.mbs} the {sharded[0]} of {_gib(sharded[1])}/GPU "
                f"do not fit beside {_gib(lower.memory.activations_bytes)} of activations "
                f"({_gib(lower.memory.total_bytes)} > {_gib(m.capacity_bytes)})")
    freed = lower.memory.total_bytes - m.total_bytes
    if abs(pick.samples_per_s - lower.samples_per_s) <= 0.005 * pick.samples_per_s:
        return (f"ZeRO-{s.zero}: as fast as ZeRO-{s.zero - 1} ({pick.samples_per_s:.1f} samples/s, same traffic at "
                f"this accumulation) and sharding the {sharded[0]} frees {_gib(freed)}/GPU; ties go to headroom")
    return (f"ZeRO-{s.zero}: sharding the {sharded[0]} over {s.dp} GPUs frees {_gib(freed)}/GPU at "
            f"{pick.samples_per_s:.1f} vs {lower.samples_per_s:.1f} samples/s under ZeRO-{s.zero - 1}")


def _mbs_line(pick: Estimate, priced: Mapping[Strategy, Estimate], space: SearchSpace) -> str:
    s = pick.strategy
    larger = [b for b in space.micro_batches if b > s.mbs]
    if not larger:
        limit = "the global batch" if space.global_batch else "the searched range"
        return f"micro-batch {s.mbs}: the largest {limit} allows ({_gib(pick.memory.total_bytes)} per GPU)"
    nxt = _neighbour(priced, s, mbs=larger[0])
    if nxt is not None and not nxt.fits:
        return (f"micro-batch {s.mbs}: the largest that fits with these settings; {larger[0]} needs "
                f"{_gib(nxt.memory.total_bytes)} > {_gib(nxt.memory.capacity_bytes)}")
    if nxt is not None:
        return (f"micro-batch {s.mbs}: {larger[0]} fits but is not faster "
                f"({nxt.samples_per_s:.1f} vs {pick.samples_per_s:.1f} samples/s)")
    return f"micro-batch {s.mbs}"


def _checkpointing_line(pick: Estimate, priced: Mapping[Strategy, Estimate]) -> str:
    s = pick.strategy
    if s.checkpointing == "none":
        alt = _neighbour(priced, s, checkpointing="full")
        line = f"no activation checkpointing: activations of {_gib(pick.memory.activations_bytes)} fit"
        if alt is not None:
            pct = 100 * alt.time.recompute_s / pick.time.step_s
            line += f"; full checkpointing would add {pct:.0f}% recompute per step"
        return line
    plain = [e for e in priced.values() if e.strategy.checkpointing == "none" and e.fits]
    if not plain:
        same = _neighbour(priced, s, checkpointing="none")
        need = f" (needs {_gib(same.memory.total_bytes)} at mbs {s.mbs})" if same is not None else ""
        return f"full activation checkpointing: without it no searched plan fits{need}"
    best = max(plain, key=lambda e: e.samples_per_s)
    return (f"full activation checkpointing: cuts activations to {_gib(pick.memory.activations_bytes)} so mbs "
            f"{s.mbs} fits; the best plan without it reaches {best.samples_per_s:.1f} vs "
            f"{pick.samples_per_s:.1f} samples/s")


def _batch_line(pick: Estimate, space: SearchSpace) -> str:
    s = pick.strategy
    if space.global_batch:
        return (f"gradient accumulation {s.grad_accum}: global batch {s.global_batch} = mbs {s.mbs} x "
                f"{s.grad_accum} steps x {s.dp} GPUs")
    return (f"global batch {s.global_batch} (mbs {s.mbs} x {s.dp} GPUs) was free: hold it with --global-batch; "
            "if it differs from your tuned batch, scale the learning rate: linear rule for SGD (Goyal et al. "
            "2017), square-root rule for Adam (Malladi et al. 2022)")


def rationale(pick: Estimate, priced: Mapping[Strategy, Estimate], space: SearchSpace) -> list[str]:
    """The chosen plan's decisions, one line each, with the numbers behind them."""
    return [
        f"fastest feasible of {len(priced)} candidates: {pick.samples_per_s:.1f} samples/s, "
        f"{pick.mfu * 100:.0f}% MFU, {pick.reason}",
        _precision_line(pick, priced, space),
        _zero_line(pick, priced),
        _mbs_line(pick, priced, space),
        _checkpointing_line(pick, priced),
        _batch_line(pick, space),
    ]
