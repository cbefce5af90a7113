"""Megatron-LM arguments of MoE and latent-attention plans: the expert flags, the layer pattern, MLA ranks, and
Megatron's MoE rules on both sides (the export refuses, the validator catches edited arguments)."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.buckets import DeepSpeedBuckets
from optplan.estimators.strategy import Strategy
from optplan.planner.export.context import ExportPlan, NotExportable
from optplan.planner.export.megatron import megatron_args, parse_megatron_args, validate_megatron_args
from optplan.planner.validate import ExportValidationError

BUCKETS = DeepSpeedBuckets(reduce_bucket_size=16_777_216, allgather_bucket_size=16_777_216,
                           stage3_prefetch_bucket_size=15_099_494, stage3_param_persistence_threshold=40_960,
                           stage3_max_live_parameters=1_000_000_000)
MIXTRAL = "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000,gated=1,tied=0,experts=8,topk=2,seq=4096"
DEEPSEEK_LITE = ("layers=27,hidden=2048,heads=16,ffn=10944,vocab=102400,gated=1,tied=0,kv_lora=512,rope_dim=64,"
                 "nope_dim=128,v_dim=128,experts=64,topk=6,moe_ffn=1408,shared_experts=2,first_dense=1,seq=4096")


def _plan(arch: str, **strategy: object) -> ExportPlan:
    prof = profile_from_arch(parse_arch(arch))
    fields = {"engine": "megatron", "precision": "bf16", "tp": 2, "dp": 32, "ep": 8, "zero": 1, "mbs": 1,
              "grad_accum": 8, "checkpointing": "full", **strategy}
    return ExportPlan(strategy=Strategy(**fields), model="moe", model_path="", block_class=None, params=prof.params,  # type: ignore[arg-type]
                      transformer=prof.transformer, seq_len=4096, buckets=BUCKETS, gpu="H100-SXM", gpus_per_node=8)


def test_mixtral_plan_round_trips() -> None:
    plan = _plan(MIXTRAL)
    argv = megatron_args(plan)
    validate_megatron_args(argv, plan)
    ns = parse_megatron_args(argv)
    assert (ns.num_experts, ns.moe_router_topk, ns.expert_model_parallel_size) == (8, 2, 8)
    assert ns.ffn_hidden_size == ns.moe_ffn_hidden_size == 14336  # not the profile's active width 28672
    assert ns.moe_layer_freq == "1" and ns.moe_grouped_gemm and ns.moe_token_dispatcher_type == "alltoall"
    assert ns.sequence_parallel and not ns.multi_latent_attention
    # the load-balancing loss is on (Megatron's default coefficient 0.0 would leave the routing the plan priced
    # as balanced unbalanced)
    assert ns.moe_router_load_balancing_type == "aux_loss" and ns.moe_aux_loss_coeff == 0.01


def test_deepseek_plan_has_its_dense_layer_shared_experts_and_mla() -> None:
    plan = _plan(DEEPSEEK_LITE, tp=1, dp=64, ep=16)
    argv = megatron_args(plan)
    validate_megatron_args(argv, plan)
    ns = parse_megatron_args(argv)
    assert eval(ns.moe_layer_freq) == [0] + [1] * 26  # noqa: S307 - what Megatron's moe_freq_type evaluates
    assert ns.ffn_hidden_size == 10944 and ns.moe_ffn_hidden_size == 1408
    assert ns.moe_shared_expert_intermediate_size == 2 * 1408
    assert ns.multi_latent_attention and (ns.kv_lora_rank, ns.qk_head_dim, ns.qk_pos_emb_head_dim, ns.v_head_dim) == \
        (512, 128, 64, 128)
    assert ns.q_lora_rank is None


def test_moe_with_tp_needs_sequence_parallelism() -> None:
    with pytest.raises(NotExportable, match="sequence parallelism must be used"):
        megatron_args(_plan(MIXTRAL, sp=False))


@pytest.mark.parametrize(("old", "new", "message"), [
    (("--expert-model-parallel-size", "8"), ("--expert-model-parallel-size", "3"), "divisible by expert_model"),
    (("--moe-router-topk", "2"), ("--moe-router-topk", "9"), "more than the 8 experts"),
    (("--expert-model-parallel-size", "8"), ("--expert-model-parallel-size", "4"), "needs '8'|needs 8"),
])
def test_validator_catches_edited_moe_arguments(old: tuple[str, str], new: tuple[str, str], message: str) -> None:
    plan = _plan(MIXTRAL)
    argv = megatron_args(plan)
    i = argv.index(old[0])
    assert argv[i + 1] == old[1]
    argv[i + 1] = new[1]
    with pytest.raises(ExportValidationError, match=message):
        validate_megatron_args(argv, plan)


def test_expert_tensor_parallelism_is_exported_and_checked() -> None:
    """etp 1 beside tp 2 writes --expert-tensor-parallel-size 1; Megatron's expert-mesh rule (world divisible by
    etp·ep·pp) and the expert-width rule use etp."""
    plan = _plan(MIXTRAL, ep=8, etp=1)
    argv = megatron_args(plan)
    validate_megatron_args(argv, plan)
    ns = parse_megatron_args(argv)
    assert (ns.expert_model_parallel_size, ns.expert_tensor_parallel_size, ns.tensor_model_parallel_size) == (8, 1, 2)
    assert "--expert-tensor-parallel-size" not in megatron_args(_plan(MIXTRAL))  # etp = tp: Megatron's default
    edited = list(argv)
    edited[edited.index("--expert-tensor-parallel-size") + 1] = "16"  # etp 16 · ep 8 · pp 1 = 128 > 64 GPUs
    with pytest.raises(ExportValidationError, match="expert_tensor_model_pipeline_parallel size"):
        validate_megatron_args(edited, plan)
