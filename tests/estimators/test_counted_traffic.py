"""The device time of an eager step from the bytes and FLOPs its profile counted (estimators/counted_traffic.py):
models without a transformer shape pay the counted memory-bound bytes at the fitted factor, 16-bit channels-first
convolutions their layout transposes, fp32 convolutions run at TF32 where the GPU has it, full checkpointing moves
the forward's bytes again, compiled plans take the eager count without the transposes, and uncounted profiles keep the
FLOPs-only constants."""

from __future__ import annotations

import pytest

from optplan.estimators.compute import compute_time
from optplan.estimators.counted_traffic import (
    COMPILED_TRAFFIC_RATIO,
    NCHW_TRANSPOSE_PASSES,
    TRAFFIC_FACTOR,
    counted_step,
    memory_s,
    seconds_per_flop,
    tf32_convolutions,
)
from optplan.estimators.efficiency import efficiency_for
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.profile import EagerStep, ModelProfile
from optplan.estimators.strategy import Strategy
from tests.factories import make_profile

A100, V100 = find_gpu("A100-80GB"), find_gpu("V100")
MB = 1e6
STEPS = {
    "fp32": EagerStep(forward_kernels=230.0, backward_kernels=340.0, memory_bytes_per_sample=560 * MB,
                      memory_bytes_fixed=200 * MB, memory_forward_bytes_per_sample=240 * MB,
                      conv_flops_per_sample=24e9, nchw_conv_bytes_per_sample=220 * MB),
    "amp": EagerStep(forward_kernels=290.0, backward_kernels=400.0, memory_bytes_per_sample=285 * MB,
                     memory_bytes_fixed=100 * MB, memory_forward_bytes_per_sample=120 * MB,
                     conv_flops_per_sample=24e9, nchw_conv_bytes_per_sample=110 * MB),
}


def _conv_net(steps: dict[str, EagerStep] | None = STEPS) -> ModelProfile:
    """A ResNet-50-sized profile without a transformer shape: 8 GFLOP forward, 16 backward per sample."""
    prof = make_profile(params=25_000_000, layers=16, seq=80, tokens=False).model_copy(update={"transformer": None})
    return prof.model_copy(update={"eager_step": steps, "fwd_flops_per_sample": 8.1e9,
                                   "bwd_flops_per_sample": 16.2e9})


def _s(**kw: object) -> Strategy:
    return Strategy(**{"precision": "amp-fp16", "engine": "torch", "optimizer": "sgd", "mbs": 256, **kw})  # type: ignore[arg-type]


def test_the_counted_bytes_at_the_factor_plus_the_layout_transposes_of_16_bit_convolutions() -> None:
    prof, s = _conv_net(), _s()
    step = counted_step(prof, s)
    assert step == STEPS["amp"]
    hbm = A100.memory_bandwidth_bytes_per_s * 0.85
    moved = 285 * MB * 256 + 100 * MB + NCHW_TRANSPOSE_PASSES * 110 * MB * 256
    assert memory_s(step, s, A100, 0.85) == pytest.approx(TRAFFIC_FACTOR * moved / hbm)
    # fp32, its own class's bytes: on CUDA cores (a V100) no transposes; TF32 convolutions (an A100) transpose too
    fp32 = _s(precision="fp32")
    v100_hbm = V100.memory_bandwidth_bytes_per_s * 0.85
    assert memory_s(STEPS["fp32"], fp32, V100, 0.85) == pytest.approx(
        TRAFFIC_FACTOR * (560 * MB * 256 + 200 * MB) / v100_hbm)
    assert memory_s(STEPS["fp32"], fp32, A100, 0.85) == pytest.approx(
        TRAFFIC_FACTOR * (560 * MB * 256 + 200 * MB + NCHW_TRANSPOSE_PASSES * 220 * MB * 256) / hbm)
    # full checkpointing moves the forward's bytes once more
    full = _s(checkpointing="full")
    assert memory_s(step, full, A100, 0.85) - memory_s(step, s, A100, 0.85) == pytest.approx(
        TRAFFIC_FACTOR * 120 * MB * 256 / hbm)


def test_a_compiled_plan_is_priced_from_the_eager_count_without_the_layout_transposes() -> None:
    """Inductor leaves convolutions to cuDNN (same FLOPs, same rate) and runs them channels-last; its element-wise
    kernels move about the eager bytes (COMPILED_TRAFFIC_RATIO): the compiled conv net is not the FLOPs-only
    model's three passes over the saved activations (it priced a compiled ResNet-50 2.2x faster than eager)."""
    prof, eager, compiled = _conv_net(), _s(), _s(compile=True)
    step = counted_step(prof, compiled)
    assert step == counted_step(prof, eager) == STEPS["amp"]
    hbm = A100.memory_bandwidth_bytes_per_s * 0.85
    assert memory_s(step, compiled, A100, 0.85) == pytest.approx(
        COMPILED_TRAFFIC_RATIO * TRAFFIC_FACTOR * (285 * MB * 256 + 100 * MB) / hbm)
    nhwc = STEPS["amp"].model_copy(update={"nchw_conv_bytes_per_sample": 0.0})  # channels-last eager: the same bytes
    assert memory_s(step, compiled, A100, 0.85) == pytest.approx(COMPILED_TRAFFIC_RATIO * memory_s(nhwc, eager, A100,
                                                                                                    0.85))
    eff = efficiency_for(A100)
    kw = {"gemm_peak_fraction": eff.gemm_peak_fraction, "hbm_fraction": eff.hbm_fraction}
    a, b = compute_time(prof, eager, A100, **kw), compute_time(prof, compiled, A100, **kw)
    assert b.compute_s == pytest.approx(a.compute_s, rel=1e-12)  # cuDNN's convolutions either way
    assert a.memory_bound_s / 1.6 < b.memory_bound_s < a.memory_bound_s  # the transposes go, not the bytes
    assert a.compute_s + a.memory_bound_s < 1.5 * (b.compute_s + b.memory_bound_s)  # published: 1.0-1.4x


def test_uncounted_profiles_keep_the_flops_only_constants() -> None:
    assert counted_step(_conv_net(None), _s()) is None
    older = {k: v.model_copy(update={"memory_bytes_per_sample": None}) for k, v in STEPS.items()}
    assert counted_step(_conv_net(older), _s()) is None
    # compute_time without the GPU's GEMM fraction (a caller that does not pass it) keeps the old model too
    old = compute_time(_conv_net(), _s(), A100)
    assert old.memory_bound_s == compute_time(_conv_net(None), _s(), A100).memory_bound_s


def test_fp32_convolutions_run_at_tf32_on_gpus_that_have_it() -> None:
    fp32 = _s(precision="fp32")
    assert tf32_convolutions(fp32, A100) and not tf32_convolutions(fp32, V100)
    assert not tf32_convolutions(_s(), A100)
    prof = _conv_net()

    def fraction(dtype: str) -> float:
        return 0.8

    # every FLOP a convolution's (24e9 of 24.3e9): nearly the TF32 rate on an A100, the fp32 rate on a V100
    a100 = seconds_per_flop(STEPS["fp32"], prof, fp32, A100, fraction)
    conv = 24e9 / prof.train_flops_per_sample
    assert a100 == pytest.approx(conv / (A100.peak_flops_for("tf32") * 0.8)
                                 + (1 - conv) / (A100.peak_flops_for("fp32") * 0.8))
    assert seconds_per_flop(STEPS["fp32"], prof, fp32, V100, fraction) == pytest.approx(
        1 / (V100.peak_flops_for("fp32") * 0.8))


def test_a_memory_bound_16_bit_conv_net_runs_at_the_hbm_rate_not_the_tensor_peak() -> None:
    """ResNet-50 in AMP at 256 a GPU: the A100's step is set by its bytes (DeepLearningExamples measured 104 ms; the
    FLOPs-only constants said 55 ms), and the counted step is about the bandwidth ratio slower on a V100."""
    s = _s()
    a100 = estimate(_conv_net(), Cluster(gpu=A100, gpus=1, gpus_per_node=8), s).time
    v100 = estimate(_conv_net(), Cluster(gpu=V100, gpus=1, gpus_per_node=8), s).time
    assert a100.memory_bound_s > a100.compute_s
    ratio = v100.step_s / a100.step_s
    bandwidth = (A100.memory_bandwidth_bytes_per_s * efficiency_for(A100).hbm_fraction) / (
        V100.memory_bandwidth_bytes_per_s * efficiency_for(V100).hbm_fraction)
    assert 1.0 < ratio < 1.3 * bandwidth
    old = estimate(_conv_net(None), Cluster(gpu=A100, gpus=1, gpus_per_node=8), s).time
    assert a100.step_s > 1.3 * old.step_s
