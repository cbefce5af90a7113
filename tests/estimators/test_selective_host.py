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


def _flops_only(params: int, ops: float | None = 40.0, **kw: int):  # noqa: ANN202 - a ModelProfile
    prof = make_profile(params=params, tokens=False, **kw).model_copy(update={"transformer": None})
    return prof.model_copy(update={"eager_layer_ops": {"fp32": ops, "amp": ops, "bf16": ops}}) if ops else prof


def test_models_without_a_transformer_shape_pay_the_host_floor() -> None:
    """The FLOPs-only model charged no host time at all: the GPU visits measured a 36 MB MLP at 3-7 ms a step where
    its kernels take 0.1-0.3 ms. It now pays one micro-batch's launches and the step's (the transformer path's
    head constants), blended with the device work they overlap."""
    from optplan.estimators.compute import blend_s
    from optplan.estimators.efficiency import efficiency_for

    eff = efficiency_for(H200)
    s = Strategy(precision="fp32", engine="torch", mbs=8, grad_accum=3)
    tiny = estimate(_flops_only(100_000, layers=2, hidden=64, seq=16, act_bytes_per_token_layer=34 * 64),
                    CLUSTER, s).time
    floor = 3 * eff.host_microbatch_s + eff.host_step_s
    device_mb = (tiny.compute_s + tiny.recompute_s + tiny.memory_bound_s) / 3
    assert device_mb < 0.05 * eff.host_microbatch_s  # an MLP-sized model: its kernels are nothing next to it
    assert tiny.host_overhead_s == pytest.approx(
        3 * (blend_s(eff.host_microbatch_s, device_mb, eff.overlap_exponent) - device_mb) + eff.host_step_s,
        rel=1e-9)
    assert tiny.host_overhead_s == pytest.approx(floor, rel=0.05) and tiny.step_s >= floor
    # a large model keeps the GPU busy for longer than the host's launches: they hide behind it
    big = estimate(_flops_only(2_000_000_000), CLUSTER, Strategy(precision="fp32", engine="torch", mbs=8,
                                                                 grad_accum=3)).time
    assert big.host_overhead_s < 0.2 * floor


def test_a_flops_only_model_s_repeated_blocks_pay_the_eager_policy() -> None:
    """A ViT without a transformer shape still has repeated blocks; eager selective checkpointing costs the host per
    operator of each, compiled it does not (the H200 ViT: -81 % before, -57 % after, out of the constant's fit)."""
    many, few = _flops_only(86_000_000, ops=150.0), _flops_only(86_000_000, ops=20.0)
    s = _sel(precision="amp-bf16", mbs=4)
    assert estimate(many, CLUSTER, s).time.step_s > estimate(few, CLUSTER, s).time.step_s
    compiled = s.model_copy(update={"compile": True})
    assert estimate(many, CLUSTER, compiled).time.step_s == pytest.approx(
        estimate(few, CLUSTER, compiled).time.step_s, rel=1e-12)
