"""The engine's attention kernel against the fitted flash fractions: Megatron-Core on Hopper (cuDNN fused attention,
FlashAttention-3's Fig. 5-6) runs the attention core 1.6x faster; other engines and GPUs keep the fit."""

from __future__ import annotations

import pytest

from optplan.estimators.attention_kernels import attention_kernel, attention_kernel_table, flash_speedups
from optplan.estimators.compute import TransformerDims, efficiency_for, layer_time
from optplan.estimators.hardware import find_gpu, gpu_catalogue
from optplan.estimators.strategy import Strategy

DIMS = TransformerDims(hidden=4096, layers=32, heads=32, kv_heads=8, seq=8192, vocab=128_256,
                       mlp_params=3 * 4096 * 14336, per_layer_params=218_103_808)


def test_table_names_catalogue_gpus_and_cites_its_source() -> None:
    names = set(gpu_catalogue())
    for kernel in attention_kernel_table().kernels:
        assert set(kernel.gpus) <= names and "arXiv" in kernel.source
        assert 1.0 < kernel.forward_speedup < 2.0 and 1.0 < kernel.backward_speedup < 2.0


@pytest.mark.parametrize("engine,gpu,expected", [
    ("megatron", "H100-SXM", (1.6, 1.6)), ("megatron", "H200", (1.6, 1.6)),
    ("torch", "H100-SXM", (1.0, 1.0)), ("deepspeed", "H100-SXM", (1.0, 1.0)),
    ("megatron", "A100-80GB", (1.0, 1.0)), ("megatron", "B200", (1.0, 1.0)),
])
def test_speedups(engine: str, gpu: str, expected: tuple[float, float]) -> None:
    assert flash_speedups(engine, gpu) == expected
    assert (attention_kernel(engine, gpu) is None) is (expected == (1.0, 1.0))


def test_megatron_on_hopper_runs_the_attention_core_faster() -> None:
    gpu = find_gpu("H100-SXM")
    eff = efficiency_for(gpu)
    mega = layer_time(DIMS, Strategy(engine="megatron", precision="bf16", mbs=1), gpu, eff)
    fsdp = layer_time(DIMS, Strategy(engine="torch", precision="bf16", mbs=1), gpu, eff)
    # flash: the core has no elementwise part, so its forward time is the kernel's alone
    assert fsdp.attention_core_fwd_s / mega.attention_core_fwd_s == pytest.approx(1.6)
    assert mega.attention_core_fwd_flops == fsdp.attention_core_fwd_flops
    a100 = find_gpu("A100-80GB")
    same = [layer_time(DIMS, Strategy(engine=e, precision="bf16", mbs=1), a100, efficiency_for(a100))
            for e in ("megatron", "torch")]
    assert same[0].attention_core_fwd_s == pytest.approx(same[1].attention_core_fwd_s)
