"""Expert tensor parallelism (Megatron-Core's --expert-tensor-parallel-size, MoE parallel folding): the rules, the
expert mesh's placement, what a rank holds, the dispatcher's gather/scatter and the collectives an MoE layer skips,
(tests/planner/test_etp_plans.py: the search and the command line; test_export_megatron_moe.py: the export)."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.comm import link_for, ring_all_gather_s
from optplan.estimators.compute import efficiency_for
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import estimate
from optplan.estimators.expert_parallel import routed_params
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.memory import stage_params
from optplan.estimators.moe_comm import ETP_COLLECTIVES_PER_PASS, moe_layer_comm
from optplan.estimators.parallel import placement
from optplan.estimators.strategy import Strategy
from optplan.estimators.validity import check_strategy

QWEN_LIKE = ("layers=8,hidden=2048,heads=16,kv_heads=4,ffn=8192,vocab=32000,gated=1,tied=0,experts=32,topk=4,"
             "moe_ffn=768,seq=4096")
"""A Qwen3-MoE-like shape (fine-grained experts, no shared expert)."""
SHARED = QWEN_LIKE.replace("moe_ffn=768", "moe_ffn=768,shared_experts=1")
DENSE = "layers=8,hidden=2048,heads=16,ffn=8192,vocab=32000,seq=4096"
H100 = Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8)


@pytest.fixture(scope="module")
def qwen():  # type: ignore[no-untyped-def]
    return profile_from_arch(parse_arch(QWEN_LIKE), name="qwen-like")


def _s(**kw: object) -> Strategy:
    base = {"engine": "megatron", "precision": "bf16", "tp": 4, "dp": 16, "zero": 1, "mbs": 1, "grad_accum": 8}
    return Strategy(**{**base, **kw})  # type: ignore[arg-type]


def test_the_expert_mesh_rules() -> None:
    s = _s(ep=32, etp=1)  # ep 32 > dp·cp 16: only possible folded over tp
    assert (s.expert_tp, s.expert_dp) == (1, 2)  # tp·dp·cp 64 / (ep 32 · etp 1)
    assert _s(ep=8).expert_tp == 4 and _s(ep=8).expert_dp == 2
    with pytest.raises(ValueError, match="must divide the tensor x data x context-parallel ranks 64"):
        _s(ep=128, etp=1)
    with pytest.raises(ValueError, match="--etp 1"):  # the unfolded rule says how to fold
        _s(ep=32)
    with pytest.raises(ValueError, match="use --engine megatron"):
        Strategy(engine="deepspeed", etp=2)
    assert _s(ep=4, etp=4).expert_tp == 4  # etp = tp: the default spelled out


def test_the_model_rules(qwen) -> None:  # type: ignore[no-untyped-def]
    check_strategy(qwen, H100, _s(ep=16, etp=1))
    with pytest.raises(OptplanError, match="--etp 5 does not divide the experts' FFN width 768"):
        check_strategy(qwen, H100, _s(ep=8, etp=2, tp=4).model_copy(update={"etp": 5}))
    odd = profile_from_arch(parse_arch(QWEN_LIKE.replace("moe_ffn=768", "moe_ffn=1002")), name="odd")
    with pytest.raises(OptplanError, match="--tp 4 does not divide .* or --etp 1"):  # Megatron's default etp = tp
        check_strategy(odd, H100, _s(ep=4))
    check_strategy(odd, H100, _s(ep=16, etp=1))
    dense = profile_from_arch(parse_arch(DENSE), name="dense")
    with pytest.raises(OptplanError, match="dense has none: drop --etp"):
        check_strategy(dense, H100, _s(etp=1))


def test_the_expert_group_sits_at_stride_etp() -> None:
    folded, split = placement(_s(ep=8, etp=1), 8), placement(_s(ep=8), 8)
    assert (folded.ep.ranks, folded.ep.nodes, folded.etp.ranks) == (8, 1, 1)  # 8 consecutive ranks: one node
    assert (split.ep.ranks, split.ep.nodes, split.etp.ranks) == (8, 4, 4)  # stride 4: 32 ranks, 4 nodes


def test_a_rank_holds_its_experts_split_over_ep_times_etp(qwen) -> None:  # type: ignore[no-untyped-def]
    routed = routed_params(qwen)
    dense_share = stage_params(qwen, _s()) - routed / 4  # everything but the routed experts, per tp rank
    assert stage_params(qwen, _s(ep=16, etp=1)) == pytest.approx(dense_share + routed / 16)
    assert stage_params(qwen, _s(ep=4)) == pytest.approx(dense_share + routed / 16)  # the same sharding, etp = tp
    # etp 1 without ep: every tp rank holds every expert whole (more than the tp split)
    assert stage_params(qwen, _s(ep=1, etp=1)) == pytest.approx(dense_share + routed)


def test_the_dispatcher_gathers_over_etp_and_the_moe_layer_skips_the_mlp_collectives(qwen) -> None:  # type: ignore[no-untyped-def]
    eff = efficiency_for(H100.gpu)
    tokens, elem, hbm = 4096.0, 2, 3e12

    def comm(s: Strategy, prof=qwen):  # type: ignore[no-untyped-def]
        pl = placement(s, 8)
        return moe_layer_comm(prof, s, H100, eff, link_for(pl.etp, H100), tokens, elem, hbm), pl

    one, _ = comm(_s(ep=1, etp=1))
    assert one.dispatch_pass_s == 0.0  # no ep, no etp: nothing to dispatch
    two, pl = comm(_s(ep=1, etp=2))
    copies = tokens * 4 * 2048 * elem / 4  # topk copies of h, the tp rank's sequence-parallel quarter
    link = link_for(pl.etp, H100)
    assert two.dispatch_pass_s == pytest.approx(
        ETP_COLLECTIVES_PER_PASS * ring_all_gather_s(copies * 2, 2, link.bandwidth_bytes_per_s, link.alpha_s))
    # local experts beyond the active ones are read whole with etp 1, half with etp 2
    assert one.expert_weight_read_s == pytest.approx(2 * two.expert_weight_read_s)
    assert one.mlp_tp_collectives_skipped == 1.0  # every layer is MoE, none has a shared expert
    shared = profile_from_arch(parse_arch(SHARED), name="shared")
    assert comm(_s(ep=1, etp=1), shared)[0].mlp_tp_collectives_skipped == 0.0  # the shared expert is tensor-parallel
    assert comm(_s(tp=1, dp=64, ep=8), qwen)[0].mlp_tp_collectives_skipped == 0.0  # no tp, nothing to skip


def test_deepep_dispatches_over_the_combined_group_without_a_gather(qwen) -> None:  # type: ignore[no-untyped-def]
    """Megatron's flex dispatcher (DeepEP) runs over the tp_ep group (etp·ep ranks) with no etp gather: at the same
    etp·ep it prices like the folded plan."""
    eff = efficiency_for(H100.gpu)

    def comm(s: Strategy):  # type: ignore[no-untyped-def]
        pl = placement(s, 8)
        return moe_layer_comm(qwen, s, H100, eff, link_for(pl.etp, H100), 4096.0, 2, 3e12)

    split = comm(_s(ep=4, dispatcher="deepep"))  # etp 4 x ep 4: 16 ranks, two nodes
    folded = comm(_s(ep=16, etp=1, dispatcher="deepep"))
    assert split.dispatch_pass_s == pytest.approx(folded.dispatch_pass_s)
    assert comm(_s(ep=4)).dispatch_pass_s > split.dispatch_pass_s  # NCCL all-to-all + the etp gather


def test_folding_saves_the_expert_gather_in_the_step(qwen) -> None:  # type: ignore[no-untyped-def]
    """The same expert sharding (ep·etp 16) both ways, the expert group over two nodes both ways: folded, the
    all-to-all runs over 16 consecutive ranks and no etp gather; split by tp, ep 4 at stride 4, and every routed
    token is gathered over the 4 etp ranks and scattered back."""
    folded = estimate(qwen, H100, _s(ep=16, etp=1))
    split = estimate(qwen, H100, _s(ep=4))
    assert folded.memory.params_bytes == split.memory.params_bytes
    assert folded.time.ep_comm_s < split.time.ep_comm_s
    assert folded.time.step_s < split.time.step_s
