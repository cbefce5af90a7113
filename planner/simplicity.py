"""Simplicity tie-break: among feasible plans the time model cannot tell from the best, pick the simplest.

A predicted difference smaller than the prediction's own uncertainty is no reason to take on more moving
parts (issue 15, "a search that does not chase its errors"). The best plan ``A`` is the first of the ranking
by the robust figure (``Goal.rank_key``: the band's slow end); plan ``B`` *ties* with it when both are of the
same class (feasible; for time/cost with a deadline, meeting it or not; for time with a deadline, the same
GPU count) and ``B``'s robust figure is within ``goal.TIE_TOLERANCE`` (5 %, the model's typical
error on one measured run) of ``A``'s - ``Goal.ties``, which says why this is not the overlap of the two
absolute bands (they share most of their error). Tied plans are of one memory class too: ``Goal.class_key`` ranks a
plan that fits at the 90th percentile of the allocator margins measured before one that fits only at their median
(``Estimate.fits_at_high_margin``, estimators/allocator_overhead.py), so a plan that may run out of memory never ties
with one that does not. Among the tied plans the simplest is chosen, by this order (``simplicity_key``, lower is
simpler), each criterion deciding only when the ones before it are equal (``tie_key``):

1. fewer model-parallel dimensions: the count of tp > 1, pp > 1 and cp > 1 (the Strategy has no expert
   parallelism to count);
2. no offload: the count of offloaded states (optimizer states, parameters);
3. less sharding: none (DDP / ZeRO-0) < ZeRO-1 (Megatron's distributed optimizer) < ZeRO-2 / FSDP
   SHARD_GRAD_OP < ZeRO-3 / FSDP FULL_SHARD / HYBRID_SHARD (which shards the weights too, within a node);
4. fewer virtual pipeline stages (vpp);
5. less recomputation: none < selective < full activation checkpointing (of every block, or of the first N: partial);
6. on the torch engine, autocast over 16-bit weights: ``amp-bf16``/``amp-fp16`` (fp32 weights, the recipe accelerate,
   Hugging Face's Trainer and Lightning run, so every export takes the plan) before ``bf16``, ``fp16`` and
   ``bf16-pure`` (optplan's train.py only); DeepSpeed's and Megatron's own recipe is 16-bit weights;

and then the robust figure (the earlier place in the ranking). Only the chosen plan moves (to the front);
the others keep their order by the robust figure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.estimate import Estimate
from optplan.estimators.strategy import Strategy

if TYPE_CHECKING:  # goal.py imports this module; the Goal is only passed in
    from optplan.planner.goal import Goal

CRITERIA: tuple[str, ...] = ("fewer model-parallel dimensions", "no offload", "less sharding",
                             "fewer virtual pipeline stages", "less recomputation",
                             "autocast (every torch export runs it)")
"""The names of ``simplicity_key``'s components, in order."""
TIE_CRITERIA: tuple[str, ...] = CRITERIA
"""The names of ``tie_key``'s components, in order."""
_RECOMPUTE = {"none": 0, "selective": 1, "moe": 1, "full": 2}
_WEIGHTS_16BIT = ("bf16", "fp16", "bf16-pure")
"""Recipes that hold 16-bit weights: on the torch engine only optplan's train.py runs them (criterion 6)."""


def simplicity_key(strategy: Strategy) -> tuple[int, ...]:
    """How complex ``strategy`` is, one component per ``CRITERIA`` entry; lower is simpler."""
    s = strategy
    return (int(s.tp > 1) + int(s.pp > 1) + int(s.cp > 1),
            int(s.offload_optimizer != "none") + int(s.offload_params != "none"),
            s.shard_stage,
            s.vpp,
            _RECOMPUTE[s.checkpointing],
            int(s.engine == "torch" and s.precision in _WEIGHTS_16BIT))


def tie_key(estimate: Estimate) -> tuple[int, ...]:
    """The tie-break's order over tied plans, one component per ``TIE_CRITERIA`` entry (``simplicity_key``);
    lower first."""
    return simplicity_key(estimate.strategy)


class TieBreak(BaseModel):
    """The outcome of the tie-break over a ranking: the plan first by the robust figure, the plans tied
    with it (itself included, in ranking order), the one chosen, and the criterion that set it apart."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    best: Estimate = Field(description="first by the robust figure")
    tied: tuple[Estimate, ...] = Field(description="every plan that ties with best (Goal.ties), best included")
    chosen: Estimate
    criterion: str | None = Field(default=None, description="the TIE_CRITERIA entry that decided; None when the "
                                                            "best is also the first by tie_key")

    @property
    def changed(self) -> bool:
        return self.chosen.strategy != self.best.strategy


def tie_break(ranked: tuple[Estimate, ...] | list[Estimate], goal: Goal) -> TieBreak | None:
    """The tie-break over ``ranked`` (in ``Goal.rank_key`` order); None when its first plan does not fit."""
    if not ranked or not ranked[0].fits:
        return None
    best = ranked[0]
    tied = tuple(e for e in ranked if e.fits and goal.ties(best, e))
    chosen = min(tied, key=tie_key)  # min keeps the first of equals: rank order
    criterion = None
    if chosen.strategy != best.strategy:
        mine, theirs = tie_key(chosen), tie_key(best)
        criterion = next(name for name, a, b in zip(TIE_CRITERIA, mine, theirs, strict=True) if a != b)
    return TieBreak(best=best, tied=tied, chosen=chosen, criterion=criterion)


def prefer_simple(ranked: tuple[Estimate, ...], goal: Goal) -> tuple[Estimate, ...]:
    """``ranked`` (in ``Goal.rank_key`` order) with the tie-break's chosen plan moved to the front."""
    tb = tie_break(ranked, goal)
    if tb is None or not tb.changed:
        return tuple(ranked)
    return (tb.chosen, *(e for e in ranked if e is not tb.chosen))


__all__ = ["CRITERIA", "TIE_CRITERIA", "TieBreak", "prefer_simple", "simplicity_key", "tie_break",
           "tie_key"]
