"""The search's partial-checkpointing candidates: the fewest first blocks of each stage to checkpoint for a plan to fit.

Full checkpointing re-runs every block's forward; when the plan fits with room to spare, checkpointing only the first
N blocks of each pipeline stage (Megatron-LM's ``--recompute-method block``, estimators/partial_checkpointing.py)
re-runs fewer and is faster. Memory falls and time rises with N (each checkpointed block trades its saved activations
for its input and one more forward), so the fastest such plan that fits is the one with the fewest checkpointed
blocks that still fits. "Fits" has two classes the ranking tells apart (planner/goal.py ``class_key``): fitting at the
median allocator margin measured, and at its 90th percentile (``Estimate.fits_at_high_margin``); the fewest N of each
is a candidate. Each is found from the two ends (N = 1 and N = blocks − 1): a first probe where the total memory,
linear in N between them, reaches the capacity (exact under Korthikanti's formula for the median class), then the
count below it, and a bisection over what is left when that line is not exact (memory is monotone in N): 4 estimates
as a rule, at most log2(blocks) + 4. Measured on the search benchmark (benchmarks/bench_search_scale.py): Llama 3 70B
on 4,096 H100 prices ~1,600 more plans, 3.0 -> 3.9 s.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from optplan.estimators.estimate import Estimate
from optplan.estimators.parallel import layers_per_stage
from optplan.estimators.strategy import Strategy


def can_be_partial(strategy: Strategy, blocks: int | None) -> bool:
    """Whether a plan can checkpoint only some of its blocks (Strategy's rules: full checkpointing of every block
    today, no virtual stages, DualPipe or quantised base, and at least two blocks on a stage)."""
    return (strategy.checkpointing == "full" and strategy.checkpoint_layers is None and strategy.vpp == 1
            and strategy.pp_schedule == "1f1b" and strategy.quant == "none" and blocks is not None
            and layers_per_stage(blocks, strategy.pp) >= 2)


def fits_robustly(est: Estimate) -> bool:
    """Fits at the 90th percentile of the allocator margins measured too (unknown counts as fitting)."""
    return est.fits and est.fits_at_high_margin is not False


def fewest_checkpointed(price: Callable[[Strategy], Estimate | None], strategy: Strategy, blocks: int,
                        ok: Callable[[Estimate], bool] = lambda e: e.fits, *, at_least: int = 1) -> Estimate | None:
    """The estimate of ``strategy`` (full checkpointing of every block) with the fewest first blocks of each stage
    checkpointed for which ``ok`` holds (fits, by default; :func:`fits_robustly` for the robust class), searched from
    ``at_least`` blocks up; None when no count short of all does, or the plan cannot be partial. ``price`` is the
    search's cached estimator (None for a plan the model cannot run).

    ``ok`` holds from some count on (module docstring): a bisection, whose first probe is where the total memory,
    linear in the count between its ends, reaches the capacity (exact for ``fits`` under the formula; a lower bound
    of the robust class), and its second the count below it: two estimates beyond the ends when the line is exact."""
    if not can_be_partial(strategy, blocks):
        return None

    def at(n: int) -> Estimate | None:
        return price(strategy.model_copy(update={"checkpoint_layers": n}))

    hi = layers_per_stage(blocks, strategy.pp) - 1  # the most blocks short of all
    lo = max(1, at_least)
    best = at(hi)
    if best is None or not ok(best):
        return None
    first = at(lo)
    if first is not None and ok(first):
        return first
    if first is not None and hi - lo > 1:  # the secant guess, then the count below it
        slope = (first.memory.total_bytes - best.memory.total_bytes) / (hi - lo)
        over = first.memory.total_bytes - first.memory.capacity_bytes
        guess = min(hi - 1, max(lo + 1, lo + math.ceil(over / slope))) if slope > 0 else hi - 1
        est = at(guess)
        if est is not None and ok(est):
            hi, best = guess, est
            below = at(guess - 1) if guess - 1 > lo else None
            if below is None or not ok(below):
                return best
            hi, best = guess - 1, below
        else:
            lo = guess
    while hi - lo > 1:  # ok fails at lo, holds at hi
        mid = (lo + hi) // 2
        est = at(mid)
        if est is not None and ok(est):
            hi, best = mid, est
        else:
            lo = mid
    return best
