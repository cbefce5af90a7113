"""DeepEP plans: the search offers the node-deduplicating dispatcher only where the expert group leaves the node (on
GPUs DeepEP runs on), and the Megatron export writes Megatron's flex-dispatcher flags, checked by its rules."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.buckets import DeepSpeedBuckets
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from optplan.planner.export.context import ExportPlan
from optplan.planner.export.megatron import megatron_args, parse_megatron_args, validate_megatron_args
from optplan.planner.space import build_space
from optplan.planner.validate import ExportValidationError

DSV3_LIKE = ("layers=8,hidden=2048,heads=16,ffn=8192,vocab=32000,gated=1,tied=0,experts=256,topk=8,moe_ffn=512,"
             "shared_experts=1,first_dense=1,seq=4096")
BUCKETS = DeepSpeedBuckets(reduce_bucket_size=16_777_216, allgather_bucket_size=16_777_216,
                           stage3_prefetch_bucket_size=15_099_494, stage3_param_persistence_threshold=40_960,
                           stage3_max_live_parameters=1_000_000_000)


def test_search_offers_deepep_where_the_expert_group_leaves_the_node() -> None:
    prof = profile_from_arch(parse_arch(DSV3_LIKE))
    space = build_space(prof, Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8), engines=("megatron",))
    deepep = [lay for lay in space.layouts if lay.dispatcher == "deepep"]
    assert deepep and all(lay.ep * lay.tp > 8 for lay in deepep)
    assert any(lay.ep * lay.tp > 8 and lay.dispatcher == "alltoall" for lay in space.layouts)
    a100 = build_space(prof, Cluster(gpu=find_gpu("A100-80GB"), gpus=64, gpus_per_node=8), engines=("megatron",))
    assert {lay.dispatcher for lay in a100.layouts} == {"alltoall"}


def test_megatron_export_writes_the_flex_dispatcher() -> None:
    prof = profile_from_arch(parse_arch(DSV3_LIKE))
    strategy = Strategy(engine="megatron", precision="bf16", tp=1, dp=64, ep=32, zero=1, mbs=1, grad_accum=4,  # type: ignore[arg-type]
                        dispatcher="deepep")
    plan = ExportPlan(strategy=strategy, model="moe", model_path="", block_class=None, params=prof.params,
                      transformer=prof.transformer, seq_len=4096, buckets=BUCKETS, gpu="H100-SXM", gpus_per_node=8)
    argv = megatron_args(plan)
    validate_megatron_args(argv, plan)
    ns = parse_megatron_args(argv)
    assert ns.moe_token_dispatcher_type == "flex" and ns.moe_enable_deepep
    # Megatron's rules: DeepEP only with the flex dispatcher, and the flex dispatcher only with DeepEP
    bad = [a for a in argv if a != "--moe-enable-deepep"]
    with pytest.raises(ExportValidationError, match="moe-enable-deepep"):
        validate_megatron_args(bad, plan)
    i = argv.index("flex")
    with pytest.raises(ExportValidationError, match="flex token dispatcher"):
        validate_megatron_args(argv[:i] + ["alltoall"] + argv[i + 1:], plan)


@pytest.mark.parametrize("argv,message", [
    (["--dispatcher", "nccl", "--ep", "8"], "--dispatcher"),
    (["--dispatcher", "deepep"], "--dispatcher deepep dispatches the tokens of expert parallelism"),
    (["--dispatcher", "deepep", "--ep", "8", "--gpu", "A100-80GB"], "not on A100-80GB"),
])
def test_bad_dispatcher_flags_are_one_line(argv: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from optplan.tui.cli import app

    base = ["estimate", "--arch", DSV3_LIKE, "--gpus", "64", "--engine", "megatron"]
    if "--gpu" not in argv:
        base += ["--gpu", "H100-SXM"]
    r = CliRunner().invoke(app, base + argv)
    assert r.exit_code != 0 and message in r.output, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) <= 3


def test_estimate_prices_a_deepep_plan() -> None:
    from typer.testing import CliRunner

    from optplan.tui.cli import app

    out = {}
    for d in ("alltoall", "deepep"):
        r = CliRunner().invoke(app, ["estimate", "--arch", DSV3_LIKE, "--gpus", "64", "--gpu", "H100-SXM", "--engine",
                                     "megatron", "--ep", "32", "--dispatcher", d, "--json"])
        assert r.exit_code == 0, r.output
        import json

        doc = json.loads(r.output[r.output.index("{"):])
        est = doc.get("estimate", doc)
        assert est["strategy"]["dispatcher"] == d
        out[d] = est["time"]["ep_comm_s"]
    assert 0 < out["deepep"] < out["alltoall"]


def test_search_plans_the_all_to_all_overlap_where_megatron_allows_it() -> None:
    """ep layouts carry Megatron's all-to-all overlap when its rules allow it (pp 1, or interleaved), and the points
    whose recipe forbids it (full recomputation, fp32) are priced without it rather than dropped. Two nodes of 8
    (the expert group can leave the node) keep the recommendation's search small."""
    from optplan.planner.recommend import recommend
    from optplan.planner.space import Group, strategy_of

    prof = profile_from_arch(parse_arch(DSV3_LIKE))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=16, gpus_per_node=8)
    space = build_space(prof, cluster, engines=("megatron",))
    for lay in space.layouts:
        assert lay.ep_overlap == (lay.ep > 1 and (lay.pp == 1 or lay.vpp > 1))
    lay = next(lay for lay in space.layouts if lay.ep_overlap and lay.pp == 1)
    sharding = next(sh for sh in space.shardings if sh.engine == "megatron")
    full = strategy_of(Group(lay, sharding, "bf16", "adamw", "full"), 1, 1)
    sel = strategy_of(Group(lay, sharding, "bf16", "adamw", "selective"), 1, 1)
    assert full is not None and not full.ep_overlap
    assert sel is not None and sel.ep_overlap
    rec = recommend(prof, cluster, engines=("megatron",), global_batch=256)
    assert rec.plan is not None and rec.plan.ep > 1 and rec.plan.ep_overlap
    assert any("--overlap-moe-expert-parallel-comm" in line and "without the overlap" in line
               for line in rec.rationale)
