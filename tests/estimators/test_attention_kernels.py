"""The engine's attention kernel where it is not the fit's: Megatron-Core on Hopper runs cuDNN fused attention at its
measured fractions of peak (FlashAttention-3's Fig. 5-6); other engines and GPUs keep the GPU's fitted fractions."""

from __future__ import annotations

import pytest

from optplan.estimators.attention_kernels import attention_kernel, attention_kernel_table, flash_fractions
from optplan.estimators.compute import CAUSAL_FLASH_FRACTION, TransformerDims, efficiency_for, layer_time
from optplan.estimators.hardware import find_gpu, gpu_catalogue
from optplan.estimators.strategy import Strategy

DIMS = TransformerDims(hidden=4096, layers=32, heads=32, kv_heads=8, seq=8192, vocab=128_256,
                       mlp_params=3 * 4096 * 14336, per_layer_params=218_103_808)


def test_table_names_catalogue_gpus_and_cites_its_source() -> None:
    names = set(gpu_catalogue())
    for kernel in attention_kernel_table().kernels:
        assert set(kernel.gpus) <= names and "arXiv" in kernel.source
    cudnn = attention_kernel("megatron", "H100-SXM")
    assert cudnn is not None and (cudnn.forward_fraction, cudnn.backward_fraction) == (0.52, 0.50)
    # FlashAttention-3's Fig. 5-6: cuDNN at 4k, 518 (causal forward) and 499 (backward) TFLOP/s of 989.5
    assert cudnn.forward_fraction == pytest.approx(518 / 989.5, abs=0.01)
    assert cudnn.backward_fraction == pytest.approx(499 / 989.5, abs=0.01)


@pytest.mark.parametrize("engine,gpu,kernel", [
    ("megatron", "H100-SXM", True), ("megatron", "H200", True), ("torch", "H100-SXM", False),
    ("deepspeed", "H100-SXM", False), ("megatron", "A100-80GB", False), ("megatron", "B200", False),
])
def test_who_runs_which_kernel(engine: str, gpu: str, kernel: bool) -> None:
    fitted = (0.25, 0.15)
    assert (flash_fractions(engine, gpu, *fitted) != fitted) is kernel
    assert (attention_kernel(engine, gpu) is not None) is kernel


def test_megatron_on_hopper_prices_the_core_at_the_kernel_fractions() -> None:
    gpu = find_gpu("H100-SXM")
    eff = efficiency_for(gpu)
    mega = layer_time(DIMS, Strategy(engine="megatron", precision="bf16", mbs=1), gpu, eff)
    fsdp = layer_time(DIMS, Strategy(engine="torch", precision="bf16", mbs=1), gpu, eff)
    peak = gpu.peak_flops_for("bf16")
    # flash: the core's forward time is the kernel's alone, causal FLOPs halved
    assert mega.attention_core_fwd_s == pytest.approx(CAUSAL_FLASH_FRACTION * mega.attention_core_fwd_flops
                                                      / (peak * 0.52))
    assert fsdp.attention_core_fwd_s == pytest.approx(CAUSAL_FLASH_FRACTION * fsdp.attention_core_fwd_flops
                                                      / (peak * eff.flash_attention_fraction))
    a100 = find_gpu("A100-80GB")
    same = [layer_time(DIMS, Strategy(engine=e, precision="bf16", mbs=1), a100, efficiency_for(a100))
            for e in ("megatron", "torch")]
    assert same[0].attention_core_fwd_s == pytest.approx(same[1].attention_core_fwd_s)
