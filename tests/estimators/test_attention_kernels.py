"""The engine's attention kernel, measured by sequence length: Megatron-Core on Hopper runs cuDNN fused attention,
torch's SDPA (torch and DeepSpeed plans) FlashAttention-2 (FlashAttention-3's figures), every engine cuDNN on
Blackwell (cudnn-frontend's benchmarks); A100 and other GPUs keep the GPU's fitted fractions, and a measured row can
name the kernel it ran (``fitted``: llm-foundry's MPT Triton kernel)."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from optplan.estimators.attention_kernels import (
    AttentionKernel,
    KernelPoint,
    attention_kernel,
    attention_kernel_table,
    flash_fractions,
)
from optplan.estimators.compute import CAUSAL_FLASH_FRACTION, TransformerDims, efficiency_for, layer_time
from optplan.estimators.hardware import find_gpu, gpu_catalogue
from optplan.estimators.strategy import Strategy

DIMS = TransformerDims(hidden=4096, layers=32, heads=32, kv_heads=8, seq=8192, vocab=128_256,
                       mlp_params=3 * 4096 * 14336, per_layer_params=218_103_808)


def test_table_names_catalogue_gpus_and_cites_a_pinned_source() -> None:
    names = set(gpu_catalogue())
    for kernel in attention_kernel_table().kernels:
        assert set(kernel.gpus) <= names
        assert re.search(r"commit [0-9a-f]{7}|arXiv \d{4}\.\d{4,5}", kernel.source), kernel.source
        assert all(0 < p.forward_fraction <= 1 and 0 < p.backward_fraction <= 1 for p in kernel.points)


@pytest.mark.parametrize("engine,gpu,seq,tflops_fwd,tflops_bwd", [
    # cudnn-frontend's H200 cuDNN 9.19 llama3.1 run (causal): 644 / 541 TFLOP/s at 8k, 591 / 474 at 4k
    ("megatron", "H100-SXM", 8192, 644, 541), ("megatron", "H200", 4096, 591, 474),
    # its B200 cuDNN 9.13 run: 1,171 / 943 TFLOP/s at 8k, 1,419 / 1,109 at 32k
    ("megatron", "B200", 8192, 1171, 943), ("torch", "B200", 32768, 1419, 1109),
])
def test_measured_points_are_the_sources_tflops_over_the_dense_peak(engine: str, gpu: str, seq: int,
                                                                     tflops_fwd: float, tflops_bwd: float) -> None:
    kernel = attention_kernel(engine, gpu)
    assert kernel is not None
    peak_tflops = find_gpu(gpu).peak_flops_for("bf16") / 1e12
    fwd, bwd = kernel.fractions_at(seq)
    assert fwd == pytest.approx(tflops_fwd / peak_tflops, abs=0.001)
    assert bwd == pytest.approx(tflops_bwd / peak_tflops, abs=0.001)


def test_fractions_interpolate_in_log_sequence_and_hold_outside_the_measured_range() -> None:
    kernel = AttentionKernel(name="cudnn", engines=("megatron",), gpus=("H100-SXM",), kernel="k", source="s", points=(
        KernelPoint(seq=2048, forward_fraction=0.2, backward_fraction=0.1),
        KernelPoint(seq=8192, forward_fraction=0.6, backward_fraction=0.5)))
    assert kernel.fractions_at(4096) == pytest.approx((0.4, 0.3))  # halfway in log2 between 2k and 8k
    assert kernel.fractions_at(2048) == pytest.approx((0.2, 0.1))
    assert kernel.fractions_at(512) == pytest.approx((0.2, 0.1))
    assert kernel.fractions_at(1 << 20) == pytest.approx((0.6, 0.5))
    with pytest.raises(ValidationError, match="ascending"):
        AttentionKernel(name="cudnn", engines=("megatron",), gpus=("H100-SXM",), kernel="k", source="s", points=tuple(reversed(
            kernel.points)))


def test_longer_sequences_run_the_measured_kernels_faster_up_to_their_plateau() -> None:
    for kernel in attention_kernel_table().kernels:
        fwd = [kernel.fractions_at(s)[0] for s in (2048, 4096, 8192, 16384)]
        assert fwd == sorted(fwd), kernel.kernel


@pytest.mark.parametrize("engine,gpu,kernel", [
    ("megatron", "H100-SXM", "cudnn"), ("megatron", "H200", "cudnn"), ("torch", "H100-SXM", "flash2"),
    ("deepspeed", "H200", "flash2"), ("megatron", "A100-80GB", None), ("torch", "A100-80GB", None),
    ("megatron", "B200", "cudnn"), ("torch", "B200", "cudnn"), ("deepspeed", "GB200", "cudnn"),
    ("megatron", "GB300", "cudnn"), ("torch", "B300", "cudnn"),
])
def test_who_runs_which_kernel(engine: str, gpu: str, kernel: str | None) -> None:
    fitted = (0.25, 0.15)
    found = attention_kernel(engine, gpu)
    assert (found.name if found else None) == kernel
    assert (flash_fractions(engine, gpu, *fitted, seq=8192) != fitted) is (kernel is not None)


@pytest.mark.parametrize("engine,gpu,name,expected", [
    ("torch", "H100-SXM", "fitted", None),  # llm-foundry's rows: the kernel the fit stands for
    ("torch", "H100-SXM", "cudnn", "cudnn"), ("megatron", "H100-SXM", "flash2", "flash2"),
    ("torch", "B200", "flash2", "flash2"), ("torch", "A100-80GB", "cudnn", None),  # not measured there: the fit
])
def test_a_named_kernel_overrides_the_engines_default(engine: str, gpu: str, name: str, expected: str | None) -> None:
    found = attention_kernel(engine, gpu, name)
    assert (found.name if found else None) == expected
    fitted = (0.25, 0.15)
    got = flash_fractions(engine, gpu, *fitted, seq=8192, kernel=name)
    assert got == (fitted if found is None else found.fractions_at(8192))


def test_flash2_on_blackwell_runs_far_below_cudnn_and_hopper_flash2_below_hopper_cudnn() -> None:
    # the same B200 and torch build (cudnn-frontend 0258951): 373 vs 1,171 TFLOP/s forward at 8k
    b200_fa2 = attention_kernel("torch", "B200", "flash2")
    b200_cudnn = attention_kernel("torch", "B200")
    h100_fa2, h100_cudnn = attention_kernel("torch", "H100-SXM"), attention_kernel("megatron", "H100-SXM")
    assert b200_fa2 and b200_cudnn and h100_fa2 and h100_cudnn
    assert b200_fa2.fractions_at(8192)[0] < 0.35 * b200_cudnn.fractions_at(8192)[0]
    assert h100_fa2.fractions_at(8192)[0] < h100_cudnn.fractions_at(8192)[0]
    assert h100_fa2.fractions_at(8192)[0] == pytest.approx(333 / 989.5, abs=0.001)  # FA3 paper Fig. 5, FA2 causal


def test_megatron_on_hopper_prices_the_core_at_the_kernels_fraction_for_its_sequence() -> None:
    gpu = find_gpu("H100-SXM")
    eff = efficiency_for(gpu)
    peak = gpu.peak_flops_for("bf16")
    cudnn = attention_kernel("megatron", "H100-SXM")
    assert cudnn is not None
    for cp in (1, 2):  # context parallelism: each rank's attention sees s / cp query tokens
        mega = layer_time(DIMS, Strategy(engine="megatron", precision="bf16", mbs=1, cp=cp), gpu, eff)
        frac = cudnn.fractions_at(DIMS.seq / cp)[0]
        assert mega.attention_core_fwd_s == pytest.approx(CAUSAL_FLASH_FRACTION * mega.attention_core_fwd_flops
                                                          / (peak * frac))
    fsdp = layer_time(DIMS, Strategy(engine="torch", precision="bf16", mbs=1), gpu, eff)
    fa2 = attention_kernel("torch", "H100-SXM")
    assert fa2 is not None
    assert fsdp.attention_core_fwd_s == pytest.approx(CAUSAL_FLASH_FRACTION * fsdp.attention_core_fwd_flops
                                                      / (peak * fa2.fractions_at(DIMS.seq)[0]))
    mpt = layer_time(DIMS, Strategy(engine="torch", precision="bf16", mbs=1), gpu, eff, attention_kernel="fitted")
    assert mpt.attention_core_fwd_s == pytest.approx(CAUSAL_FLASH_FRACTION * mpt.attention_core_fwd_flops
                                                     / (peak * eff.flash_attention_fraction))
    a100 = find_gpu("A100-80GB")
    same = [layer_time(DIMS, Strategy(engine=e, precision="bf16", mbs=1), a100, efficiency_for(a100))
            for e in ("megatron", "torch")]
    assert same[0].attention_core_fwd_s == pytest.approx(same[1].attention_core_fwd_s)


def test_blackwell_ultra_attention_is_the_gb300_measurement_faster_than_the_gb200s() -> None:
    """cudnn-frontend's llama3.1 runs at one commit, cuDNN 9.22, the same shapes: the GB300 at 1,856 / 1,435 TFLOP/s
    forward / backward at 8k where the GB200 ran 1,574 / 1,332 (Blackwell Ultra doubles the exponential units);
    the B300, the same die unmeasured, takes the GB300's fractions of its own peak."""
    from optplan.estimators.hardware import find_gpu

    gb300, gb200 = attention_kernel("megatron", "GB300"), attention_kernel("megatron", "GB200")
    assert gb300 is not None and gb200 is not None and gb300 is attention_kernel("torch", "B300")
    fwd300, bwd300 = (f * find_gpu("GB300").peak_flops_for("bf16") for f in gb300.fractions_at(8192))
    fwd200, bwd200 = (f * find_gpu("GB200").peak_flops_for("bf16") for f in gb200.fractions_at(8192))
    assert fwd300 == pytest.approx(1856e12, rel=1e-3) and bwd300 == pytest.approx(1435e12, rel=1e-3)
    assert fwd300 / fwd200 == pytest.approx(1856 / 1574, rel=2e-3) and bwd300 > bwd200

