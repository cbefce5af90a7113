"""Pipeline schedules: 1F1B and interleaved bubbles (Narayanan et al. 2021 §2.2), unequal stages, the
micro-batches in flight, and the pipeline terms of a whole estimate."""

from __future__ import annotations

import pytest
from conftest import make_gpu, make_profile

from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.pipeline import bubble_fraction, in_flight_microbatches, pipeline_time_s
from optplan.estimators.strategy import Strategy


def test_bubble_fraction_1f1b_and_interleaved() -> None:
    assert bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 16)
    assert bubble_fraction(1, 8) == 0.0


def test_equal_stages_take_m_plus_p_minus_1_stage_times() -> None:
    t, p, m = 0.010, 4, 8
    pipe = pipeline_time_s([t] * p, m)
    assert pipe.total_s == pytest.approx((m + p - 1) * t)
    assert pipe.bubble_s == pytest.approx((p - 1) * t)
    assert pipe.bubble_s / (m * t) == pytest.approx(bubble_fraction(p, m))
    inter = pipeline_time_s([t] * p, m, vpp=3)
    assert inter.bubble_s == pytest.approx((p - 1) * t / 3)
    assert inter.total_s == pytest.approx(m * t + (p - 1) * t / 3)


def test_unequal_stages_slowest_sets_the_steady_state() -> None:
    pipe = pipeline_time_s([0.010, 0.010, 0.016], 8)
    assert pipe.bottleneck_s == pytest.approx(0.016)
    assert pipe.total_s == pytest.approx(8 * 0.016 + 0.020)
    assert pipeline_time_s([0.02], 5).bubble_s == 0.0


def test_in_flight_microbatches() -> None:
    assert [in_flight_microbatches(4, i, 8) for i in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches(4, 0, 2) == 2  # fewer micro-batches than stages
    # interleaved, Megatron's warm-up: (p - i - 1)·2 + (v - 1)·p chunks, plus the one in flight
    assert in_flight_microbatches(4, 0, 8, 2) == pytest.approx((3 * 2 + 4 + 1) / 2)
    assert in_flight_microbatches(1, 0, 8) == 1.0


def _estimate(**kw: int):  # noqa: ANN202 - an Estimate
    prof = make_profile(layers=24, hidden=1024)  # no vocabulary: stages differ only by the embedding share
    cluster = Cluster(gpu=make_gpu(), gpus=8, gpus_per_node=8)
    return estimate(prof, cluster, Strategy(precision="bf16", mbs=2, **kw))


def test_estimate_bubble_follows_the_schedule() -> None:
    m, p = 8, 4
    one = _estimate(pp=p, grad_accum=m)
    t = one.time
    assert t.bubble_s > 0 and t.pp_comm_s > 0
    # the stage time per micro-batch from two step lengths; bubble / (m · t_stage) = (p-1)/m for
    # (nearly) equal stages, and the bubble does not depend on m
    double = _estimate(pp=p, grad_accum=2 * m).time
    stage_s = (double.step_s - t.step_s) / m
    assert double.bubble_s == pytest.approx(t.bubble_s)
    assert t.bubble_s / (m * stage_s) == pytest.approx(bubble_fraction(p, m), rel=0.05)
    inter = _estimate(pp=p, vpp=2, grad_accum=m).time
    assert inter.bubble_s == pytest.approx(t.bubble_s / 2, rel=0.05)
    assert inter.pp_comm_s == pytest.approx(2 * t.pp_comm_s)
    assert inter.step_s < t.step_s
    flat = _estimate(grad_accum=m).time
    assert flat.bubble_s == 0.0 and flat.pp_comm_s == 0.0


def test_more_microbatches_shrink_the_bubble_share() -> None:
    few = _estimate(pp=4, grad_accum=4).time
    many = _estimate(pp=4, grad_accum=32).time
    assert many.bubble_s / many.step_s < few.bubble_s / few.step_s
