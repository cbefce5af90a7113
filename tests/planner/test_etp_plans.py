"""Expert tensor parallelism in plans: the search offers etp 1 beside tp > 1 (and drops the split it dominates),
the rationale says why, and ``optplan estimate --etp`` takes it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.planner.space import build_space

QWEN_LIKE = ("layers=8,hidden=2048,heads=16,kv_heads=4,ffn=8192,vocab=32000,gated=1,tied=0,experts=32,topk=4,"
             "moe_ffn=768,seq=4096")
MIXTRAL_LIKE = "layers=4,hidden=1024,heads=16,kv_heads=8,ffn=4096,vocab=32000,gated=1,tied=0,experts=8,topk=2,seq=4096"


def test_the_space_folds_experts_over_tp_and_drops_the_dominated_split() -> None:
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8)
    space = build_space(profile_from_arch(parse_arch(QWEN_LIKE), name="q"), cluster, global_batch=256,
                        engines=["megatron"])
    splits = {(lay.tp, lay.dp * lay.cp, lay.etp, lay.ep) for lay in space.layouts}
    assert (4, 16, 1, 32) in splits  # ep 32 > dp·cp 16: only folded
    assert (4, 16, None, 4) not in splits and (4, 16, 1, 16) in splits  # etp 4 x ep 4 = etp 1 x ep 16, cheaper
    assert not any(etp == 1 and ep < tp for tp, _, etp, ep in splits)
    assert all(etp is None for tp, _, etp, _ in splits if tp == 1)
    assert (4, 16, None, 1) in splits  # tp without expert parallelism stays (the torch engine's tp layouts need it)
    # 8 experts: tp 2 x ep 8 cannot fold (16 > 8 experts), so the split stays
    small = build_space(profile_from_arch(parse_arch(MIXTRAL_LIKE), name="m"), cluster, global_batch=256,
                        engines=["megatron"])
    assert any(lay.tp == 2 and lay.etp is None and lay.ep == 8 for lay in small.layouts)


runner = CliRunner()


def test_estimate_takes_etp_and_refuses_bad_values() -> None:
    from optplan.tui.cli import app

    args = ["estimate", "--arch", QWEN_LIKE, "--gpus", "64", "--gpu", "H100-SXM", "--tp", "4", "--ep", "32",
            "--engine", "megatron", "--global-batch", "128"]
    res = runner.invoke(app, [*args, "--etp", "1", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["strategy"]["etp"] == 1 and doc["strategy"]["ep"] == 32
    res = runner.invoke(app, args)  # ep 32 > dp·cp 16 without folding
    assert res.exit_code != 0 and "--etp 1" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, [*args, "--etp", "0"])
    assert res.exit_code != 0 and "--etp must be >= 1" in res.output


def test_the_rationale_says_why_etp_and_prices_the_unfolded_split() -> None:
    from optplan.estimators.estimate import estimate
    from optplan.estimators.strategy import Strategy
    from optplan.planner.rationale import _ep_line

    profile = profile_from_arch(parse_arch(QWEN_LIKE), name="q")
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8)
    pick = estimate(profile, cluster, Strategy(engine="megatron", precision="bf16", tp=4, dp=16, ep=16, etp=1, zero=1,
                                               mbs=1, grad_accum=8))
    line = _ep_line(pick, lambda s: estimate(profile, cluster, s), [pick])
    assert line is not None and "expert tensor parallelism etp 1 (tp 4 for the other layers)" in line
    assert "; etp 4 with ep 4 " in line and "samples/s" in line  # the same expert sharding, split by tp


def test_an_expert_width_tp_does_not_divide_is_planned_folded() -> None:
    """moe_ffn 1002 is not divisible by tp 4: Megatron refuses etp = tp there, so tp 4 layouts come only folded
    (etp 1), and recommending does not stop on the rule."""
    from optplan.planner.recommend import recommend

    odd = profile_from_arch(parse_arch(QWEN_LIKE.replace("moe_ffn=768", "moe_ffn=1002")), name="odd")
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=16, gpus_per_node=8)
    space = build_space(odd, cluster, global_batch=64, engines=["megatron"])
    assert all(lay.etp == 1 for lay in space.layouts if lay.tp in (4, 8))
    assert any(lay.tp == 4 and lay.etp == 1 for lay in space.layouts)
    rec = recommend(odd, cluster, global_batch=64, engines=["megatron"])
    assert rec.plan is not None and odd.transformer.moe.moe_ffn % rec.plan.expert_tp == 0  # type: ignore[union-attr]
