"""Recomputing the MoE layers (Megatron-LM ``--recompute-granularity selective --recompute-modules moe``): what it
saves and what it re-runs.

Megatron-Core checkpoints each MoE layer's input and re-runs the layer (router, token permutation and dispatch,
the experts' grouped GEMMs, combine) in backward (``megatron/core/transformer/moe/moe_layer.py``, the ``moe``
entry of ``--recompute-modules``, ``megatron/training/arguments.py``); attention keeps its activations. So:

- memory: an MoE layer keeps its input (already counted among the layer's inputs) but not its experts' MLP
  activations (gated: gate, up, activation and product outputs, 8·F bytes per token at 16 bits; GPT: 4·F, with F
  the layer's active width (topk + shared)·moe_ffn, Korthikanti et al. 2022 §4.1 generalised as in
  profile.TransformerShape.layer_bytes_per_token) nor its router and dispatch bytes (estimators/moe.py
  ``moe_extra_bytes_per_token``);
- time: the MoE layers' MLP forward runs twice (its share of the layer's MLP time) and their dispatch and
  combine all-to-alls run a third time (timing.py).

The Megatron MoE model zoo runs Qwen3-235B at 16k-128k tokens this way (``--recompute-modules layernorm moe``):
recomputing whole layers there re-runs the long-context attention, which dominates. Units: bytes per token,
dimensionless shares.
"""

from __future__ import annotations

from optplan.estimators.moe import moe_extra_bytes_per_token
from optplan.estimators.profile import TransformerShape


def moe_mlp_share(shape: TransformerShape) -> float:
    """The MoE layers' part of the model's MLP FLOPs (dimensionless, 0-1): sparse layers x their active width ÷
    layers x the shape's mean active width (``shape.ffn``); 0 for a dense shape."""
    moe = shape.moe
    if moe is None or not shape.ffn:
        return 0.0
    sparse = moe.moe_layers(shape.layers)
    return min(1.0, sparse * moe.active_ffn() / (shape.layers * shape.ffn))


def saved_bytes_per_token(shape: TransformerShape) -> float:
    """Activation bytes per token and layer (averaged over every layer, 16-bit) that recomputing the MoE layers
    does not keep: their experts' MLP outputs and their router and dispatch bytes."""
    moe = shape.moe
    if moe is None:
        return 0.0
    share = moe.moe_layers(shape.layers) / shape.layers
    mlp = (8 if shape.gated else 4) * moe.active_ffn()
    return share * (mlp + moe_extra_bytes_per_token(moe, shape.hidden, 2))
