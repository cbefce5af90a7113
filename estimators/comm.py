"""Collective and point-to-point communication times in the alpha-beta model (seconds).

Sources
- Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in MPICH"
  (IJHPCA 19(1)), ring algorithms: all-reduce of S bytes over n ranks moves 2(n−1)/n·S per rank in
  2(n−1) steps; reduce-scatter and all-gather move (n−1)/n·S in (n−1) steps; each step costs a latency
  α (the alpha-beta model: time = steps·α + bytes/β). NCCL reports the same "bus bandwidth"
  normalisation (nccl-tests PERFORMANCE.md). Point-to-point: S/β + α.
- Link by placement (parallel.py): a group inside one node uses the intra-node link (NVLink/NVSwitch or
  PCIe, the catalogue's per-GPU one-way figure); a group spanning nodes is limited by the slower of the
  intra-node link and the cluster's per-GPU inter-node bandwidth (InfiniBand/Ethernet). Achieved bus
  bandwidth = a fraction of the datasheet figure (``LINK_EFFICIENCY`` by default; fitted per GPU in
  compute.py's efficiency table for the intra-node link).
- Tensor parallelism (Shoeybi et al. 2019, arXiv 1909.08053 §3; Korthikanti et al. 2022, arXiv
  2205.05198 §4.2.2): per layer two all-reduces of the s·b·h activation in forward and two in backward
  (f and g operators of the attention and MLP blocks); with sequence parallelism each all-reduce becomes
  a reduce-scatter + all-gather of the same total volume.
- Context parallelism (ring attention, Liu et al. 2023, arXiv 2310.01889; Megatron-Core context
  parallel): each rank passes its K/V chunk around the ring, cp−1 steps per layer in forward; backward
  passes K/V again and their gradients (dK, dV): 2× the forward volume. Each step overlaps with the
  attention on the chunk already received.
- Pipeline parallelism (Narayanan et al. 2021, arXiv 2104.04473 §2.2): per micro-batch and stage
  boundary the s·b·h activation is sent forward and its gradient backward (point-to-point).
Bandwidths are bytes/s per GPU, one way; alpha is seconds; sizes are bytes.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.efficiency import INTRA_NODE_ALPHA_S, LINK_EFFICIENCY
from optplan.estimators.hardware import Cluster
from optplan.estimators.parallel import GroupPlacement

INTER_NODE_ALPHA_S = 15e-6
DDP_BUCKET_BYTES = 25 * 2**20
"""torch DDP's gradient bucket (``bucket_cap_mb=25``, torch.nn.parallel.DistributedDataParallel docs)."""


class Link(BaseModel):
    """A link as the alpha-beta model sees it: achieved bytes/s per GPU one way, seconds per step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bandwidth_bytes_per_s: float = Field(gt=0)
    alpha_s: float = Field(ge=0)
    inter_node: bool = False


def ring_all_reduce_s(size_bytes: float, ranks: int, bandwidth_bytes_per_s: float, alpha_s: float) -> float:
    """Ring all-reduce time: 2(n−1)/n · S / B + 2(n−1)·α (seconds). Zero for one rank."""
    if ranks <= 1 or size_bytes <= 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * size_bytes / bandwidth_bytes_per_s + 2 * (ranks - 1) * alpha_s


def ring_reduce_scatter_s(size_bytes: float, ranks: int, bandwidth_bytes_per_s: float,
                          alpha_s: float) -> float:
    """Ring reduce-scatter (or all-gather) of S bytes: (n−1)/n · S / B + (n−1)·α (seconds)."""
    if ranks <= 1 or size_bytes <= 0:
        return 0.0
    return (ranks - 1) / ranks * size_bytes / bandwidth_bytes_per_s + (ranks - 1) * alpha_s


ring_all_gather_s = ring_reduce_scatter_s


def tree_all_reduce_s(size_bytes: float, ranks: int, bandwidth_bytes_per_s: float, alpha_s: float) -> float:
    """Double-binary-tree all-reduce (NCCL 2.4+, Sanders, Speck & Träff 2009 "Two-tree algorithms for full
    bandwidth broadcast, reduction and scan", Parallel Computing 35(12)): each rank sends and receives
    about 2·S (reduce up, broadcast down, pipelined over the two trees) in 2·ceil(log2 n) latency steps:
    2 · S / B + 2·ceil(log2 n)·α (seconds). Zero for one rank."""
    if ranks <= 1 or size_bytes <= 0:
        return 0.0
    return 2 * size_bytes / bandwidth_bytes_per_s + 2 * math.ceil(math.log2(ranks)) * alpha_s


def all_reduce_s(size_bytes: float, ranks: int, link: Link) -> float:
    """All-reduce as NCCL runs it (seconds): ring inside a node; across nodes NCCL's tuner picks the faster
    of ring and double binary tree (tree wins for small messages over many ranks, where the ring's
    2(n−1)·α latency dominates)."""
    ring = ring_all_reduce_s(size_bytes, ranks, link.bandwidth_bytes_per_s, link.alpha_s)
    if not link.inter_node:
        return ring
    return min(ring, tree_all_reduce_s(size_bytes, ranks, link.bandwidth_bytes_per_s, link.alpha_s))


def all_to_all_s(size_bytes: float, ranks: int, ranks_per_node: int, intra_bytes_per_s: float,
                 nic_bytes_per_s: float, alpha_s: float, *, inter_scale: float = 1.0,
                 peers_at_once: bool = False) -> float:
    """All-to-all of S bytes per rank (1/n of it to each rank, itself included) as n - 1 pairwise exchanges
    (NCCL's all-to-all: grouped send/recv), seconds. The share bound for ranks of the same node moves over the
    intra-node link, the rest over the rank's own NIC, concurrently; the slower decides (DeepSeek-V3 report,
    arXiv 2412.19437 §3.2.2: cross-node dispatch is bound by each GPU's InfiniBand bandwidth, intra-node by
    NVLink). ``ranks_per_node``: how many of the n ranks share a node. ``inter_scale`` scales the bytes that leave
    the node (a node-deduplicating dispatcher sends fewer: expert_parallel.node_dedup_factor). The latency is
    (n - 1)·α for NCCL's pairwise exchanges, one α when every peer is written at once (``peers_at_once``: DeepEP's
    kernels issue all NVLink/RDMA writes concurrently from their SMs; its V1 README measures a whole EP 64 dispatch
    of 7.4 MB in 173 µs, where 63 exchanges of 15 µs would take 945 µs alone). Zero for one rank."""
    if ranks <= 1 or size_bytes <= 0:
        return 0.0
    local = max(1, min(ranks, ranks_per_node))
    intra = (local - 1) / ranks * size_bytes / intra_bytes_per_s
    inter = (ranks - local) / ranks * size_bytes * inter_scale / nic_bytes_per_s if ranks > local else 0.0
    return max(intra, inter) + (1 if peers_at_once else ranks - 1) * alpha_s


def p2p_s(size_bytes: float, link: Link) -> float:
    """Point-to-point transfer of S bytes: S / B + α (seconds)."""
    if size_bytes <= 0:
        return 0.0
    return size_bytes / link.bandwidth_bytes_per_s + link.alpha_s


def link_for(group: GroupPlacement, cluster: Cluster, *, intra_fraction: float = LINK_EFFICIENCY,
             intra_alpha_s: float = INTRA_NODE_ALPHA_S) -> Link:
    """The link a ring over ``group`` runs at (bus bandwidth, bytes/s achieved; alpha seconds): intra-node
    when the group sits in one node; across nodes the slower of the intra-node link and the inter-node
    bandwidth of the group's GPUs in one node together. A ring (NCCL runs one channel per NIC, rail by
    rail) crosses each node boundary once per channel, so every byte of the collective leaves a node once
    over all the node's NICs the group uses: with g of the group's GPUs per node, each with its own NIC of
    B, the inter-node bus bandwidth is g·B (NCCL's multi-node busbw on DGX systems approaches the node's
    aggregate NIC bandwidth, not one NIC's; nccl-tests doc/PERFORMANCE.md defines busbw). A group with one
    GPU per node (data parallelism beside tp = 8) gets one NIC's B."""
    intra = cluster.gpu.intra_node_bandwidth_bytes_per_s
    if group.nodes <= 1:
        return Link.model_construct(bandwidth_bytes_per_s=intra * intra_fraction, alpha_s=intra_alpha_s,
                                    inter_node=False)
    local = -(-group.ranks // group.nodes)  # the group's GPUs per node, each with its own NIC (rails)
    bw = min(intra * intra_fraction, local * cluster.inter_node_bandwidth_bytes_per_s * LINK_EFFICIENCY)
    return Link.model_construct(bandwidth_bytes_per_s=bw, alpha_s=INTER_NODE_ALPHA_S, inter_node=True)


TP_COLLECTIVES_PER_PASS = 2
"""Tensor-parallel collectives per layer per pass (forward, backward, recomputed forward): Megatron's
attention and MLP blocks each all-reduce once (Shoeybi et al. 2019 §3, Fig. 3)."""


def tp_collective_s(tokens: float, hidden: int, elem_bytes: int, tp: int, link: Link, *, sp: bool) -> float:
    """One tensor-parallel collective on the tokens × hidden activation (seconds): a ring all-reduce, or
    with sequence parallelism a reduce-scatter + all-gather (same bandwidth term and step count)."""
    size = tokens * hidden * elem_bytes
    if sp:
        return 2 * ring_reduce_scatter_s(size, tp, link.bandwidth_bytes_per_s, link.alpha_s)
    return ring_all_reduce_s(size, tp, link.bandwidth_bytes_per_s, link.alpha_s)


def cp_ring_exchange_s(tokens_local: float, kv_hidden_local: float, elem_bytes: int, cp: int,
                       link: Link) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's context-parallel K/V ring: cp−1 point-to-point steps
    of the local K and V chunks (2 · tokens_local · kv_hidden_local elements) forward; backward moves
    K/V and dK/dV (twice the bytes) in as many steps."""
    if cp <= 1:
        return 0.0, 0.0
    chunk = 2 * tokens_local * kv_hidden_local * elem_bytes
    fwd = (cp - 1) * p2p_s(chunk, link)
    bwd = (cp - 1) * p2p_s(2 * chunk, link)
    return fwd, bwd


def exposed_s(comm_s: float, window_s: float) -> float:
    """Communication left on the critical path when it overlaps a compute window (seconds):
    max(0, comm − window) (perfect overlap up to the window; a stated simplification)."""
    return max(0.0, comm_s - window_s)
