"""A Mixture-of-Experts model file planned end to end (issue 19): examples/moe.py at Mixtral 8x7B's shape is profiled
from the file (its MoE layers found, probes/moe_layers.py), Megatron-LM joins the engines for its expert
parallelism, the pick uses expert parallelism where it pays, says why, and its launch arguments pass Megatron's
rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from optplan.planner.api import load_profile
from optplan.planner.export.megatron import megatron_args, parse_megatron_args, validate_megatron_args
from optplan.planner.recommend import recommend

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe.py"


@pytest.fixture(scope="module")
def mixtral_file_profile():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPTPLAN_MOE_SIZE", "mixtral")
        return load_profile(EXAMPLE)


def test_mixtral_model_file_plans_with_expert_parallelism(mixtral_file_profile) -> None:
    prof = mixtral_file_profile
    assert prof.params == 46_702_792_704 and prof.activation_source == "measured"
    assert prof.transformer is not None and prof.transformer.moe is not None
    rec = recommend(prof, Cluster(gpu=find_gpu("H100-SXM"), gpus=32, gpus_per_node=8))
    assert rec.fits and rec.plan is not None
    plan: Strategy = rec.plan
    assert plan.engine == "megatron" and plan.ep > 1  # 46.7B of experts: splitting them pays
    line = next(r for r in rec.rationale if "expert parallelism ep" in r)
    # the next smaller ep: its memory when it does not fit, else its throughput against the pick's
    assert f"; ep {plan.ep // 2} needs" in line or f"; ep {plan.ep // 2} " in line and "samples/s" in line
    assert any("Megatron's own GPT" in n for n in rec.notes)
    assert rec.export is not None
    argv = megatron_args(rec.export)
    validate_megatron_args(argv, rec.export)
    ns = parse_megatron_args(argv)
    assert (ns.num_experts, ns.moe_router_topk, ns.expert_model_parallel_size) == (8, 2, plan.ep)
    assert ns.moe_ffn_hidden_size == 14336 and ns.num_layers == 32
    # the search's Megatron plans overlap their data-parallel (and tensor-parallel) communication, and say so
    assert plan.comm_overlap and ns.overlap_grad_reduce
    assert ns.overlap_param_gather == (plan.zero == 1) and ns.tp_comm_overlap == (plan.tp > 1)
    assert any("communication overlapped (" in r for r in rec.rationale)


@pytest.mark.full
def test_deepseek_style_model_file_plans_with_expert_parallelism() -> None:
    """examples/moe.py's default size: DeepSeek-V2-Lite's expert layout (64 fine-grained experts, top-6, 2 shared, a
    dense first layer). On 32 H100s ep pays, and the rationale says what the next smaller ep would need. In the full
    run only (its profile takes 75 s of CPU: 64 listed experts per layer under fake tensors); the default run plans
    the Mixtral size above, and tests/probes/test_moe_model_files.py reads shared experts and dense first layers."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPTPLAN_MOE_SIZE", "lite")
        prof = load_profile(EXAMPLE)
    assert prof.params == 15_787_866_112
    moe = prof.transformer.moe if prof.transformer is not None else None
    assert moe is not None and (moe.experts, moe.topk, moe.shared_experts, moe.first_dense) == (64, 6, 2, 1)
    rec = recommend(prof, Cluster(gpu=find_gpu("H100-SXM"), gpus=32, gpus_per_node=8))
    assert rec.plan is not None and rec.plan.engine == "megatron" and rec.plan.ep > 1
    line = next(r for r in rec.rationale if "expert parallelism ep" in r)
    # the next smaller ep: its memory when it does not fit, else its throughput against the pick's
    assert f"; ep {rec.plan.ep // 2} needs" in line or f"; ep {rec.plan.ep // 2} " in line and "samples/s" in line
    assert rec.export is not None
    argv = megatron_args(rec.export)
    validate_megatron_args(argv, rec.export)
    ns = parse_megatron_args(argv)
    assert (ns.num_experts, ns.moe_router_topk, ns.moe_ffn_hidden_size) == (64, 6, 1408)
    assert ns.moe_shared_expert_intermediate_size == 2 * 1408
