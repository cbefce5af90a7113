"""The simplicity tie-break: its order, the tie rule (robust figures within the model's typical error), deadline classes and the criterion named."""

from __future__ import annotations

import pytest
from conftest import make_gpu, make_profile

from optplan.estimators.estimate import Estimate, estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.strategy import Strategy
from optplan.planner.goal import TIE_TOLERANCE, Goal, rank, rank_by_figure
from optplan.planner.simplicity import CRITERIA, prefer_simple, simplicity_key, tie_break

PROFILE = make_profile()
CLUSTER = Cluster(gpu=make_gpu(80), gpus=8, gpus_per_node=8)


def _est(**kw: object) -> Estimate:
    return estimate(PROFILE, CLUSTER, Strategy(**{"dp": 8, "mbs": 8, **kw}))


def _banded(e: Estimate, low: float, high: float) -> Estimate:
    """``e`` with its step-time band set to ``low``/``high`` x the step time (a controlled band)."""
    t = e.time
    return e.model_copy(update={"time": t.model_copy(update={"step_s_low": t.step_s * low,
                                                             "step_s_high": t.step_s * high})})


@pytest.mark.parametrize(("simple", "complex_", "criterion"), [
    (dict(tp=2, dp=4), dict(tp=2, pp=2, dp=2), "fewer model-parallel dimensions"),
    (dict(cp=2, dp=4, engine="megatron"), dict(tp=2, cp=2, dp=2, engine="megatron"), "fewer model-parallel dimensions"),
    (dict(zero=3), dict(zero=1, offload_optimizer="cpu"), "no offload"),
    (dict(zero=3, offload_optimizer="cpu"), dict(zero=3, offload_optimizer="cpu", offload_params="cpu"), "no offload"),
    (dict(zero=0), dict(zero=1), "less sharding"),
    (dict(zero=1), dict(zero=2), "less sharding"),
    (dict(fsdp="grad_op", engine="torch"), dict(fsdp="full", engine="torch"), "less sharding"),
    (dict(zero=2), dict(fsdp="hybrid", engine="torch"), "less sharding"),
    (dict(pp=4, vpp=2, dp=2, grad_accum=4, engine="megatron"), dict(pp=4, vpp=3, dp=2, grad_accum=4, engine="megatron"),
     "fewer virtual pipeline stages"),
    (dict(checkpointing="none"), dict(checkpointing="selective"), "less recomputation"),
    (dict(checkpointing="selective"), dict(checkpointing="full"), "less recomputation"),
    (dict(engine="torch", precision="amp-bf16"), dict(engine="torch", precision="bf16"),
     "autocast (every torch export runs it)"),
    (dict(engine="torch", precision="amp-fp16"), dict(engine="torch", precision="bf16-pure"),
     "autocast (every torch export runs it)"),
])
def test_simplicity_order_names_the_first_difference(simple: dict, complex_: dict, criterion: str) -> None:
    a, b = simplicity_key(Strategy(**simple)), simplicity_key(Strategy(**complex_))
    assert a < b
    assert CRITERIA[next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)] == criterion


def test_criteria_are_ordered_model_parallel_offload_sharding_vpp_recompute() -> None:
    # each earlier criterion outweighs every later one
    assert simplicity_key(Strategy(tp=2, dp=4)) > simplicity_key(
        Strategy(zero=3, offload_optimizer="cpu", offload_params="cpu", checkpointing="full"))
    assert simplicity_key(Strategy(zero=1, offload_optimizer="cpu")) > simplicity_key(Strategy(zero=3, checkpointing="full"))
    assert simplicity_key(Strategy(zero=1)) > simplicity_key(Strategy(zero=0, checkpointing="full"))


def test_16_bit_weights_are_no_less_simple_on_engines_whose_own_recipe_they_are() -> None:
    """DeepSpeed's bf16 section and Megatron's --bf16 hold 16-bit weights: only the torch engine prefers autocast."""
    assert simplicity_key(Strategy(engine="deepspeed", precision="bf16")) == simplicity_key(
        Strategy(engine="deepspeed", precision="fp32"))
    assert simplicity_key(Strategy(engine="torch", precision="bf16"))[-1] == 1
    assert simplicity_key(Strategy(engine="torch", precision="fp8"))[-1] == 0


def test_a_simpler_plan_within_the_models_typical_error_is_picked() -> None:
    goal = Goal()
    fast = _est(zero=1)  # ZeRO-1
    slow = _est(zero=0, checkpointing="selective")  # simpler (no sharding), slower (recompute)
    assert slow.samples_per_s < fast.samples_per_s
    a = _banded(fast, 0.9, 1.1)
    a_slow_end = a.samples_per_s / 1.1
    # B's slow end (samples/s at step_s_high) just within TIE_TOLERANCE of A's: a tie, and B is simpler
    b = _banded(slow, 0.9, slow.samples_per_s / (a_slow_end * (1 - TIE_TOLERANCE) * 1.0001))
    assert goal.ties(a, b)
    ranked = rank([a, b], goal)
    assert ranked[0] is b and ranked[1] is a
    tb = tie_break(rank_by_figure([a, b], goal), goal)
    assert tb is not None and tb.best is a and tb.chosen is b and tb.changed
    assert tb.tied == (a, b) and tb.criterion == "less sharding"
    # just beyond the tolerance: no tie, the faster plan stays first
    c = _banded(slow, 0.9, slow.samples_per_s / (a_slow_end * (1 - TIE_TOLERANCE) * 0.9999))
    assert not goal.ties(a, c)
    assert rank([a, c], goal)[0] is a


def test_a_plan_that_fits_only_at_the_median_allocator_margin_ranks_after_one_that_fits_at_the_90th() -> None:
    """A plan that fits only at the median of the measured allocator margins (it may run out of memory) ranks after
    every plan that fits at their 90th percentile, even a slower one; it never ties with one; the rationale says
    what was passed over and what it needs at the 90th percentile. Unknown (None) is not held back."""
    from optplan.planner.rationale import _margin_line

    goal = Goal()
    simple = _banded(_est(zero=0), 0.9, 1.1)
    risky = simple.model_copy(update={"fits_at_high_margin": False})
    sharded = _est(zero=1)  # 20 % slower at the slow end: no tie by figure
    safe = _banded(sharded, 0.9, sharded.samples_per_s / (0.8 * simple.samples_per_s / 1.1)).model_copy(
        update={"fits_at_high_margin": True})
    assert goal.figure(risky) < goal.figure(safe)  # the risky plan is the faster
    assert goal.class_key(safe) < goal.class_key(risky) and not goal.ties(risky, safe)
    assert rank([risky, safe], goal)[0] is safe and rank_by_figure([risky, safe], goal)[0] is safe
    line = _margin_line(safe, [safe, risky], goal)
    assert line is not None and "1 plan faster at the band's slow end fits only at the median" in line and "90th percentile" in line
    assert _margin_line(risky, [risky, safe], goal) is None  # said only of a pick that fits at the 90th
    unknown = risky.model_copy(update={"fits_at_high_margin": None})  # an older file's estimate: not held back
    assert rank([unknown, safe], goal)[0] is unknown
    both_safe = simple.model_copy(update={"fits_at_high_margin": True})
    assert rank([both_safe, safe], goal)[0] is both_safe  # both fit at the high margin: the faster


def test_overlapping_absolute_bands_alone_do_not_tie() -> None:
    # bands of plans priced from one measured set move together: B reaching A's slow end only at B's fast
    # end is no tie when B's own slow end is far behind A's
    goal = Goal()
    a = _banded(_est(zero=1), 0.8, 1.2)
    slow = _est(zero=0, checkpointing="selective")
    b = _banded(slow, slow.samples_per_s / a.samples_per_s * 1.2 * 0.99, 1.2 * a.samples_per_s / slow.samples_per_s * 1.25)
    assert b.samples_per_s / (b.time.step_s_low / b.time.step_s) >= a.samples_per_s / 1.2  # fast end reaches
    assert not goal.ties(a, b)


def test_the_robust_figure_ranks_and_a_wider_band_loses() -> None:
    goal = Goal()
    e = _est(zero=1)
    narrow, wide = _banded(e, 0.95, 1.05), _banded(_est(zero=1, mbs=4, grad_accum=2), 0.6, 1.8)
    assert wide.samples_per_s / 1.8 < narrow.samples_per_s / 1.05
    assert rank_by_figure([wide, narrow], goal)[0] is narrow
    assert goal.values(narrow)[0] == pytest.approx(narrow.samples_per_s / 1.05)


def test_infeasible_plans_and_an_infeasible_best_never_tie() -> None:
    goal = Goal()
    fits = _est(zero=1)
    too_big = fits.model_copy(update={"fits": False})
    assert not goal.ties(fits, too_big)
    assert tie_break((too_big, fits), goal) is None
    assert prefer_simple((too_big, fits), goal) == (too_big, fits)


def test_time_with_a_deadline_ties_only_plans_on_the_same_gpu_count() -> None:
    prof = make_profile(params=1_000_000_000, hidden=2048, layers=24)
    e8 = estimate(prof, Cluster(gpu=make_gpu(80), gpus=8, gpus_per_node=8), Strategy(dp=8, mbs=32, zero=1))
    e16 = estimate(prof, Cluster(gpu=make_gpu(80), gpus=16, gpus_per_node=8), Strategy(dp=16, mbs=9, zero=0))
    # simpler, on more GPUs, 2 % faster (a tie): its throughput set relative to e8's, so that the test follows the
    # ranking rules and not the time model's figures for these two plans
    speed = 1.02 * e8.tokens_per_s / e16.tokens_per_s
    e16 = e16.model_copy(update={"tokens_per_s": e16.tokens_per_s * speed, "samples_per_s": e16.samples_per_s * speed,
                                 "time": e16.time.model_copy(update={"step_s": e16.time.step_s / speed})})
    e8, e16 = _banded(e8, 0.5, 2.0), _banded(e16, 0.5, 2.0)  # bands wide enough to overlap
    free = Goal(objective="time", tokens=2e9)
    assert free.train_time_s(e16) < free.train_time_s(e8) and free.ties(e16, e8)
    assert rank([e16, e8], free)[0] is e16  # e16 is simpler (ZeRO-0) and fastest
    loose = Goal(objective="time", tokens=2e9, deadline_s=1e9)
    assert loose.meets_deadline(e8) and loose.meets_deadline(e16)
    assert not loose.ties(e8, e16)  # the fewest GPUs that meet the deadline: no tie across GPU counts
    assert rank([e16, e8], loose)[0] is e8
