"""Megatron's batch-level expert-parallel all-to-all overlap: what it hides, its rules, and its price."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.ep_overlap import EP_OVERLAP_INTERFERENCE, overlapped_a2a_s, solo_fraction
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from optplan.estimators.timing import step_time

MOE_ARCH = "layers=16,hidden=4096,heads=32,kv_heads=8,seq=4096,experts=64,topk=8,moe_ffn=1536"


def test_solo_fraction_follows_the_schedule():
    assert solo_fraction(1, 1, 1) == 1.0  # one micro-batch: nothing to pair with
    assert solo_fraction(1, 1, 8) == pytest.approx(1 / 8)  # F1 and B8 alone
    # pp 8 x vpp 4, 128 micro-batches: the first rank's warm-up 2*7 + 3*8 = 38 of 512 chunk passes
    assert solo_fraction(8, 4, 128) == pytest.approx(38 / 512)
    assert solo_fraction(8, 2, 4) == 1.0  # warm-up longer than the step: capped


def test_overlap_exposes_only_the_excess_and_the_interference():
    # windows larger than the all-to-alls: only the SMs' share of it stays
    assert overlapped_a2a_s(1.0, 1.0, 5.0, 5.0, 0.0) == pytest.approx(2 * EP_OVERLAP_INTERFERENCE)
    # the backward all-to-all exceeds the forward window by 0.5
    hidden = 2.0 - 0.5
    assert overlapped_a2a_s(1.0, 1.0, 0.5, 5.0, 0.0) == pytest.approx(0.5 + EP_OVERLAP_INTERFERENCE * hidden)
    # solo passes expose everything; never more than the all-to-alls themselves
    assert overlapped_a2a_s(1.0, 1.0, 5.0, 5.0, 1.0) == pytest.approx(2.0)
    assert overlapped_a2a_s(3.0, 3.0, 0.1, 0.1, 0.3) <= 6.0


@pytest.mark.parametrize("change, match", [
    (dict(ep=1), "--ep > 1"),
    (dict(checkpointing="full"), "full recomputation"),
    (dict(precision="fp32"), "bf16 or fp16"),
    (dict(pp=2, dp=4, vpp=1, grad_accum=8), "virtual pipeline stages"),
])
def test_megatron_rules(change, match):
    base = dict(engine="megatron", ep=8, dp=8, ep_overlap=True, grad_accum=4)
    with pytest.raises(ValueError, match=match):
        Strategy(**{**base, **change})


def test_overlap_shortens_the_step_and_keeps_the_total_traffic():
    profile = profile_from_arch(parse_arch(MOE_ARCH))
    cluster = Cluster(gpu=find_gpu("H100"), gpus=16, gpus_per_node=8)
    plain = Strategy(engine="megatron", ep=16, dp=16, grad_accum=8)
    over = Strategy(**{**plain.model_dump(), "ep_overlap": True})
    t0, t1 = step_time(profile, plain, cluster), step_time(profile, over, cluster)
    assert t0.ep_comm_s > 0
    assert t1.ep_comm_s < t0.ep_comm_s  # exposed all-to-all shrinks
    # the step shrinks by the hidden time (to the host blend's rounding: the layer's device time is blended with
    # the host's, timing.blend_s)
    assert t1.step_s < t0.step_s
    assert t1.step_s == pytest.approx(t0.step_s - (t0.ep_comm_s - t1.ep_comm_s), rel=1e-3)
    assert t1.comm_s == pytest.approx(t0.comm_s)  # the traffic itself is the same
    # never below the solo passes' share
    assert t1.ep_comm_s >= solo_fraction(1, 1, 8) * t0.ep_comm_s


def test_recipe_rule_is_the_strategy_rule():
    """The search's pre-check and Strategy's validator are one rule (estimators/ep_overlap.py)."""
    from optplan.estimators.ep_overlap import recipe_allows_overlap

    for precision in ("fp32", "bf16", "fp16", "fp8", "amp-bf16"):
        for ckpt in ("none", "selective", "full"):
            try:
                Strategy(engine="megatron", ep=8, dp=8, ep_overlap=True, precision=precision, checkpointing=ckpt)
                ok = True
            except ValueError:
                ok = False
            assert ok == recipe_allows_overlap(precision, ckpt), (precision, ckpt)
