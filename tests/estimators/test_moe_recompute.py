"""Recomputing the MoE layers (Megatron's --recompute-modules moe): what it keeps, what it re-runs, where it is
allowed, and how it is exported."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.moe_recompute import moe_mlp_share, saved_bytes_per_token
from optplan.estimators.strategy import Strategy
from optplan.estimators.validity import check_strategy

MOE = "layers=16,hidden=2048,heads=16,kv_heads=4,seq=16384,experts=64,topk=8,moe_ffn=768,gated=1,tied=0,vocab=32000"
CLUSTER = Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8)


def _s(ckpt: str, **kw: object) -> Strategy:
    return Strategy(**{**dict(engine="megatron", precision="bf16", tp=2, dp=32, ep=8, zero=1, grad_accum=4,
                              checkpointing=ckpt), **kw})


def test_shares_by_hand():
    shape = profile_from_arch(parse_arch(MOE)).transformer
    assert shape is not None and shape.moe is not None
    assert moe_mlp_share(shape) == pytest.approx(1.0)  # every layer sparse: all the MLP is the experts'
    # gated: 8 x (8 x 768) MLP output bytes + router (4 B x 64 experts x 2) + 8 dispatched copies x 2048 x 2 B
    assert saved_bytes_per_token(shape) == pytest.approx(8 * 8 * 768 + 8 * 64 + 8 * 2048 * 2)
    dense = profile_from_arch(parse_arch("layers=16,hidden=2048,heads=16,seq=4096")).transformer
    assert dense is not None and moe_mlp_share(dense) == 0.0 and saved_bytes_per_token(dense) == 0.0


def test_sits_between_no_and_full_recomputation_and_keeps_attention():
    prof = profile_from_arch(parse_arch(MOE))
    none, sel, moe, full = (estimate(prof, CLUSTER, _s(c)) for c in ("none", "selective", "moe", "full"))
    # memory: the experts' activations go, attention's stay
    assert full.memory.activations_bytes < moe.memory.activations_bytes < none.memory.activations_bytes
    # time: the MoE block re-runs (and its all-to-alls a third time), long-context attention does not
    assert none.time.recompute_s < moe.time.recompute_s < full.time.recompute_s
    assert moe.time.step_s < full.time.step_s
    assert moe.time.comm_s > none.time.comm_s == sel.time.comm_s  # the third dispatch/combine


def test_rules():
    prof = profile_from_arch(parse_arch(MOE))
    dense = profile_from_arch(parse_arch("layers=16,hidden=2048,heads=16,seq=4096"))
    with pytest.raises(OptplanError, match="has none"):
        check_strategy(dense, CLUSTER, _s("moe", ep=1))
    check_strategy(prof, CLUSTER, _s("moe"))
    with pytest.raises(ValueError, match="--engine megatron"):
        Strategy(engine="deepspeed", checkpointing="moe")
    with pytest.raises(ValueError, match="excludes moe recomputation"):
        _s("moe", ep_overlap=True)


def test_megatron_export_and_validation():
    from optplan.estimators.buckets import DeepSpeedBuckets
    from optplan.planner.export.context import ExportPlan
    from optplan.planner.export.megatron import megatron_args, validate_megatron_args
    from optplan.planner.validate import ExportValidationError

    prof = profile_from_arch(parse_arch(MOE))
    buckets = DeepSpeedBuckets(reduce_bucket_size=1, allgather_bucket_size=1, stage3_prefetch_bucket_size=1,
                               stage3_param_persistence_threshold=1, stage3_max_live_parameters=1)
    plan = ExportPlan(strategy=_s("moe"), model="moe", model_path="", block_class=None, params=prof.params,
                      transformer=prof.transformer, seq_len=16384, buckets=buckets, gpu="H100-SXM", gpus_per_node=8)
    argv = megatron_args(plan)
    i = argv.index("--recompute-granularity")
    assert argv[i:i + 4] == ["--recompute-granularity", "selective", "--recompute-modules", "moe"]
    validate_megatron_args(argv, plan)
    with pytest.raises(ExportValidationError, match="recompute_modules|--recompute-modules"):
        validate_megatron_args(argv[:i + 3] + ["core_attn"] + argv[i + 4:], plan)
    with pytest.raises(ExportValidationError, match="selective only"):
        validate_megatron_args(argv[:i + 1] + ["full"] + argv[i + 2:], plan)
