"""DualPipe (``Strategy.pp_schedule = "dualpipe"``): its bubble, pairing and stages by hand, what a rank holds, the
all-to-all its paired chunks hide, and its rules (its export refusal and CLI flag: tests/planner/test_dualpipe_plans.py)."""

from __future__ import annotations

import pytest

from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.memory import memory_breakdown
from optplan.estimators.params_placement import one_stage_params, stage_params
from optplan.estimators.pipeline import (
    dualpipe_bubble_s,
    dualpipe_solo_fraction,
    dualpipe_stages,
    dualpipe_time_s,
    pipeline_time_s,
)
from optplan.estimators.strategy import Strategy
from tests.factories import dualpipe_moe_plan


def _profile():  # type: ignore[no-untyped-def]
    return dualpipe_moe_plan()[0]


def _cluster() -> Cluster:
    return dualpipe_moe_plan()[1]


def _s(**kw: object) -> Strategy:
    return dualpipe_moe_plan(**kw)[2]


def test_bubble_pairing_and_stages_by_hand() -> None:
    # (p/2 - 1)(F&B + B - 3W) with F&B = F + B = t, B = 2F, W = F: (p/2 - 1) x 2t/3
    assert dualpipe_bubble_s(16, 3.0) == pytest.approx(7 * (3.0 + 2.0 - 3 * 1.0))
    assert dualpipe_bubble_s(2, 3.0) == 0.0
    assert dualpipe_stages(8, 0) == (0, 7) and dualpipe_stages(8, 3) == (3, 4)
    # rank r runs half its micro-batches through stage r and half through p - 1 - r: the ends pair up
    t = dualpipe_time_s([4.0, 1.0, 1.0, 2.0], microbatches=8)
    assert t.bottleneck_s == pytest.approx(3.0) and t.bubble_s == pytest.approx(1 * 2.0)
    assert t.total_s == pytest.approx(8 * 3.0 + 2.0)
    one_f_one_b = pipeline_time_s([4.0, 1.0, 1.0, 2.0], 8)
    assert t.total_s < one_f_one_b.total_s  # 8 x 4 + 4 = 36 s under 1F1B
    # dualpipe.py's first rank pairs m - 1.5p + 1 of its m forward chunks
    assert dualpipe_solo_fraction(16, 120) == pytest.approx(23 / 120)
    assert dualpipe_solo_fraction(4, 8) == pytest.approx(5 / 8)


def test_a_rank_holds_two_stages_and_p_plus_one_micro_batches() -> None:
    prof, s = _profile(), _s()
    plain = s.model_copy(update={"pp_schedule": "1f1b"})
    assert stage_params(prof, s, 0) == pytest.approx(stage_params(prof, plain, 0) + stage_params(prof, plain, 3))
    assert stage_params(prof, s, 1) == pytest.approx(2 * one_stage_params(prof, s, 1))
    dual = memory_breakdown(prof, s, 80 * 2**30)
    first = memory_breakdown(prof, plain, 80 * 2**30)
    # weights of stage 0 and stage 3 on one rank (2x a 1F1B rank's, DeepSeek-V3 Table 2)
    assert dual.params_bytes == pytest.approx(first.params_bytes * stage_params(prof, s, 0)
                                              / stage_params(prof, plain, 0), rel=1e-6)
    assert "DualPipe rank 0 of 4" in dual.rank and "5 chunk-micro-batches in flight" in dual.rank
    assert dual.activations_bytes > first.activations_bytes  # p + 1 = 5 against 1F1B's 4, and both ends


def test_paired_chunks_hide_the_all_to_all_and_shrink_the_bubble() -> None:
    prof, cluster = _profile(), _cluster()
    dual = estimate(prof, cluster, _s(grad_accum=32))
    plain = estimate(prof, cluster, _s(grad_accum=32, pp_schedule="1f1b"))
    assert 0 < dual.time.ep_comm_s < plain.time.ep_comm_s
    assert dual.time.pp_comm_s < plain.time.pp_comm_s
    assert dual.time.bubble_s < plain.time.bubble_s
    assert dual.time.step_s < plain.time.step_s
    assert any("DualPipe" in why for why in dual.time.outside_measured)  # rests on one published run: said


@pytest.mark.parametrize(("kw", "needle"), [
    ({"pp": 3, "dp": 16}, "even and >= 2"),
    ({"vpp": 2}, "not interleaved"),
    ({"grad_accum": 6}, "at least 2 x --pp = 8"),
    ({"grad_accum": 9}, "even number of micro-batches"),
    ({"ep_overlap": True, "vpp": 1}, "drop --ep-overlap"),
    ({"engine": "torch", "ep": 1, "zero": 0}, "--engine megatron"),
])
def test_rules_are_one_line_each(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("+", r"\+")):
        _s(**kw)
