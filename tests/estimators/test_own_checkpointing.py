"""A model that checkpoints itself (estimators/own_checkpointing.py): its re-run forward is recompute time and
hardware FLOPs in every plan that runs the model file, never model FLOPs; Megatron builds its own model."""

from __future__ import annotations

import pytest

from optplan.estimators.compute import compute_time
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.own_checkpointing import own_recompute_flops_per_sample, own_recompute_layer_share
from optplan.estimators.strategy import Strategy
from tests.factories import make_profile

H100 = find_gpu("H100-SXM")
CLUSTER = Cluster(gpu=H100, gpus=1, gpus_per_node=1)


def _self_checkpointed(profile, share: float):
    """``profile`` as if its forward checkpointed ``share`` of itself: the backward counts that much more."""
    own = share * profile.fwd_flops_per_sample
    return profile.model_copy(update={"bwd_flops_per_sample": profile.bwd_flops_per_sample + own,
                                      "self_recompute_flops_per_sample": own})


@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
def test_a_transformer_that_checkpoints_itself_pays_the_recompute_outside_mfu(engine: str) -> None:
    plain = make_profile()
    own = _self_checkpointed(plain, 0.6)
    s = Strategy(precision="bf16", engine=engine, mbs=4)
    a, b = estimate(plain, CLUSTER, s).time, estimate(own, CLUSTER, s).time
    assert a.recompute_s == 0 and b.recompute_s > 0
    assert b.compute_s == pytest.approx(a.compute_s, rel=1e-12)  # the model's FLOPs are the same
    assert b.step_s > a.step_s
    # model FLOPs per sample are the plain model's: MFU falls with the longer step, HFU counts the re-run forward
    assert b.mfu == pytest.approx(a.mfu * a.step_s / b.step_s, rel=1e-9)
    hardware = plain.train_flops_per_sample + own.self_recompute_flops_per_sample
    assert b.hfu / b.mfu == pytest.approx(hardware / plain.train_flops_per_sample, rel=1e-9)
    # the re-run is the share of the layers' forward GEMMs full checkpointing prices, not more
    full = estimate(plain, CLUSTER, s.model_copy(update={"checkpointing": "full"})).time
    assert 0 < b.recompute_s < full.recompute_s
    # under the plan's own full checkpointing the two nest: both re-run
    both = estimate(own, CLUSTER, s.model_copy(update={"checkpointing": "full"})).time
    assert both.recompute_s == pytest.approx(full.recompute_s + b.recompute_s, rel=1e-9)


def test_megatron_runs_its_own_model_so_the_files_checkpointing_is_not_priced() -> None:
    own = _self_checkpointed(make_profile(), 1.0)
    s = Strategy(precision="bf16", engine="megatron", mbs=4)
    assert own_recompute_flops_per_sample(own, s) == 0
    assert estimate(own, CLUSTER, s).time.recompute_s == 0


def test_the_layer_share_spreads_the_recompute_over_layers_and_ranks_and_is_capped() -> None:
    own = _self_checkpointed(make_profile(), 0.5)
    s = Strategy(precision="bf16", engine="torch", mbs=2, tp=2)
    per_layer = own.self_recompute_flops_per_sample * 2 / (12 * 2)
    assert own_recompute_layer_share(own, s, layers=12, layer_fwd_flops=4 * per_layer) == pytest.approx(0.25)
    assert own_recompute_layer_share(own, s, layers=12, layer_fwd_flops=per_layer / 3) == 1.0
    assert own_recompute_layer_share(make_profile(), s, layers=12, layer_fwd_flops=per_layer) == 0.0


def test_the_flops_only_model_prices_the_re_run_as_recompute() -> None:
    plain = make_profile(tokens=False).model_copy(update={"transformer": None})
    own = _self_checkpointed(plain, 0.5)
    s = Strategy(precision="bf16", engine="torch", mbs=2, grad_accum=3)
    a, b = compute_time(plain, s, H100), compute_time(own, s, H100)
    assert a.recompute_s == 0 and b.compute_s == pytest.approx(a.compute_s, rel=1e-12)
    assert b.recompute_s == pytest.approx(a.compute_s * own.self_recompute_flops_per_sample
                                          / plain.train_flops_per_sample, rel=1e-9)
    assert b.recompute_flops_per_sample == own.self_recompute_flops_per_sample
    t = estimate(own, CLUSTER, s).time
    assert t.hfu / t.mfu == pytest.approx(own.step_flops_per_sample / own.train_flops_per_sample, rel=1e-9)
