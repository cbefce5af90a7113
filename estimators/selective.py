"""Selective checkpointing as the torch and DeepSpeed engines run it: the training loop's op-level policy
(probes/trainloop.py ``selective_context``, torchtitan's per-op selective AC: attention outputs and every other
matmul's output saved, the rest of each repeated block recomputed in backward).

The static profile measures both of its costs on the user's model: the activations it keeps (the ``selective``
activation fits, estimators/activations.py) and the forward FLOPs its backward re-runs
(``ModelProfile.selective_recompute_flops_per_sample``: FlopCounterMode's backward count with the policy less
without it; non-reentrant checkpointing stops recomputing once backward has every tensor it needs, so a block's
last matmul, whose output nothing in backward reads, is not re-run). For ``--arch`` shapes (estimators/arch.py)
both come from the dense layer's matmul order (:func:`saved_bytes_per_token`,
:func:`recompute_flops_per_token_layer`). Megatron-LM's selective recomputation is another mechanism (the attention
core only, Korthikanti et al. 2022 §5), priced from the shape.
"""

from __future__ import annotations

from optplan.estimators.profile import ModelProfile, TransformerShape
from optplan.estimators.strategy import Strategy

LSE_BYTES_PER_HEAD = 4
"""The attention kernel's saved log-sum-exp: one fp32 value per head and token (FlashAttention-2's backward input)."""

SELECTIVE_FIT_ENGINES = frozenset({"torch", "deepspeed"})
"""Engines whose selective recomputation is the training loop's op-level policy (the user's model run by optplan's
train.py or probes: torch alone, FSDP2, DDP, ``deepspeed.initialize``)."""


def runs_op_policy(strategy: Strategy) -> bool:
    """Whether ``strategy`` checkpoints selectively with the training loop's op-level policy."""
    return strategy.checkpointing == "selective" and strategy.engine in SELECTIVE_FIT_ENGINES


def recompute_flops_per_sample(profile: ModelProfile, strategy: Strategy) -> float | None:
    """The forward FLOPs per sample (whole model, one GPU's view before any split) that the op-level policy
    re-runs in backward: measured for a model file, from :func:`recompute_flops_per_token_layer` for an ``--arch``
    shape; None when the strategy does not run the policy or the profile has no figure (then selective
    recomputation is priced as the attention core, Megatron's)."""
    if not runs_op_policy(strategy):
        return None
    return profile.selective_recompute_flops_per_sample


def _widths(shape: TransformerShape) -> tuple[int, int, int, int]:
    """(hidden, query/attention-output width, key/value width, MLP width) of a dense layer (elements)."""
    h = shape.hidden
    q = round(shape.heads * (shape.head_dim or h / shape.heads))
    return h, q, shape.kv_dim, shape.ffn or 4 * h


def saved_bytes_per_token(shape: TransformerShape) -> tuple[float, float] | None:
    """(bytes split by tensor parallelism, bytes on every tensor-parallel rank, or split by sequence parallelism)
    that one dense layer keeps per token under the op-level policy with 16-bit activations and a fused attention
    kernel; None for MoE and latent-attention layers (no formula here).

    The layer's matmuls in execution order, every other output saved (torchtitan's rule): a gated (Llama) layer
    runs q, k, v, o, gate, up, down and keeps q, v, gate and down; a GPT layer runs a fused qkv, o, fc1, fc2 and
    keeps qkv and fc1. Both keep the block's input (the checkpoint's argument), the attention output and its fp32
    log-sum-exp. Column-parallel outputs and the attention output are split by t; the input and the down
    projection's (row-parallel) output are whole on every rank unless sequence parallelism splits them."""
    if shape.moe is not None or shape.mla is not None:
        return None
    h, q, kv, ffn = _widths(shape)
    if shape.gated:
        split, whole = q + kv + q + ffn, h + h
    else:
        split, whole = q + 2 * kv + q + ffn, h
    return 2.0 * split + LSE_BYTES_PER_HEAD * shape.heads, 2.0 * whole


def recompute_flops_per_token_layer(shape: TransformerShape) -> float | None:
    """Forward FLOPs per token that one dense layer's backward re-runs under the op-level policy (before any
    tensor-parallel split); None for MoE and latent-attention layers.

    Of the matmuls not saved (:func:`saved_bytes_per_token`), backward re-runs those whose outputs it needs, and
    non-reentrant checkpointing stops there: a gated layer re-runs k (the attention backward reads it), o (the
    residual sum the MLP's norm reads) and up (the SwiGLU product's backward reads it), not down; a GPT layer
    re-runs o only (fc2's output is read by nothing). Measured on a GPT model file: tests/probes/test_static_profile.py."""
    if shape.moe is not None or shape.mla is not None:
        return None
    h, q, kv, ffn = _widths(shape)
    return 2.0 * (h * kv + q * h + h * ffn) if shape.gated else 2.0 * q * h


def recomputed_tp_collectives(strategy: Strategy, tp_collectives: float) -> float:
    """Tensor-parallel collectives per layer that the op-level policy re-issues in backward, in units of
    ``comm.tp_collective_s`` (one all-reduce, or with sequence parallelism one reduce-scatter + all-gather);
    ``tp_collectives`` is the layer's count per pass (2, less an MoE layer's skipped MLP share).

    torchtitan's policy (``torchtitan/distributed/activation_checkpoint.py`` ``_get_default_save_ops``: matmuls,
    the SDPA kernels, ``_c10d_functional.reduce_scatter_tensor`` and ``all_to_all_single`` saved; the same list at
    the commits of its published H100 runs) does not save ``all_gather_into_tensor``: under sequence parallelism
    each sublayer's all-gather, whose output is the input its column-parallel matmuls' weight gradients read, is
    issued again when backward recomputes the block, half a ``tp_collective_s`` each. Without sequence parallelism
    the collectives are all-reduces, none saved: the attention's is re-run (the residual sum the MLP's norm reads
    comes after it), the MLP's is not (the block's output: non-reentrant checkpointing stops early,
    ``torch.utils.checkpoint``). Assumed: the torch engine's tensor-parallel plans run torchtitan's list (optplan's
    train.py runs no tensor parallelism); a policy that does not save the reduce-scatters (the aten-only
    ``probes/trainloop.py`` ``SAC_SAVE_OPS``) re-issues the attention's too, half a collective more.
    0 for plans that do not run the op-level policy, or without tensor parallelism."""
    if not runs_op_policy(strategy) or strategy.tp <= 1:
        return 0.0
    return tp_collectives / 2 if strategy.sp else min(1.0, tp_collectives)
