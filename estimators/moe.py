"""Mixture-of-Experts layers: what a sparse MLP holds and what one token computes.

An MoE layer (Shazeer et al. 2017, arXiv 1701.06538; the top-k softmax router of Mixtral, Jiang et al. 2024,
arXiv 2401.04088 §2.1) replaces the dense MLP by ``experts`` MLPs of width ``moe_ffn`` and a router (one
h × experts matrix, no bias) that sends each token to ``topk`` of them; DeepSeekMoE (Dai et al. 2024,
arXiv 2401.06066 §3) adds ``shared_experts`` MLPs of the same width that every token passes through, and keeps
the first ``first_dense`` layers dense (DeepSeek-V2/V3 ``first_k_dense_replace``); ``moe_every`` = N makes every
N-th layer sparse (Switch/GShard's alternation, Megatron ``--moe-layer-freq``), counted so that the last
layer of each group of N is the MoE one (the first N - 1 of a group dense).

Per MoE layer and token:
- parameters: experts · m · h · F_e + shared · m · h · F_e + h · experts (router), with m = 3 for a gated
  (SwiGLU) expert and 2 for a GeLU one (plus the GeLU expert's biases F_e + h each); attention and norms as a
  dense layer;
- computed: the router (2 · h · experts FLOPs forward) and (topk + shared) experts, i.e. the dense MLP's work
  at the *active* width (topk + shared) · F_e; in expectation over a balanced router every expert receives
  tokens · topk / experts tokens (the load-balancing loss's target, Fedus et al. 2022 arXiv 2101.03961
  §2.2); :data:`DEFAULT_IMBALANCE` states how much more the busiest expert gets;
- kept for backward: the expert MLPs' activations of the routed token copies (the dense MLP's at the active
  width), the router's logits and probabilities (2 · experts values of 4 bytes: routers run in fp32 in
  Megatron-Core and Hugging Face Mixtral), and the permuted token copies the dispatcher builds (topk · h).

Units: parameters (count), widths (elements), FLOPs, bytes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_IMBALANCE = 1.0
"""Tokens of the busiest expert ÷ the balanced share (stated default: training with an auxiliary balancing loss
or DeepSeek-V3's bias balancing keeps the load near the mean; calibrate from measured runs)."""
ROUTER_BYTES_PER_EXPERT = 8
"""Router activations kept per token and expert: fp32 logits and fp32 probabilities (bytes)."""


class MoeShape(BaseModel):
    """The sparse layers of a transformer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    experts: int = Field(ge=2, description="routed experts per MoE layer")
    topk: int = Field(ge=1, description="experts each token is routed to")
    moe_ffn: int = Field(ge=1, description="width of one expert's MLP (elements)")
    shared_experts: int = Field(default=0, ge=0, description="experts every token passes through (DeepSeekMoE)")
    moe_every: int = Field(default=1, ge=1, description="every N-th layer is sparse")
    first_dense: int = Field(default=0, ge=0, description="leading layers kept dense")
    dense_ffn: int | None = Field(default=None, ge=1, description="MLP width of the dense layers (None: no dense "
                                                                 "layer, or unknown)")
    imbalance: float = Field(default=DEFAULT_IMBALANCE, ge=1.0, description="busiest expert's tokens ÷ the mean")

    @model_validator(mode="after")
    def _check(self) -> MoeShape:
        if self.topk > self.experts:
            raise ValueError(f"topk {self.topk} is more than the {self.experts} experts")
        return self

    def moe_layers(self, layers: int) -> int:
        """How many of ``layers`` are sparse (count)."""
        rest = max(0, layers - self.first_dense)
        return rest // self.moe_every

    def active_ffn(self) -> int:
        """The MLP width one token computes through in an MoE layer: (topk + shared) · moe_ffn (elements)."""
        return (self.topk + self.shared_experts) * self.moe_ffn


def expert_mlp_params(hidden: int, width: int, gated: bool) -> int:
    """Parameters of one expert MLP: gated 3 · h · F (no biases, Llama/Mixtral style), else 2 · h · F + F + h
    (GeLU with biases, GPT style). Count."""
    return 3 * hidden * width if gated else 2 * hidden * width + width + hidden


def moe_layer_mlp_params(moe: MoeShape, hidden: int, gated: bool) -> int:
    """An MoE layer's MLP part: routed and shared experts and the router (h · experts, no bias). Count."""
    per_expert = expert_mlp_params(hidden, moe.moe_ffn, gated)
    return (moe.experts + moe.shared_experts) * per_expert + hidden * moe.experts


def routed_expert_params(moe: MoeShape, hidden: int, gated: bool, layers: int) -> int:
    """Parameters of the routed experts of every MoE layer: what expert parallelism divides. Count."""
    return moe.moe_layers(layers) * moe.experts * expert_mlp_params(hidden, moe.moe_ffn, gated)


def mean_active_ffn(moe: MoeShape, dense_ffn: int, layers: int) -> float:
    """The per-layer mean of the MLP width a token computes through: dense layers at ``dense_ffn``, MoE layers at
    (topk + shared) · moe_ffn. FLOPs and stored activations are linear in the width, so a model of ``layers``
    dense layers at this width computes and keeps what the MoE model does (elements)."""
    sparse = moe.moe_layers(layers)
    return ((layers - sparse) * dense_ffn + sparse * moe.active_ffn()) / layers


def router_flops_per_token(moe: MoeShape, hidden: int, layers: int) -> float:
    """Forward FLOPs of every router for one token: 2 · h · experts per MoE layer."""
    return 2.0 * hidden * moe.experts * moe.moe_layers(layers)


def moe_extra_bytes_per_token(moe: MoeShape, hidden: int, elem_bytes: int) -> float:
    """Activation bytes an MoE layer keeps per token beyond its experts' MLP activations: router logits and
    probabilities (:data:`ROUTER_BYTES_PER_EXPERT` per expert) and the topk permuted copies of the token's
    hidden state the dispatcher hands the experts (``elem_bytes`` each)."""
    return ROUTER_BYTES_PER_EXPERT * moe.experts + moe.topk * hidden * elem_bytes


def moe_note(moe: MoeShape, layers: int) -> str:
    """The profile note that states an MoE shape and how it is priced."""
    return (f"MoE: {moe.moe_layers(layers)} of {layers} layers route each token to {moe.topk} of {moe.experts} experts "
            f"(width {moe.moe_ffn}{f', + {moe.shared_experts} shared' if moe.shared_experts else ''}); FLOPs and "
            f"activations by the tokens routed (balanced router: imbalance {moe.imbalance:g} stated, not measured); "
            "expert parallelism (--ep, Megatron) divides the routed experts, its all-to-all priced from the links; "
            "grouped-GEMM efficiency as weight reads")
