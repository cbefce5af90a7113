"""estimators/fp8_backend.py: Megatron's and DeepSpeed's fp8 is Transformer Engine's (fp8 W and W^T cached through
the step, fp8 GEMM inputs saved); the torch engine runs torchao's Float8Linear (optplan's training loop, torchtitan),
which caches no fp8 copy and saves bf16 inputs: an fp8 torch plan holds what its bf16 twin holds."""

from __future__ import annotations

import pytest

from optplan.estimators.activations import activation_bytes
from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.fp8_backend import (
    fp8_backend,
    fp8_weight_cache_bytes_per_param,
    saves_fp8_gemm_inputs,
)
from optplan.estimators.hardware import find_gpu
from optplan.estimators.memory import memory_breakdown
from optplan.estimators.strategy import Strategy

LLAMA_8B = "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0,seq=8192"


def test_each_engine_runs_its_own_fp8() -> None:
    assert fp8_backend(Strategy(engine="megatron", precision="fp8")) == "transformer_engine"
    assert fp8_backend(Strategy(engine="torch", precision="fp8")) == "torchao"
    assert fp8_backend(Strategy(engine="deepspeed", precision="fp8")) == "transformer_engine"  # the export names TE
    assert fp8_backend(Strategy(engine="torch", precision="bf16")) is None
    assert fp8_weight_cache_bytes_per_param(Strategy(engine="megatron", precision="fp8")) == 2
    assert fp8_weight_cache_bytes_per_param(Strategy(engine="torch", precision="fp8")) == 0
    assert saves_fp8_gemm_inputs(Strategy(engine="megatron", precision="fp8"))
    assert not saves_fp8_gemm_inputs(Strategy(engine="torch", precision="fp8"))


@pytest.mark.parametrize("layout", [dict(dp=8, fsdp="full"), dict(dp=4, tp=2, sp=True, fsdp="full"),
                                    dict(dp=2, pp=4, fsdp="full", grad_accum=4), dict(dp=8, fsdp="none")])
def test_a_torch_fp8_plan_holds_what_its_bf16_twin_holds(layout: dict) -> None:
    prof = profile_from_arch(parse_arch(LLAMA_8B))
    gpu = find_gpu("H100-SXM")
    kw = {"engine": "torch", "mbs": 1, "checkpointing": "full", **layout}
    fp8 = memory_breakdown(prof, Strategy(precision="fp8", **kw), gpu.memory_bytes)  # type: ignore[arg-type]
    bf16 = memory_breakdown(prof, Strategy(precision="bf16", **kw), gpu.memory_bytes)  # type: ignore[arg-type]
    assert fp8.total_bytes == bf16.total_bytes


def test_megatrons_transformer_engine_caches_and_saves_fp8() -> None:
    prof = profile_from_arch(parse_arch(LLAMA_8B))
    kw = {"engine": "megatron", "mbs": 1, "dp": 4, "tp": 2, "sp": True, "zero": 1}
    fp8, bf16 = Strategy(precision="fp8", **kw), Strategy(precision="bf16", **kw)  # type: ignore[arg-type]
    assert activation_bytes(prof, fp8) < activation_bytes(prof, bf16)  # fp8 GEMM inputs
    cap = find_gpu("H100-SXM").memory_bytes
    assert memory_breakdown(prof, fp8, cap).params_bytes == pytest.approx(
        2 * memory_breakdown(prof, bf16, cap).params_bytes, rel=1e-6)  # + fp8 W and W^T: 2 more bytes per param
