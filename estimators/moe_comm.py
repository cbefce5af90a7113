"""An MoE layer's communication and expert-weight traffic per micro-batch: the token dispatcher's all-to-alls, the
expert tensor-parallel gather and scatter, and the tensor-parallel collectives an MoE layer does without (seconds).

Megatron-Core's ``MoEAlltoAllTokenDispatcher`` (``megatron/core/transformer/moe/token_dispatcher.py``; MoE
parallel folding, Liu et al. 2025 arXiv 2504.14960 §3): with sequence parallelism each tensor-parallel rank
routes its own s/tp tokens. Dispatch: permute, all-to-all over the ep group, then with an expert tensor-parallel
size etp > 1 an all-gather of the received tokens over the etp group (``gather_from_sequence_parallel_region``:
every etp rank holds a 1/etp slice of each local expert, so each needs every token routed to the group). Combine:
the reverse (reduce-scatter over etp, then the all-to-all back). The MoE layer takes the sequence-parallel input
as it is, so the dense MLP's tensor-parallel all-gather and reduce-scatter (Shoeybi et al. 2019 §3, comm.py's
``TP_COLLECTIVES_PER_PASS``) are not run for a layer without shared experts; shared experts are tensor-parallel
like a dense MLP (Megatron's ``SharedExpertMLP``) and keep them. The flex dispatcher (DeepEP,
``MoEFlexTokenDispatcher``) instead dispatches over the combined etp·ep group (``tp_ep_group``, "TPxEP > 1"), with
no separate etp gather: its all-to-all is priced over etp·ep ranks.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.comm import INTER_NODE_ALPHA_S, Link, all_to_all_s, ring_all_gather_s
from optplan.estimators.compute import GpuEfficiency
from optplan.estimators.efficiency import LINK_EFFICIENCY
from optplan.estimators.expert_parallel import DEEPEP_NIC_FRACTION, node_dedup_factor
from optplan.estimators.hardware import Cluster
from optplan.estimators.moe import expert_mlp_params
from optplan.estimators.parallel import group_nodes
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy

MOE_A2A_PER_PASS = 2
"""All-to-alls per MoE layer and pass (forward, backward, recomputed forward): dispatch and combine
(Megatron-Core ``MoEAlltoAllTokenDispatcher``; Lepikhin et al. 2020 GShard, arXiv 2006.16668 §2.2)."""

ETP_COLLECTIVES_PER_PASS = 2
"""Expert tensor-parallel collectives per MoE layer and pass when etp > 1: the all-gather of the dispatched
tokens and the reduce-scatter of the combined ones (Megatron-Core ``MoEAlltoAllTokenDispatcher``)."""


class MoeLayerComm(BaseModel):
    """One MoE layer's dispatcher traffic for one micro-batch, spread over every layer by the MoE layers' share."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dispatch_pass_s: float = Field(ge=0, description="all-to-alls and expert tensor-parallel gather/scatter of one "
                                                     "pass (s)")
    expert_weight_read_s: float = Field(ge=0, description="reads of local experts' weights beyond the active ones, "
                                                          "every pass (s)")
    mlp_tp_collectives_skipped: float = Field(ge=0, description="tensor-parallel collectives per pass the MoE layers "
                                                                "do not run (their dense-MLP pair; per layer)")


def moe_layer_comm(profile: ModelProfile, s_: Strategy, cluster: Cluster, eff: GpuEfficiency, etp_link: Link,
                   tokens: float, elem: int, hbm_bytes_per_s: float) -> MoeLayerComm:
    """The MoE layers' share of one layer's dispatcher time per micro-batch (see the module docstring).

    - Dispatch and combine (:data:`MOE_A2A_PER_PASS` per pass) of a rank's tokens' topk copies of h, when the
      experts are split (ep > 1), priced by ``comm.all_to_all_s`` over the expert-parallel group (ranks at stride
      etp), times the stated imbalance (the busiest rank receives more). Exposed in full (Megatron-Core's default)
      unless the plan overlaps them (``ep_overlap``: estimators/ep_overlap.py, priced by the caller).
    - With etp > 1 (the alltoall dispatcher), :data:`ETP_COLLECTIVES_PER_PASS` ring collectives of the received copies over the etp group
      (``comm.ring_all_gather_s`` of etp × the copies: (etp − 1) × copies × h × bytes over the link).
    - Grouped GEMMs: every local expert's slice (1/etp) of weights is read in each pass, however few tokens it
      gets; the dense roofline of the profile's active width reads only topk + shared experts' worth, so the
      rest is added as memory time (small per-expert GEMMs are bound by their weight reads: Megatron-Core's
      grouped GEMM runs every local expert in one kernel, the roofline's memory side). The expert GEMMs are
      priced at the dense-equivalent shape split by tp, not by etp.
    Units: seconds; ``tokens`` per micro-batch and context-parallel rank, ``elem`` bytes per activation element.
    """
    shape = profile.transformer
    if shape is None or shape.moe is None:
        return MoeLayerComm(dispatch_pass_s=0.0, expert_weight_read_s=0.0, mlp_tp_collectives_skipped=0.0)
    moe = shape.moe
    share = moe.moe_layers(shape.layers) / shape.layers
    passes = 3 if s_.checkpointing in ("full", "moe") else 2
    etp = s_.expert_tp
    copies = tokens * moe.topk * shape.hidden * elem / (s_.tp if s_.sp else 1) * moe.imbalance
    dispatch = 0.0
    deepep = s_.dispatcher == "deepep"
    if deepep and etp > 1:  # the flex dispatcher's tp_ep group: etp·ep consecutive ranks, no etp gather
        ranks, stride, etp_gather = s_.ep * etp, 1, False
    else:
        ranks, stride, etp_gather = s_.ep, etp, etp > 1
    nodes = group_nodes(ranks, stride, cluster.gpus_per_node)
    if ranks > 1:
        per_node = min(ranks, max(1, cluster.gpus_per_node // stride)) if nodes > 1 else ranks
        dedup = node_dedup_factor(moe.experts, moe.topk, nodes) if deepep else 1.0
        one = all_to_all_s(copies, ranks, per_node, cluster.gpu.intra_node_bandwidth_bytes_per_s *
                           eff.intra_node_link_fraction, cluster.inter_node_bandwidth_bytes_per_s *
                           (DEEPEP_NIC_FRACTION if deepep else LINK_EFFICIENCY),
                           INTER_NODE_ALPHA_S if nodes > 1 else eff.intra_node_alpha_s, inter_scale=dedup,
                           peers_at_once=deepep)
        dispatch += MOE_A2A_PER_PASS * one
    if etp_gather:
        dispatch += ETP_COLLECTIVES_PER_PASS * ring_all_gather_s(copies * etp, etp, etp_link.bandwidth_bytes_per_s,
                                                                 etp_link.alpha_s)
    skipped = share if (s_.tp > 1 and s_.sp and moe.shared_experts == 0) else 0.0
    idle = max(0.0, moe.experts / s_.ep - moe.topk)
    weight_bytes = idle * expert_mlp_params(shape.hidden, moe.moe_ffn, shape.gated) / etp * elem
    return MoeLayerComm(dispatch_pass_s=share * dispatch, expert_weight_read_s=share * passes * weight_bytes
                        / hbm_bytes_per_s, mlp_tp_collectives_skipped=skipped)
