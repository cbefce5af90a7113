"""estimators/loss_parallel.py: PyTorch's loss parallelism holds 16 bytes per local logit at its peak, 6 more than
the fused cross entropy an --arch profile counts for 16-bit activations; only torch-engine TP plans whose logits
stay sharded pay it."""

from __future__ import annotations

import pytest

from optplan.estimators.activations import activation_bytes
from optplan.estimators.arch import LOGIT_BYTES, parse_arch, profile_from_arch
from optplan.estimators.loss_parallel import (
    LOSS_PARALLEL_PEAK_BYTES_PER_LOGIT,
    loss_parallel_extra_bytes_per_sample,
    runs_loss_parallel,
)
from optplan.estimators.strategy import Strategy

LLAMA_70B = "layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256,gated=1,tied=0,seq=8192"


def test_torch_tp_plans_pay_the_decomposed_losss_extra_fp32_tensors() -> None:
    prof = profile_from_arch(parse_arch(LLAMA_70B))
    tp8 = Strategy(engine="torch", fsdp="full", precision="bf16", tp=8, dp=4, sp=True, mbs=2, checkpointing="full")
    assert runs_loss_parallel(prof, tp8)
    extra = loss_parallel_extra_bytes_per_sample(prof, tp8, "bf16")
    assert extra == (LOSS_PARALLEL_PEAK_BYTES_PER_LOGIT - LOGIT_BYTES["bf16"]) * 8192 * 128256 / 8
    assert extra == 4 * 8192 * 16032  # 4 bytes per local logit: 16 at the backward's peak, 12 counted
    assert loss_parallel_extra_bytes_per_sample(prof, tp8, "fp32") == extra  # its backward is fp32 either way
    # the activations of the last (here: only) stage grow by it, per sample of the micro-batch
    mega = tp8.model_copy(update={"engine": "megatron", "fsdp": "none", "zero": 1})
    assert not runs_loss_parallel(prof, mega) and loss_parallel_extra_bytes_per_sample(prof, mega, "bf16") == 0
    no_tp = tp8.model_copy(update={"tp": 1, "sp": False, "dp": 32})
    assert not runs_loss_parallel(prof, no_tp)
    with_it = activation_bytes(prof, tp8)
    base = activation_bytes(prof, tp8.model_copy(update={"checkpointing": "full", "engine": "deepspeed", "zero": 1,
                                                         "fsdp": "none"}))
    assert with_it - base == pytest.approx(2 * extra, rel=0.01)
