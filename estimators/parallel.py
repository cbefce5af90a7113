"""Placement of a strategy's parallel groups on nodes, and the layers each pipeline rank holds.

Rank order (Megatron-LM's default, Narayanan et al. 2021 arXiv 2104.04473 §3.2 "tensor parallelism
inside a node"; Megatron-Core ``parallel_state`` order tp-cp-dp-pp): tensor-parallel ranks are
adjacent (stride 1), then context-parallel (stride tp), data-parallel (stride tp·cp), and pipeline
stages outermost (stride tp·cp·dp). A group of n ranks at stride k on nodes of G GPUs stays inside
one node when k·n <= G; otherwise it spans ceil(k·n / G) nodes (n nodes once k >= G).

ZeRO and FSDP shard over the data-parallel and context-parallel ranks together (CP ranks hold the
same weights: Megatron-Core reduces gradients over the dp×cp group; torchtitan's FSDP mesh is
dp_shard×cp). HYBRID_SHARD (HSDP, PyTorch FSDP docs) shards inside a node and replicates across nodes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.hardware import Cluster
from optplan.estimators.strategy import Strategy


class GroupPlacement(BaseModel):
    """One communication group: its size and how many nodes it spans."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ranks: int = Field(ge=1)
    nodes: int = Field(ge=1, description="nodes the group spans (1 = intra-node links only)")

    @property
    def intra_node(self) -> bool:
        return self.nodes == 1


class Placement(BaseModel):
    """Where a strategy's tp, cp, dp (× cp for sharding) and pp groups sit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: GroupPlacement
    cp: GroupPlacement
    dp: GroupPlacement
    shard: GroupPlacement = Field(description="the ZeRO/FSDP sharding group (dp·cp, or its node-local part for HSDP)")
    grad_reduce: GroupPlacement = Field(description="the gradient-reduction group (dp·cp)")
    pp: GroupPlacement
    gpus_per_node: int = Field(ge=1)
    ep: GroupPlacement = Field(default=GroupPlacement(ranks=1, nodes=1),
                               description="the expert-parallel group: ep ranks at stride etp (Megatron-Core's "
                                           "expert rank order etp-ep-edp-pp; with etp = tp, ep consecutive "
                                           "data-parallel ranks)")
    etp: GroupPlacement = Field(default=GroupPlacement(ranks=1, nodes=1),
                                description="the expert tensor-parallel group: etp consecutive ranks")


def group_nodes(ranks: int, stride: int, gpus_per_node: int) -> int:
    """Nodes spanned by ``ranks`` ranks at ``stride`` on nodes of ``gpus_per_node`` GPUs (count)."""
    if ranks <= 1:
        return 1
    if stride >= gpus_per_node:
        return ranks
    return -(-(stride * ranks) // gpus_per_node)


def placement(strategy: Strategy, gpus_per_node: int) -> Placement:
    """Place ``strategy``'s groups on nodes of ``gpus_per_node`` GPUs (Megatron rank order)."""
    s, g = strategy, gpus_per_node

    def grp(ranks: int, stride: int) -> GroupPlacement:
        return GroupPlacement(ranks=ranks, nodes=group_nodes(ranks, stride, g))

    dpcp = grp(s.dp * s.cp, s.tp)
    shard = dpcp
    if s.fsdp == "hybrid" and dpcp.nodes > 1:
        shard = GroupPlacement(ranks=max(1, dpcp.ranks // dpcp.nodes), nodes=1)
    return Placement(tp=grp(s.tp, 1), cp=grp(s.cp, s.tp), dp=grp(s.dp, s.tp * s.cp), shard=shard,
                     grad_reduce=dpcp, pp=grp(s.pp, s.tp * s.cp * s.dp), gpus_per_node=g, ep=grp(s.ep, s.expert_tp),
                     etp=grp(s.expert_tp, 1))


def shard_ranks(strategy: Strategy, gpus_per_node: int) -> int:
    """Ranks of the ZeRO/FSDP sharding group (count): ``placement(strategy, gpus_per_node).shard.ranks`` without
    placing the other groups (memory asks for it several times per candidate)."""
    dpcp = strategy.dp * strategy.cp
    if strategy.fsdp == "hybrid":
        nodes = group_nodes(dpcp, strategy.tp, gpus_per_node)
        if nodes > 1:
            return max(1, dpcp // nodes)
    return dpcp


def placement_notes(strategy: Strategy, cluster: Cluster) -> tuple[str, ...]:
    """A note when the tensor-parallel group spans nodes: its per-layer collectives then run over the
    inter-node link (``comm.link_for``: the NICs of the group's GPUs in one node together), which Megatron-LM
    allows but the search never proposes (the vTrain study measured tp 16 on 8-GPU nodes)."""
    tp = placement(strategy, cluster.gpus_per_node).tp
    if tp.nodes <= 1:
        return ()
    per_node = -(-tp.ranks // tp.nodes)
    nic_gb = per_node * cluster.inter_node_bandwidth_bytes_per_s / 1e9
    return (f"placement: tensor parallelism over {tp.ranks} GPUs spans {tp.nodes} nodes of "
            f"{cluster.gpus_per_node}: its per-layer collectives are priced over the inter-node link "
            f"({per_node} x {cluster.inter_node_bandwidth_bytes_per_s / 1e9:.0f} GB/s = {nic_gb:.0f} GB/s per node "
            f"instead of {cluster.gpu.intra_node_bandwidth_bytes_per_s / 1e9:.0f} GB/s inside one); the search "
            f"keeps tp <= {cluster.gpus_per_node}",)


def layers_per_stage(layers: int, pp: int) -> int:
    """Blocks on the most loaded pipeline rank: ceil(L / p) (Megatron requires L % p == 0; uneven
    splits put the extra block on some ranks, and the worst rank is what memory must hold)."""
    return -(-layers // pp)
