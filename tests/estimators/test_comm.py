"""Communication: the alpha-beta ring and point-to-point formulas (Thakur et al. 2005), Megatron's
tensor-parallel volume per layer, the context-parallel K/V ring, links chosen by placement, and the
engines' overlap defaults."""

from __future__ import annotations

import pytest
from conftest import make_gpu, make_profile

from optplan.estimators.arch import ArchSpec, profile_from_arch
from optplan.estimators.comm import (
    INTER_NODE_ALPHA_S,
    LINK_EFFICIENCY,
    Link,
    cp_ring_exchange_s,
    exposed_s,
    link_for,
    p2p_s,
    ring_all_reduce_s,
    ring_reduce_scatter_s,
    tp_collective_s,
)
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.parallel import placement, shard_ranks
from optplan.estimators.strategy import Strategy

LINK = Link(bandwidth_bytes_per_s=100e9, alpha_s=0.0)


def test_ring_all_reduce_is_reduce_scatter_plus_all_gather() -> None:
    for n in (2, 4, 8, 64):
        assert ring_all_reduce_s(3e8, n, 50e9, 2e-6) == pytest.approx(2 * ring_reduce_scatter_s(3e8, n, 50e9, 2e-6))
    # 2 ranks: each sends half and receives half twice: S / B
    assert ring_all_reduce_s(1e9, 2, 100e9, 0.0) == pytest.approx(10e-3)
    # latency term: 2(n-1) steps
    assert ring_all_reduce_s(1.0, 8, 1e30, 1e-5) == pytest.approx(14e-5)


def test_p2p_and_exposed() -> None:
    assert p2p_s(1e9, Link(bandwidth_bytes_per_s=50e9, alpha_s=1e-5)) == pytest.approx(20e-3 + 1e-5)
    assert p2p_s(0, LINK) == 0.0
    assert exposed_s(3.0, 1.0) == 2.0 and exposed_s(1.0, 3.0) == 0.0


def test_tp_volume_per_collective_hand_checked() -> None:
    # tokens 2048 x hidden 4096 x 2 bytes = 16.78 MB; ring all-reduce over 4: 2·3/4 of it at 100 GB/s
    size = 2048 * 4096 * 2
    ar = tp_collective_s(2048, 4096, 2, 4, LINK, sp=False)
    assert ar == pytest.approx(2 * 3 / 4 * size / 100e9)
    # sequence parallelism: reduce-scatter + all-gather, the same volume (Korthikanti et al. 2022 §4.2.2)
    assert tp_collective_s(2048, 4096, 2, 4, LINK, sp=True) == pytest.approx(ar)
    assert tp_collective_s(2048, 4096, 2, 1, LINK, sp=False) == 0.0


def test_cp_ring_hand_checked() -> None:
    # cp = 4: 3 steps of K and V chunks (2 · 1024 tokens · 1024 kv dims · 2 bytes = 4 MiB) forward,
    # twice that backward (K/V and dK/dV)
    chunk = 2 * 1024 * 1024 * 2
    fwd, bwd = cp_ring_exchange_s(1024, 1024, 2, 4, LINK)
    assert fwd == pytest.approx(3 * chunk / 100e9)
    assert bwd == pytest.approx(2 * fwd)
    assert cp_ring_exchange_s(1024, 1024, 2, 1, LINK) == (0.0, 0.0)


def test_placement_picks_intra_and_inter_node_links() -> None:
    cluster = Cluster(gpu=make_gpu(), gpus=16, gpus_per_node=8, inter_node_bandwidth_bytes_per_s=50e9)
    pl = placement(Strategy(tp=8, dp=2), 8)  # TP inside a node first, DP across the two nodes
    tp, dp = link_for(pl.tp, cluster), link_for(pl.grad_reduce, cluster)
    assert not tp.inter_node and tp.bandwidth_bytes_per_s == pytest.approx(400e9 * LINK_EFFICIENCY)
    assert dp.inter_node and dp.bandwidth_bytes_per_s == pytest.approx(50e9 * LINK_EFFICIENCY)
    assert dp.alpha_s == INTER_NODE_ALPHA_S
    pl2 = placement(Strategy(tp=2, dp=4), 8)  # everything in one node
    assert not link_for(pl2.grad_reduce, cluster).inter_node


@pytest.mark.parametrize("fsdp", ["none", "full", "hybrid"])
def test_shard_ranks_is_the_placed_shard_group(fsdp: str) -> None:
    """``shard_ranks`` (what memory asks for) is the shard group ``placement`` places, HSDP's node-local one
    included, on nodes of 4 and 8 GPUs."""
    seen = set()
    for tp in (1, 2, 8):
        for cp in (1, 2):
            for dp in (1, 2, 4, 16):
                s = Strategy(tp=tp, cp=cp, dp=dp, fsdp=fsdp, engine="torch" if fsdp != "none" else "megatron")
                for per_node in (4, 8):
                    n = shard_ranks(s, per_node)
                    assert n == placement(s, per_node).shard.ranks
                    seen.add(n)
    assert len(seen) > 3  # the grid reached sharded groups of several sizes (and HSDP's node-local ones)


def test_data_parallel_across_nodes_is_slower() -> None:
    prof = make_profile(params=1_000_000_000)
    s = Strategy(precision="bf16", dp=8, mbs=4)
    one_node = estimate(prof, Cluster(gpu=make_gpu(), gpus=8, gpus_per_node=8), s).time
    two_nodes = estimate(prof, Cluster(gpu=make_gpu(), gpus=8, gpus_per_node=4,
                                       inter_node_bandwidth_bytes_per_s=25e9), s).time
    # two nodes of 4: every byte leaves a node over its 4 NICs (4 x 25 GB/s) instead of NVLink
    assert two_nodes.dp_comm_s > 2 * one_node.dp_comm_s
    assert two_nodes.compute_s == pytest.approx(one_node.compute_s)


def test_tp_comm_in_estimate_counts_four_collectives_per_layer_and_six_with_recompute() -> None:
    L, h, s, b = 8, 1024, 1024, 2
    prof = profile_from_arch(ArchSpec(layers=L, hidden=h, heads=16, seq=s))
    cluster = Cluster(gpu=make_gpu(), gpus=8, gpus_per_node=8)
    link = link_for(placement(Strategy(tp=4, dp=2), 8).tp, cluster)
    one = tp_collective_s(b * s, h, 2, 4, link, sp=False)
    plain = estimate(prof, cluster, Strategy(precision="bf16", tp=4, dp=2, mbs=b, grad_accum=3, sp=False)).time
    # 4 per layer, plus the vocabulary-parallel embedding (forward) and logits (backward) collectives
    # and 3 tiny cross-entropy all-reduces per micro-batch
    tiny = 3 * ring_all_reduce_s(b * s * 4, 4, link.bandwidth_bytes_per_s, link.alpha_s)
    assert plain.tp_comm_s == pytest.approx(3 * (4 * L * one + 2 * one + tiny))
    ckpt = estimate(prof, cluster, Strategy(precision="bf16", tp=4, dp=2, mbs=b, grad_accum=3, sp=False,
                                            checkpointing="full")).time
    assert ckpt.tp_comm_s - plain.tp_comm_s == pytest.approx(3 * 2 * L * one)


def test_overlap_defaults_by_engine() -> None:
    prof = make_profile(params=1_000_000_000)
    cluster = Cluster(gpu=make_gpu(), gpus=16, gpus_per_node=8, inter_node_bandwidth_bytes_per_s=25e9)
    common = {"precision": "bf16", "dp": 16, "mbs": 4, "grad_accum": 2}
    megatron = estimate(prof, cluster, Strategy(engine="megatron", **common)).time
    ddp = estimate(prof, cluster, Strategy(engine="torch", **common)).time
    ds0 = estimate(prof, cluster, Strategy(engine="deepspeed", zero=0, **common)).time
    # Megatron all-reduces fp32 main gradients under bf16 (twice the bytes); Megatron (no
    # --overlap-grad-reduce) and DeepSpeed (overlap_comm off) expose the all-reduce, DDP hides all but
    # what exceeds the last backward (and at least one bucket)
    assert megatron.dp_comm_s == pytest.approx(2 * ddp.dp_comm_s, rel=2e-2)  # twice the bytes, same latency
    assert ds0.dp_comm_s == pytest.approx(ddp.dp_comm_s)
    assert megatron.exposed_dp_comm_s == pytest.approx(megatron.dp_comm_s)
    assert ds0.exposed_dp_comm_s == pytest.approx(ds0.dp_comm_s)
    assert ddp.exposed_dp_comm_s < ddp.dp_comm_s
    z3 = estimate(prof, cluster, Strategy(engine="deepspeed", zero=3, **common)).time
    fsdp = estimate(prof, cluster, Strategy(engine="torch", fsdp="full", **common)).time
    # torch FSDP reduce-scatters in fp32 (reduce_dtype=float32, as exported); ZeRO-3 in the bf16 gradients
    assert fsdp.dp_comm_s > 1.2 * z3.dp_comm_s
    assert z3.exposed_dp_comm_s < z3.dp_comm_s
    for t in (megatron, ddp, ds0, z3, fsdp):
        assert t.exposed_comm_s <= t.comm_s + 1e-12


def test_tree_all_reduce_wins_for_small_messages_across_many_nodes() -> None:
    from optplan.estimators.comm import Link, all_reduce_s, ring_all_reduce_s, tree_all_reduce_s

    inter = Link(bandwidth_bytes_per_s=40e9, alpha_s=15e-6, inter_node=True)
    small, n = 1e6, 1024
    ring = ring_all_reduce_s(small, n, 40e9, 15e-6)
    tree = tree_all_reduce_s(small, n, 40e9, 15e-6)
    assert tree == pytest.approx(2 * small / 40e9 + 2 * 10 * 15e-6)
    assert tree < ring and all_reduce_s(small, n, inter) == tree
    big = 10e9  # bandwidth-bound: the ring's (n-1)/n factor and tree's 2·S are within a hair; ring wins
    assert all_reduce_s(big, 8, inter) == ring_all_reduce_s(big, 8, 40e9, 15e-6)
    intra = inter.model_copy(update={"inter_node": False})
    assert all_reduce_s(small, n, intra) == ring  # NCCL rings inside a node
