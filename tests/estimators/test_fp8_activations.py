"""Transformer Engine's fp8 GEMM inputs saved in fp8 (estimators/fp8_activations.py): the bytes by hand, and the
formula path's activations under the fp8 recipe against the bf16 ones, exactly that much lower."""

from __future__ import annotations

import pytest

from optplan.estimators.activations import activation_bytes
from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.fp8_activations import fp8_saved_bytes_per_token
from optplan.estimators.strategy import Strategy

LLAMA8B = "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0,seq=4096"
MOE = ("layers=8,hidden=2048,heads=16,ffn=8192,vocab=32000,gated=1,tied=0,experts=64,topk=6,moe_ffn=1408,"
       "shared_experts=2,first_dense=2,seq=4096")


def test_saved_bytes_by_hand() -> None:
    dense = profile_from_arch(parse_arch(LLAMA8B)).transformer
    assert dense is not None
    # QKV and MLP inputs 2h -> h each (replicated without sequence parallelism); projection input h and the down
    # projection's input F saved, split by tp
    assert fp8_saved_bytes_per_token(dense) == (2 * 4096, 4096 + 14336)
    moe = profile_from_arch(parse_arch(MOE)).transformer
    assert moe is not None and moe.moe is not None
    share = 6 / 8  # 6 of 8 layers sparse
    down = (1 - share) * 8192 + share * (6 + 2) * 1408
    assert fp8_saved_bytes_per_token(moe) == pytest.approx((2 * 2048, 2048 + down + share * 6 * 2048))
    # the MoE layers recomputed: their experts' inputs and the copies are not kept, only the dense layers' count
    assert fp8_saved_bytes_per_token(moe, moe_recomputed=True) == pytest.approx((2 * 2048, 2048 + (1 - share) * 8192))


@pytest.mark.parametrize("sp", [True, False])
def test_fp8_activations_are_the_bf16_ones_less_the_fp8_inputs(sp: bool) -> None:
    prof = profile_from_arch(parse_arch(LLAMA8B))
    base = dict(engine="megatron", tp=2, sp=sp, dp=4, mbs=2, zero=1, flash=True)
    bf16 = activation_bytes(prof, Strategy(precision="bf16", **base))  # type: ignore[arg-type]
    fp8 = activation_bytes(prof, Strategy(precision="fp8", **base))  # type: ignore[arg-type]
    rep, split = fp8_saved_bytes_per_token(prof.transformer)  # type: ignore[arg-type]
    per_layer = 4096 * (rep / (2 if sp else 1) + split / 2)
    assert bf16 - fp8 == pytest.approx(32 * 2 * per_layer, abs=2)


def test_fp8_outside_megatron_says_what_runs_and_what_is_priced() -> None:
    from optplan.estimators.estimate import estimate
    from optplan.estimators.hardware import Cluster, find_gpu

    prof = profile_from_arch(parse_arch("layers=2,hidden=256,heads=4,seq=128"))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=2, gpus_per_node=2)
    torch_plan = estimate(prof, cluster, Strategy(engine="torch", fsdp="full", dp=2, precision="fp8"))
    assert any("torchao's Float8Linear" in n for n in torch_plan.notes)
    megatron = estimate(prof, cluster, Strategy(engine="megatron", tp=2, dp=1, precision="fp8"))
    bf16 = estimate(prof, cluster, Strategy(engine="torch", fsdp="full", dp=2, precision="bf16"))
    assert not any("torchao" in n for n in (*megatron.notes, *bf16.notes))
