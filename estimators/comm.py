"""Collective communication times in the alpha-beta model (seconds).

Source: Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA 19(1)), ring algorithms: all-reduce of S bytes over n ranks moves 2(n−1)/n·S per rank
in 2(n−1) steps; reduce-scatter and all-gather move (n−1)/n·S in (n−1) steps. NCCL reports the same
"bus bandwidth" normalisation (nccl-tests PERFORMANCE.md). Bandwidths are bytes/s per GPU, one way;
alpha is the per-step latency in seconds.
"""

from __future__ import annotations

from optplan.estimators.hardware import Cluster

LINK_EFFICIENCY = 0.75
"""Achieved bus bandwidth / datasheet link bandwidth (stated default: nccl-tests all-reduce busbw on
H100 NVLink4 reaches ~340-370 of 450 GB/s); probes calibrate it later."""
INTRA_NODE_ALPHA_S = 5e-6
INTER_NODE_ALPHA_S = 15e-6


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


def data_parallel_link(cluster: Cluster, ranks: int) -> tuple[float, float]:
    """(achieved bandwidth bytes/s, alpha s) of the slowest link a ring over ``ranks`` GPUs crosses.

    Ranks are placed node by node, so a group that fits in one node uses the intra-node link.
    """
    if ranks <= cluster.gpus_per_node:
        return cluster.gpu.intra_node_bandwidth_bytes_per_s * LINK_EFFICIENCY, INTRA_NODE_ALPHA_S
    bw = min(cluster.gpu.intra_node_bandwidth_bytes_per_s, cluster.inter_node_bandwidth_bytes_per_s)
    return bw * LINK_EFFICIENCY, INTER_NODE_ALPHA_S
