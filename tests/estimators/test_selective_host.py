"""The host cost of eager op-level selective checkpointing (estimators/selective_host.py): per operator and
dispatch-mode crossing of one block's forward, on the torch and DeepSpeed engines in eager mode only; where the
host paces the step (small micro-batches), the step pays it, and more operators cost more."""

from __future__ import annotations

import pytest

from optplan.estimators.compute import SELECTIVE_HOST_PASSES
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.selective_host import (
    DEFAULT_LAYER_OPS,
    SAC_OP_HOST_S,
    layer_ops,
    selective_host_layer_s,
)
from optplan.estimators.strategy import Strategy
from tests.factories import make_profile

H200 = find_gpu("H200")
CLUSTER = Cluster(gpu=H200, gpus=1, gpus_per_node=1)


def _sel(**kw: object) -> Strategy:
    return Strategy(**{"precision": "bf16", "engine": "torch", "mbs": 1, "checkpointing": "selective", **kw})  # type: ignore[arg-type]


def test_the_eager_policy_pays_a_replayed_forward_and_two_crossings_per_operator() -> None:
    profile = make_profile().model_copy(update={"eager_layer_ops": {"fp32": 70.0, "amp": 90.0, "bf16": 80.0}})
    s = _sel()
    assert layer_ops(profile, s) == 80.0  # bf16 weights: the bf16 class
    assert layer_ops(profile, _sel(precision="amp-bf16")) == 90.0  # autocast: its casts counted
    assert layer_ops(profile, _sel(precision="fp32")) == 70.0
    expected = (1 - SELECTIVE_HOST_PASSES) * 1e-3 + 2 * 80.0 * SAC_OP_HOST_S
    assert selective_host_layer_s(profile, s, 1e-3) == pytest.approx(expected, rel=1e-12)
    assert selective_host_layer_s(profile, _sel(engine="deepspeed"), 1e-3) == pytest.approx(expected, rel=1e-12)
    # none of it where the policy does not run eagerly: compiled, Megatron's selective, other checkpointing
    assert selective_host_layer_s(profile, _sel(compile=True), 1e-3) == 0.0
    assert selective_host_layer_s(profile, _sel(engine="megatron"), 1e-3) == 0.0
    for ckpt in ("none", "full"):
        assert selective_host_layer_s(profile, _sel(checkpointing=ckpt), 1e-3) == 0.0
    # a profile without a count (an --arch shape, an older profile) takes the stated default
    assert layer_ops(make_profile(), s) == DEFAULT_LAYER_OPS


def test_a_host_paced_step_pays_it_and_a_device_paced_one_hides_it() -> None:
    few = make_profile().model_copy(update={"eager_layer_ops": {"bf16": 30.0, "amp": 30.0, "fp32": 30.0}})
    many = few.model_copy(update={"eager_layer_ops": {"bf16": 150.0, "amp": 150.0, "fp32": 150.0}})

    def step(profile: object, **kw: object) -> float:
        return estimate(profile, CLUSTER, _sel(**kw)).time.step_s  # type: ignore[arg-type]

    # micro-batch 1 of a GPT-2-sized model: the host paces the step, so operators cost time
    assert step(many) > step(few) * 1.3
    # compiled, the policy is traced once: the operator count no longer matters
    assert step(many, compile=True) == pytest.approx(step(few, compile=True), rel=1e-12)
    # eager selective now costs more than full checkpointing on this host-paced step (as the H200 measured)
    full = estimate(many, CLUSTER, _sel(checkpointing="full")).time.step_s
    assert step(many) > full
    # a large micro-batch keeps the GPU busier than the host: the same operators cost a far smaller share
    big_few, big_many = step(few, mbs=32), step(many, mbs=32)
    assert (big_many - big_few) / big_few < (step(many) - step(few)) / step(few)
