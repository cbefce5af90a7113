"""What "best" means: the objective (throughput, time or cost to train a token budget), its figures at an end of
the time band, and the ranking every search result and rationale uses.

Objectives (``Goal``): ``throughput`` maximises samples/s and memory headroom; ``time`` and ``cost`` minimise the
time to train the token budget and its cost (GPU-hours x price, or GPU-hours without a price).

Every figure is taken at the slow end of the estimate's time band (``time.step_s_high``,
estimators/uncertainty.py): a plan is ranked by what it delivers if the time model errs against it, so the
search does not chase the model's optimism (issue 15). Among plans within the model's typical error of the best
(``Goal.ties``), ``rank`` then prefers the simplest (planner/simplicity.py). All orders are total and
deterministic. Units: samples/s, seconds, GPU-hours, bytes.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import Estimate
from optplan.planner.simplicity import prefer_simple

Objective = Literal["throughput", "time", "cost"]
OBJECTIVES: tuple[str, ...] = ("throughput", "time", "cost")
TIE_TOLERANCE = 0.05
"""Plans whose robust figures are this close (relative) tie: the time model's typical error on one measured
run (held-out MAPE 3.3-5.7 % per GPU and engine, 5.5 % over every given set: benchmarks/fidelity_published.py)."""
BandEnd = Literal["nominal", "fast", "slow"]


def band_factor(e: Estimate, end: BandEnd) -> float:
    """The step time at the band's ``end`` ÷ the nominal step time (1 for ``nominal`` or an estimate
    without a band): throughput divides by it, times to train multiply by it."""
    t = e.time
    at = {"nominal": t.step_s, "fast": t.step_s_low, "slow": t.step_s_high}[end]
    return at / t.step_s if at > 0 else 1.0


class Goal(BaseModel):
    """What "best" means: the objective and, for time/cost, the token budget, price and deadline."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    objective: Objective = "throughput"
    tokens: float | None = Field(default=None, gt=0, description="token budget (tokens)")
    price_per_gpu_hour: float | None = Field(default=None, ge=0, description="USD per GPU-hour")
    deadline_s: float | None = Field(default=None, gt=0, description="train within this time (s)")

    def check(self) -> None:
        if self.objective in ("time", "cost") and self.tokens is None:
            raise OptplanError(f"--objective {self.objective} needs --tokens (the token budget to train)")
        if self.deadline_s is not None and self.tokens is None:
            raise OptplanError("--deadline needs --tokens (the token budget to train in that time)")
        if self.price_per_gpu_hour is not None and self.tokens is None:
            raise OptplanError("--price needs --tokens (the token budget whose training it prices)")

    def train_time_s(self, e: Estimate, end: BandEnd = "nominal") -> float:
        """Time to train the token budget (s) at the band's ``end``; inf without a token model."""
        if self.tokens is None or not e.tokens_per_s:
            return math.inf
        return self.tokens / e.tokens_per_s * band_factor(e, end)

    def gpu_hours(self, e: Estimate, end: BandEnd = "nominal") -> float:
        return e.gpus * self.train_time_s(e, end) / 3600

    def meets_deadline(self, e: Estimate, end: BandEnd = "nominal") -> bool:
        """The time to train at the band's ``end`` is within the deadline (True without a deadline)."""
        return self.deadline_s is None or self.train_time_s(e, end) <= self.deadline_s

    def deadline_class(self, e: Estimate) -> int:
        """0: meets the deadline even at the band's slow end; 1: at the nominal time only (the band says it may
        miss); 2: misses it (0 without a deadline)."""
        if self.meets_deadline(e, "slow"):
            return 0
        return 1 if self.meets_deadline(e) else 2

    @property
    def by_throughput(self) -> bool:
        return self.objective == "throughput" or self.tokens is None

    def figure(self, e: Estimate, end: BandEnd = "slow") -> float:
        """The objective's own figure at the band's ``end``, lower is better: -samples/s (throughput),
        the time to train (time) or GPU-hours (cost). ``slow`` (the default) is the robust figure."""
        if self.by_throughput:
            return -e.samples_per_s / band_factor(e, end)
        if self.objective == "time":
            return self.train_time_s(e, end)
        return self.gpu_hours(e, end)

    def class_key(self, e: Estimate) -> tuple[float, ...]:
        """What comes before the figure: feasible first, those that fit at the allocator's 90th-percentile margin
        before those that fit only at its median, then (time/cost with a deadline) plans that meet it even at
        their band's slow end, then those that meet it at their nominal time only (``deadline_class``), and for the
        time objective with a deadline the fewest GPUs. Only plans of one class can tie."""
        # a plan that fits only at the median of the measured allocator margins may run out of memory: one that fits
        # at their 90th percentile goes first (estimators/allocator_overhead.py; None: unknown, taken as fitting)
        head: tuple[float, ...] = (0.0 if e.fits else 1.0, 1.0 if e.fits and e.fits_at_high_margin is False else 0.0)
        if self.by_throughput or self.deadline_s is None:
            return head
        met = self.deadline_class(e)  # robustly met first, then met at the nominal time only, then missed
        if self.objective == "time":  # the fewest GPUs that meet the deadline, then the fastest
            return (*head, float(met), e.gpus if met < 2 else 0.0)
        return (*head, float(met))

    def rank_key(self, e: Estimate) -> tuple[float, ...]:
        """Ascending sort key: the class (``class_key``), then the robust figure (the band's slow end),
        then for cost the robust time to train, then the nominal figure, then headroom, then the GPU count."""
        body: tuple[float, ...] = (self.figure(e, "slow"),)
        if not self.by_throughput and self.objective == "cost":
            body = (*body, self.train_time_s(e, "slow"))
        # the nominal figure breaks equal slow ends: plans predicted above the best measured MFU all have their slow
        # end at that envelope's time (uncertainty.py), which the nominal prediction still orders
        body = (*body, self.figure(e, "nominal"))
        return (*self.class_key(e), *body, -float(e.memory.headroom_bytes), float(e.gpus))

    def ties(self, best: Estimate, other: Estimate) -> bool:
        """``other`` cannot be told apart from ``best``: same class, and its robust figure (the band's slow
        end) within ``TIE_TOLERANCE`` of best's (throughput: samples/s at step_s_high >= (1 − tol) × best's;
        time/cost: time or GPU-hours at step_s_high <= (1 + tol) × best's).

        Not the overlap of the two absolute bands: plans priced from the same measured set share most of
        their error (the same kernels, the same fitted constants), so their bands move together, and the
        overlap of absolute bands tied nearly every plan (879 of 4,591 for GPT-3 on 1,024 A100s, a pick
        13 % slower than the best). What separates two such plans is the model's typical error on one run,
        its held-out MAPE; a plan outside the measured domain is already held back by its wider slow end."""
        if self.class_key(other) != self.class_key(best):
            return False
        mine, theirs = self.figure(other, "slow"), self.figure(best, "slow")
        if self.by_throughput:  # figures are -samples/s
            return -mine >= (1 - TIE_TOLERANCE) * -theirs
        return mine <= (1 + TIE_TOLERANCE) * theirs

    def values(self, e: Estimate) -> list[float]:
        """The study's objective values for ``e`` (see ``directions``), at the band's slow end: samples/s
        and headroom (GiB), or days and GPU-hours to train."""
        if self.by_throughput:
            return [-self.figure(e, "slow"), e.memory.headroom_bytes / 2**30]
        return [self.train_time_s(e, "slow") / 86400, self.gpu_hours(e, "slow")]

    @property
    def directions(self) -> list[str]:
        if self.by_throughput:
            return ["maximize", "maximize"]
        return ["minimize", "minimize"]


def pareto_front(estimates: tuple[Estimate, ...] | list[Estimate], goal: Goal | None = None) -> list[Estimate]:
    """Feasible estimates that no other feasible one beats on both axes, best first.

    Throughput: (samples/s up, memory headroom up). Time/cost: (time to train down, GPU-hours down).
    """
    goal = goal or Goal()
    feasible = [e for e in estimates if e.fits]
    if goal.objective == "throughput" or goal.tokens is None:
        axes = [(-e.samples_per_s, -float(e.memory.headroom_bytes)) for e in feasible]
    else:
        axes = [(goal.train_time_s(e), goal.gpu_hours(e)) for e in feasible]
    order = sorted(range(len(feasible)), key=lambda i: (axes[i], feasible[i].strategy.label()))
    front: list[Estimate] = []
    best_second = math.inf
    for i in order:  # sorted by the first axis: keep those strictly better on the second
        if axes[i][1] < best_second:
            front.append(feasible[i])
            best_second = axes[i][1]
    return front


def rank_by_figure(estimates: list[Estimate] | tuple[Estimate, ...], goal: Goal) -> tuple[Estimate, ...]:
    """``estimates`` in ``goal.rank_key`` order (the robust figure), before the simplicity tie-break."""
    return tuple(sorted(estimates, key=lambda e: (goal.rank_key(e), e.strategy.label())))


def rank(estimates: list[Estimate] | tuple[Estimate, ...], goal: Goal) -> tuple[Estimate, ...]:
    """The final ranking: by the robust figure, then the simplest of the plans tied with the best first
    (``simplicity.prefer_simple``): ``rank(...)[0]`` is the chosen plan when it fits."""
    return prefer_simple(rank_by_figure(estimates, goal), goal)
