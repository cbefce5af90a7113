""""What if": any priced candidate set beside the chosen plan, in the rationale's terms.

The dashboard shows it when a trial other than the pick is selected: the same figures as the plan (with
the time and cost of the token budget) and lines saying what changing to it would gain or lose.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from optplan.estimators.estimate import Estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.units import gib
from optplan.planner.goal import Goal
from optplan.planner.recommend import with_cost


class WhatIf(BaseModel):
    """A candidate priced for display beside the pick: its estimate (with cost) and comparison lines."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    estimate: Estimate
    lines: tuple[str, ...]


def _change(new: float, old: float) -> str:
    if not old:
        return ""
    pct = (new / old - 1) * 100
    return f" ({pct:+.0f}%)" if abs(pct) >= 0.5 else " (same)"


def _days(seconds: float) -> str:
    return f"{seconds / 86400:.1f} days" if seconds >= 86400 else f"{seconds / 3600:.1f} h"


def what_if(candidate: Estimate, pick: Estimate | None, *, goal: Goal, cluster: Cluster) -> WhatIf:
    """``candidate`` with the goal's cost, and how it compares with ``pick`` (None: nothing fits)."""
    est = with_cost(candidate, goal, cluster)
    lines: list[str] = []
    if pick is not None and candidate.strategy == pick.strategy:
        lines.append("this is the chosen plan")
    elif pick is not None:
        lines.append(f"what if {candidate.strategy.label()} instead of the chosen {pick.strategy.label()}:")
        lines.append(f"throughput {candidate.samples_per_s:,.1f} vs {pick.samples_per_s:,.1f} samples/s"
                     f"{_change(candidate.samples_per_s, pick.samples_per_s)}")
        lines.append(f"memory {gib(candidate.memory.total_bytes):.1f} vs {gib(pick.memory.total_bytes):.1f} GiB per GPU"
                     f" of {gib(candidate.memory.capacity_bytes):.1f}")
        if goal.tokens is not None and candidate.tokens_per_s and pick.tokens_per_s:
            lines.append(f"time to train {goal.tokens:.3g} tokens {_days(goal.train_time_s(candidate))} vs "
                         f"{_days(goal.train_time_s(pick))}, {goal.gpu_hours(candidate):,.0f} vs "
                         f"{goal.gpu_hours(pick):,.0f} GPU-hours")
    lines.append(candidate.reason)
    lines.extend(f"note: {n}" for n in candidate.notes)
    return WhatIf(estimate=est, lines=tuple(lines))
