"""The host time of an eager step from the kernels it launches (estimators/eager_host.py): models without a
transformer shape whose profile counted its kernels pay per kernel in the strategy's precision class, full
checkpointing replays the blocks' kernels, and where the host paces the step (a small ResNet-like micro-batch) the
step takes about kernels x the per-kernel time."""

from __future__ import annotations

import pytest

from optplan.estimators.eager_host import (
    HOST_KERNEL_S,
    eager_microbatch_host_s,
    layer_host_s,
    microbatch_host_s,
    microbatch_kernels,
    step_kernels,
)
from optplan.estimators.efficiency import efficiency_for
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.profile import EagerStep, ModelProfile
from optplan.estimators.strategy import Strategy
from tests.factories import make_profile

H200 = find_gpu("H200")
CLUSTER = Cluster(gpu=H200, gpus=1, gpus_per_node=1)
KERNELS = {"fp32": EagerStep(forward_kernels=230.0, backward_kernels=340.0, block_forward_kernels=14.0),
           "amp": EagerStep(forward_kernels=290.0, backward_kernels=400.0, block_forward_kernels=17.0)}


def _conv_net(kernels: dict[str, EagerStep] | None = KERNELS, params: int = 25_000_000) -> ModelProfile:
    """A ResNet-50-sized profile without a transformer shape (16 repeated blocks), with or without kernel counts."""
    prof = make_profile(params=params, layers=16, seq=80, tokens=False).model_copy(update={"transformer": None})
    return prof.model_copy(update={"eager_step": kernels})


def _s(**kw: object) -> Strategy:
    return Strategy(**{"precision": "fp32", "engine": "torch", "mbs": 32, **kw})  # type: ignore[arg-type]


def test_the_count_follows_the_precision_class_checkpointing_and_stages() -> None:
    prof = _conv_net()
    assert step_kernels(prof, _s()) == KERNELS["fp32"]
    assert step_kernels(prof, _s(precision="amp-bf16")) == KERNELS["amp"]  # autocast's casts are its own
    # a class not counted takes the nearest one counted: bf16 weights -> autocast's (amp first)
    assert step_kernels(prof, _s(precision="bf16")) == KERNELS["amp"]
    assert microbatch_kernels(prof, _s()) == 230 + 340
    assert microbatch_kernels(prof, _s(checkpointing="full")) == 230 + 340 + 16 * 14  # every block replayed
    assert microbatch_kernels(prof, _s(pp=2)) == pytest.approx((230 + 340) / 2)  # a stage's share
    assert eager_microbatch_host_s(prof, _s(), 20e-6) == pytest.approx(570 * 20e-6)
    # compiled (fused kernels) or uncounted (an --arch shape, an older profile): the caller keeps its constant
    assert eager_microbatch_host_s(prof, _s(compile=True), 20e-6) is None
    assert step_kernels(_conv_net(None), _s()) is None and eager_microbatch_host_s(_conv_net(None), _s(), 1e-5) is None


def test_a_host_paced_step_takes_its_kernels_and_the_device_hides_them_when_longer() -> None:
    """ResNet-50 at micro-batch 32 in 16-bit on an H200: the GPU's work is a few ms, its ~700 kernels take the host
    ~18 ms (the H200 visits measured 17.4 ms, where the fixed per-micro-batch constant predicted 3.5 ms)."""
    eff = efficiency_for(H200)
    assert eff.host_kernel_s == HOST_KERNEL_S
    amp = _s(precision="amp-bf16")
    counted = estimate(_conv_net(), CLUSTER, amp).time
    fixed = estimate(_conv_net(None), CLUSTER, amp).time
    host = (290 + 400) * HOST_KERNEL_S
    assert counted.step_s >= host  # the host paces it: at least every kernel issued
    assert counted.step_s > 2 * fixed.step_s and counted.host_overhead_s > fixed.host_overhead_s
    # more kernels, more time, where the host paces the step
    more = {k: v.model_copy(update={"forward_kernels": 2 * v.forward_kernels}) for k, v in KERNELS.items()}
    assert estimate(_conv_net(more), CLUSTER, amp).time.step_s > counted.step_s * 1.2
    # a 100x larger model at a large micro-batch keeps the GPU busier than the host: the kernels are mostly hidden
    big = _s(precision="amp-bf16", mbs=256)
    heavy, heavy_more = (estimate(_conv_net(k, params=2_500_000_000), CLUSTER, big).time.step_s for k in (KERNELS, more))
    assert (heavy_more - heavy) / heavy < 0.05


def test_compiled_steps_keep_the_fixed_constant() -> None:
    s = _s(precision="amp-bf16", compile=True)
    assert estimate(_conv_net(), CLUSTER, s).time.step_s == pytest.approx(
        estimate(_conv_net(None), CLUSTER, s).time.step_s, rel=1e-12)


def test_a_compiled_step_never_pays_more_host_time_than_its_eager_count() -> None:
    """torch.compile fuses kernels and launches the rest from Inductor's wrapper: the fitted constants apply, bounded
    by the eager count of the same step (GPT-2 small at micro-batch 8 measured 36.6 ms compiled, 36.9 ms eager, where
    the constants alone priced its host 3.4x the eager count's)."""
    few = {k: v.model_copy(update={"forward_kernels": 4.0, "backward_kernels": 6.0}) for k, v in KERNELS.items()}
    kw = {"host_kernel_s": 25e-6, "checkpoint_block_s": 0.0, "microbatch_s": 3e-3}
    compiled = _s(precision="amp-bf16", compile=True)
    assert microbatch_host_s(_conv_net(few), compiled, **kw) == pytest.approx(10 * 25e-6)  # the eager count, lower
    assert microbatch_host_s(_conv_net(), compiled, **kw) == pytest.approx(3e-3)  # the constant, lower
    assert microbatch_host_s(_conv_net(None), compiled, **kw) == pytest.approx(3e-3)  # nothing counted
    assert microbatch_host_s(_conv_net(few), _s(precision="amp-bf16"), **kw) == pytest.approx(10 * 25e-6)  # eager
    # a transformer's layers: the constants per layer pass and micro-batch, or the eager count spread over the layers
    layer = {**kw, "constant_layer_s": 1e-3, "host_multiplier": 2.0, "layers_per_stage": 16.0, "eager_engine": True}
    assert layer_host_s(_conv_net(few), compiled, **layer) == pytest.approx((2.0 * 10 * 25e-6 / 16, 0.0))
    assert layer_host_s(_conv_net(), compiled, **layer) == pytest.approx((1e-3, 2.0 * 3e-3))
    assert layer_host_s(_conv_net(few), compiled, **{**layer, "eager_engine": False}) == pytest.approx((1e-3, 6e-3))
    assert layer_host_s(_conv_net(few), _s(precision="amp-bf16"), **layer) == pytest.approx((2.0 * 10 * 25e-6 / 16, 0.0))


def test_full_checkpointing_adds_its_own_host_time_per_block() -> None:
    """torch.utils.checkpoint's hooks and RNG stash per block are host work beyond the replayed kernels."""
    prof = _conv_net()
    plain = eager_microbatch_host_s(prof, _s(checkpointing="full"), 20e-6)
    assert plain == pytest.approx((570 + 16 * 14) * 20e-6)
    assert eager_microbatch_host_s(prof, _s(checkpointing="full"), 20e-6, 1e-3) == pytest.approx(plain + 16 * 1e-3)
    assert eager_microbatch_host_s(prof, _s(checkpointing="full", pp=2), 20e-6, 1e-3) == pytest.approx(
        (plain + 16 * 1e-3) / 2)
    assert eager_microbatch_host_s(prof, _s(), 20e-6, 1e-3) == pytest.approx(570 * 20e-6)  # no checkpointing: none


def test_a_transformer_run_eagerly_pays_its_counted_kernels_and_megatron_its_constants() -> None:
    """GPT-2 small's step counts 515 kernels a micro-batch in bf16: the host time follows them under torch (the
    H200 measured 23.6 ms at micro-batch 4 where the per-layer-pass constants priced 38 ms); Megatron's step is not
    the model file's, so it keeps the constants."""
    from tests.factories import make_profile

    step = EagerStep(forward_kernels=129.0, backward_kernels=386.0, block_forward_kernels=10.0)
    prof = make_profile().model_copy(update={"eager_step": {"bf16": step, "amp": step, "fp32": step}})
    s = Strategy(precision="bf16", engine="torch", mbs=1)
    counted, fixed = estimate(prof, CLUSTER, s).time, estimate(prof.model_copy(update={"eager_step": None}), CLUSTER, s).time
    assert counted.host_overhead_s != pytest.approx(fixed.host_overhead_s, rel=1e-3)
    more = prof.model_copy(update={"eager_step": {k: step.model_copy(update={"backward_kernels": 2 * 386.0})
                                                  for k in ("bf16", "amp", "fp32")}})
    assert estimate(more, CLUSTER, s).time.step_s > counted.step_s  # host-paced at micro-batch 1: more kernels, slower
    mega = Strategy(precision="bf16", engine="megatron", mbs=1)
    assert estimate(prof, CLUSTER, mega).time.step_s == pytest.approx(
        estimate(prof.model_copy(update={"eager_step": None}), CLUSTER, mega).time.step_s, rel=1e-12)
