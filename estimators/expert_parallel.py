"""Expert parallelism: which parameters the expert-parallel ranks split, and what each rank keeps.

Megatron-Core (``megatron/core/transformer/moe``, "MoE parallel folding", Liu et al. 2025 arXiv 2504.14960 §3):
the routed experts of every MoE layer are divided over ``ep`` ranks, each expert further split by the expert
tensor-parallel size etp, which defaults to ``tp`` (``Strategy.expert_tp``): with etp = tp the expert group is
carved out of the data-parallel (x context) group, with etp < tp it folds over the tensor-parallel ranks (ep·etp
divides tp·dp·cp). The router, shared experts, attention and the rest stay as in a dense model. The distributed
optimizer shards the dense states over the dp·cp ranks and the expert states over the expert-data-parallel ranks
tp·dp·cp/(ep·etp), so a rank holds dense/tp + experts/(ep·etp) weights and gradients unsharded, and
(dense + experts)/(tp·dp·cp) of anything sharded: expert parallelism shrinks the unsharded states only.
Units: parameter counts.
"""

from __future__ import annotations

from math import comb

from optplan.estimators.moe import routed_expert_params
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy


def routed_params(profile: ModelProfile) -> int:
    """The routed experts' parameters of the whole model (count; 0 without MoE layers)."""
    shape = profile.transformer
    if shape is None or shape.moe is None:
        return 0
    return routed_expert_params(shape.moe, shape.hidden, shape.gated, shape.layers)


def expert_params_not_held(profile: ModelProfile, strategy: Strategy, stage_share: float) -> float:
    """Of a rank's tensor-parallel share of the routed experts on its pipeline stage (``stage_share``: the
    stage's fraction of the layers; routed/tp), the part it does not hold because the experts are split over
    ep·etp ranks instead (count): routed·share·(1/tp - 1/(ep·etp)); negative when etp·ep < tp (each expert on
    more ranks than the dense layers' split)."""
    if strategy.ep == 1 and strategy.expert_tp == strategy.tp:
        return 0.0
    return routed_params(profile) * stage_share * (1 / strategy.tp - 1 / (strategy.ep * strategy.expert_tp))


DEEPEP_NIC_FRACTION = 0.86
"""Share of a GPU's NIC line rate DeepEP's normal (training) kernels move across nodes: 43-51 GB/s of RDMA
"bottleneck bandwidth" at EP 16-64 on H800s with one 400 Gb/s CX7 NIC (~50 GB/s) each (DeepEP's V1 README
table, docs/legacy.md "Normal kernels with NVLink and RDMA forwarding"); the lowest, EP 16's 43/50, is taken.
NCCL's all-to-all keeps the general LINK_EFFICIENCY (efficiency.py). Dimensionless."""
DEEPEP_GPUS = ("H100-SXM", "H200", "B200")
"""GPUs DeepEP's internode kernels run on: Hopper (DeepEP README: NVLink + RDMA, SM90 features) and Blackwell
(HybridEP, Megatron-Core's flex dispatcher backend for it); the PCIe H100 has no NVLink domain to forward over."""


def node_dedup_factor(experts: int, topk: int, nodes: int) -> float:
    """Bytes a node-deduplicating dispatcher sends across nodes ÷ what an all-to-all of every routed copy sends
    (dimensionless; 1 inside one node).

    DeepEP (DeepSeek-V3 report, arXiv 2412.19437 §3.2.2: "each token is dispatched to at most 4 nodes ... once
    it reaches the target node, ... instantly forwarded via NVLink"; DeepEP's internode kernels) sends a token
    once to each remote node that holds any of its top-k experts. With the experts spread evenly over the expert
    group's n nodes (E/n each) and routing uniform (balanced), a given remote node holds none of a token's k
    experts with probability C(E - E/n, k) / C(E, k), so E[remote nodes] = (n - 1)·(1 - C(E - E/n, k)/C(E, k)),
    against k·(n - 1)/n copies leaving the node under an all-to-all of every copy. Node-limited routing (a
    router that caps the nodes per token) would cut it further; it is not modelled."""
    if nodes <= 1 or topk < 1 or experts < topk:
        return 1.0
    per_node = experts // nodes
    miss = comb(experts - per_node, topk) / comb(experts, topk)
    remote_nodes = (nodes - 1) * (1 - miss)
    return remote_nodes / (topk * (nodes - 1) / nodes)
