"""The node-deduplicating dispatcher (DeepEP through Megatron's flex dispatcher): the expected remote nodes per
token by hand, the all-to-all it prices, and its rules and one-line errors (the search and the export: tests/planner/test_deepep_plans.py)."""

from __future__ import annotations

from math import comb

import pytest

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.comm import all_to_all_s
from optplan.estimators.efficiency import LINK_EFFICIENCY
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import estimate
from optplan.estimators.expert_parallel import DEEPEP_NIC_FRACTION, node_dedup_factor
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from optplan.estimators.validity import check_strategy

DSV3_LIKE = ("layers=8,hidden=2048,heads=16,ffn=8192,vocab=32000,gated=1,tied=0,experts=256,topk=8,moe_ffn=512,"
             "shared_experts=1,first_dense=1,seq=4096")


def _s(**kw: object) -> Strategy:
    fields = {"engine": "megatron", "precision": "bf16", "tp": 1, "dp": 64, "zero": 1, "mbs": 1, "grad_accum": 4, **kw}
    return Strategy(**fields)  # type: ignore[arg-type]


def test_dedup_factor_by_hand() -> None:
    # 256 experts over 4 nodes (64 each), top-8: a remote node holds none of a token's experts with probability
    # C(192, 8)/C(256, 8); 3 remote nodes, against 8 x 3/4 = 6 copies leaving the node
    miss = comb(192, 8) / comb(256, 8)
    assert node_dedup_factor(256, 8, 4) == pytest.approx(3 * (1 - miss) / 6)
    assert 0.3 < node_dedup_factor(256, 8, 4) < 0.5
    # top-1: every copy goes to one node, nothing to deduplicate; one node: nothing leaves it
    assert node_dedup_factor(64, 1, 8) == pytest.approx(1.0)
    assert node_dedup_factor(256, 8, 1) == 1.0
    # the inter-node share of an all-to-all scales with it; the NVLink share does not
    assert all_to_all_s(80e6, 16, 8, 360e9, 50e9, 0.0, inter_scale=0.4) == pytest.approx(0.4 * 8 / 16 * 80e6 / 50e9)
    assert all_to_all_s(80e6, 8, 8, 360e9, 50e9, 0.0, inter_scale=0.4) == all_to_all_s(80e6, 8, 8, 360e9, 50e9, 0.0)
    # latency: NCCL's n - 1 pairwise exchanges, DeepEP's one (every peer written at once)
    bytes_s = 8 / 16 * 80e6 / 50e9
    assert all_to_all_s(80e6, 16, 8, 360e9, 50e9, 15e-6) == pytest.approx(bytes_s + 15 * 15e-6)
    assert all_to_all_s(80e6, 16, 8, 360e9, 50e9, 15e-6, peers_at_once=True) == pytest.approx(bytes_s + 15e-6)


def test_deepep_cuts_the_cross_node_all_to_all_only() -> None:
    prof = profile_from_arch(parse_arch(DSV3_LIKE))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8)
    across = {d: estimate(prof, cluster, _s(ep=32, dispatcher=d)).time for d in ("alltoall", "deepep")}
    assert 0 < across["deepep"].ep_comm_s < 0.6 * across["alltoall"].ep_comm_s
    assert across["deepep"].step_s < across["alltoall"].step_s
    inside = {d: estimate(prof, cluster, _s(ep=8, dispatcher=d)).time for d in ("alltoall", "deepep")}
    # one node: NVLink either way, the same bytes; DeepEP pays one latency per call where NCCL pays seven
    assert inside["deepep"].ep_comm_s < inside["alltoall"].ep_comm_s
    assert inside["deepep"].ep_comm_s == pytest.approx(inside["alltoall"].ep_comm_s, rel=0.1)


def test_deepep_moves_cross_node_bytes_at_its_measured_nic_fraction() -> None:
    """Top-1 routing leaves nothing to deduplicate, so DeepEP and NCCL send the same bytes across nodes: DeepEP's
    cross-node all-to-all is then faster by its NIC fraction alone (0.86 of the line rate, its own benchmark, against
    NCCL's 0.75), where the NIC, not NVLink or the per-peer latency, bounds it (64 samples a micro-batch: the latencies, 1 against 31 per call, are ~2 % of it)."""
    prof = profile_from_arch(parse_arch(DSV3_LIKE.replace("topk=8", "topk=1")))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8)
    t = {d: estimate(prof, cluster, _s(ep=32, dispatcher=d, mbs=64)).time.ep_comm_s for d in ("alltoall", "deepep")}
    assert DEEPEP_NIC_FRACTION == 0.86 and LINK_EFFICIENCY == 0.75
    assert t["deepep"] / t["alltoall"] == pytest.approx(LINK_EFFICIENCY / DEEPEP_NIC_FRACTION, rel=0.03)


def test_rules_and_errors() -> None:
    with pytest.raises(ValueError, match="--dispatcher deepep"):
        _s(dispatcher="deepep")  # ep 1
    with pytest.raises(ValueError, match="--dispatcher deepep"):
        Strategy(engine="deepspeed", dispatcher="deepep", ep=1)  # type: ignore[arg-type]
    prof = profile_from_arch(parse_arch(DSV3_LIKE))
    with pytest.raises(OptplanError, match="not on A100-80GB"):
        check_strategy(prof, Cluster(gpu=find_gpu("A100-80GB"), gpus=64, gpus_per_node=8), _s(ep=16, dispatcher="deepep"))
    assert "deepep" in _s(ep=16, dispatcher="deepep").label()

