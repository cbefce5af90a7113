"""Context parallelism as torch runs it: the costs of torch's ring attention beyond its attention kernels (seconds,
bytes).

torch plans split the sequence with ``torch.distributed.tensor.experimental.context_parallel`` (what torchtitan,
accelerate's FSDP2 ``maybe_context_parallel`` and optplan's torch exports run). Inside it every
``scaled_dot_product_attention`` call becomes a ring of ``cp`` sub-attentions on the local queries against each
rank's keys and values, written in Python around the fused kernel. Source: torch/distributed/tensor/experimental/
_attention.py (torch 2.6-2.8: ``_templated_ring_attention``, ``_templated_ring_attention_backward``,
``_SDPAMerger``, ``_AllGatherRotater``, ``_partial_update``; its defaults ``_ContextParallelOptions``:
``convert_to_f32=True``, ``enable_load_balance=True``, ``rotate_method=ALL_GATHER``). With load balancing every
rank holds two chunks of the sequence and every sub-attention does the same work, so the kernels' FLOPs are the
causal attention's ÷ cp (compute.py prices them). What the ring adds, per layer and micro-batch on one rank:

- Forward: the keys and values of every rank are all-gathered once, issued before the first sub-attention and
  awaited after it (``_AllGatherRotater``): the gather hides behind one of the ``cp`` sub-attentions only. Every
  step but the last concatenates the local K and V for the send (``torch.cat``). Each sub-attention's output is
  merged into a running fp32 output by its logsumexp (``_SDPAMerger``: an upcast, then ``out − sigmoid(lse_b −
  lse)·(out − out_b)``: three element-wise passes over the fp32 output); the result is cast back at the end.
- Backward: the keys and values are all-gathered again (hidden behind one sub-backward); dK and dV accumulate in
  fp32 and travel the ring after every sub-backward (``permute_tensor``: point-to-point), each transfer awaited
  after the next sub-backward, the last one at the end (exposed); dQ accumulates in fp32; the balanced ranks'
  half-chunk updates re-concatenate the fp32 gradients (``_partial_update``).
- K and V travel as the attention call receives them: a model that repeats its key/value heads to every query
  head before calling SDPA (torchtitan's Llama 3, transformers' ``repeat_kv`` path) exchanges and accumulates
  ``heads`` of them, not ``kv_heads`` (``ModelProfile.attention_key_heads``).

Memory-bound bytes count each operator's reads and writes (the roofline's memory side, Williams et al. 2009,
CACM 52(4)), for the slowest rank (the last: every later step updates its first key chunk and its whole query). The
transfers use the alpha-beta model of comm.py. Megatron-Core's context parallelism (Transformer Engine's ring in
CUDA streams, native K/V heads) stays comm.py's ``cp_ring_exchange_s``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.comm import Link, p2p_s, ring_all_gather_s
from optplan.estimators.compute import TransformerDims
from optplan.estimators.strategy import Strategy

FP32_BYTES = 4
"""Bytes of the fp32 running output and gradient accumulators (``convert_to_f32``)."""


class RingAttentionTime(BaseModel):
    """torch's ring attention beyond its kernels, one layer and micro-batch on one rank (seconds, bytes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fwd_comm_s: float = Field(ge=0, description="forward K/V all-gather")
    fwd_exposed_s: float = Field(ge=0, description="the part of it one sub-attention does not hide")
    bwd_comm_s: float = Field(ge=0, description="backward K/V all-gather and the dK/dV ring")
    bwd_exposed_s: float = Field(ge=0, description="the part of them the sub-backwards do not hide")
    fwd_memory_bytes: float = Field(ge=0, description="bytes the forward's merges and concatenations move")
    bwd_memory_bytes: float = Field(ge=0, description="bytes the backward's accumulations and concatenations move")


LSE_MERGE_BYTES = 60
"""Bytes per fp32 logsumexp element of one merge: three subtractions (12 each), the sigmoid (8), the log-sigmoid
(12, its buffer included) and the product's broadcast read (4); counted on torch's merge by
benchmarks/fidelity_ring_attention_cpu.py."""


def ring_attention_time(*, tokens_local: float, query_heads: float, value_head_dim: float, key_heads: float,
                        key_head_dim: float, elem_bytes: int, cp: int, link: Link, core_fwd_s: float,
                        core_bwd_s: float) -> RingAttentionTime:
    """The ring's transfers (seconds; module docstring) and memory-bound bytes for one layer and micro-batch.

    ``tokens_local``: the rank's tokens of the micro-batch (b·s/cp); ``query_heads``: query heads on this rank, each
    with an output of ``value_head_dim``; ``key_heads``: the key heads the attention call receives on this rank, of
    ``key_head_dim`` (V's alike); ``elem_bytes``: K, V and the output's element size; ``core_fwd_s``/``core_bwd_s``:
    the attention kernels' forward and backward time of the layer (all ``cp`` sub-attentions). The bytes are the
    heaviest rank's: in forward the last (every later step merges its whole output), in backward the first (every
    later step updates half its dQ) or the last (half its dK and dV), whichever moves more. Zero for ``cp`` <= 1."""
    if cp <= 1:
        return RingAttentionTime(fwd_comm_s=0.0, fwd_exposed_s=0.0, bwd_comm_s=0.0, bwd_exposed_s=0.0,
                                 fwd_memory_bytes=0.0, bwd_memory_bytes=0.0)
    e, f = elem_bytes, FP32_BYTES
    lse_el = tokens_local * query_heads  # fp32 logsumexp: one per query head and token
    out_el, kv_el = lse_el * value_head_dim, tokens_local * key_heads * key_head_dim
    kv_bytes = 2 * kv_el * e  # the local K and V
    gather = ring_all_gather_s(cp * kv_bytes, cp, link.bandwidth_bytes_per_s, link.alpha_s)
    fwd_window, bwd_window = core_fwd_s / cp, core_bwd_s / cp  # one sub-attention, one sub-backward
    dkv_step = p2p_s(2 * kv_el * f, link)  # dK and dV in fp32, one ring step
    fwd_exposed = max(0.0, gather - fwd_window)
    bwd_exposed = max(0.0, gather - bwd_window) + (cp - 1) * max(0.0, dkv_step - bwd_window) + dkv_step

    send_cat = (cp - 1) * 2 * kv_bytes  # torch.cat of K and V before every send: read + write
    merge = (e + f) * out_el + 8 * f * out_el + LSE_MERGE_BYTES * lse_el  # upcast, then 3 fp32 passes (32 B/element)
    fwd_bytes = send_cat + (cp - 1) * merge + 2 * (e + f) * out_el  # the later merges; the first upcast, last cast
    add = 2 * f + e  # accumulator += the step's gradient: read fp32 + elem, write fp32 (bytes per element)
    half_update = (f + e / 2) + 2 * f  # += on one half, then torch.cat of the whole (read + write fp32)
    bwd_bytes = (send_cat
                 + f * (out_el + 2 * kv_el)  # zero-filled fp32 dQ, dK, dV
                 + add * (out_el + 2 * kv_el)  # the first step's accumulation
                 + cp * 2 * 2 * f * kv_el  # torch.cat of dK and dV before every send: read + write
                 + (f + e) * (out_el + 2 * kv_el)  # the final casts of dQ, dK, dV
                 + (cp - 1) * max(add * out_el + half_update * 2 * kv_el,  # the last rank's later steps
                                  half_update * out_el + add * 2 * kv_el + f * lse_el))  # the first rank's
    return RingAttentionTime(fwd_comm_s=gather, fwd_exposed_s=fwd_exposed, bwd_comm_s=gather + cp * dkv_step,
                             bwd_exposed_s=bwd_exposed, fwd_memory_bytes=fwd_bytes, bwd_memory_bytes=bwd_bytes)


def torch_ring_attention(dims: TransformerDims, strategy: Strategy, elem_bytes: int, link: Link, core_fwd_s: float,
                         core_bwd_s: float) -> RingAttentionTime:
    """:func:`ring_attention_time` of one layer of ``dims`` under ``strategy`` (its micro-batch, tensor and context
    parallelism): the query heads on a rank × the value head width, the key heads the attention call receives
    (``attention_key_heads``, else the model's key/value heads) × the key head width."""
    t, c = strategy.tp, strategy.cp
    d = dims.hidden / dims.heads
    return ring_attention_time(tokens_local=strategy.mbs * dims.seq / c, query_heads=dims.heads / t,
                               value_head_dim=dims.v_head_dim or d,
                               key_heads=(dims.attention_key_heads or dims.kv_heads) / t,
                               key_head_dim=dims.qk_head_dim or d, elem_bytes=elem_bytes, cp=c, link=link,
                               core_fwd_s=core_fwd_s, core_bwd_s=core_bwd_s)


def ring_attention_note(heads: int, kv_heads: int, attention_key_heads: int | None, cp: int) -> str:
    """The estimate's note for a torch plan with context parallelism: what its ring is priced as, the K/V heads it
    moves and where that figure comes from, and what measured runs say (benchmarks/fidelity_torchtitan.py)."""
    if attention_key_heads:
        moved = (f"the {attention_key_heads} key/value heads the model's attention call receives (measured"
                 + (": it repeats its K/V heads first)" if attention_key_heads > kv_heads else ")"))
    else:
        moved = f"{kv_heads} key/value heads (the shape's; a model that repeats them before SDPA moves {heads})"
    return (f"context parallelism {cp}: priced as torch's ring attention (estimators/ring_attention.py: K/V "
            f"all-gathered behind one sub-attention, fp32 merges, dK/dV ring) on {moved}; torchtitan's runs at "
            "cp 4-8 took up to 1.5x the estimate (the band carries it)")


__all__ = ["FP32_BYTES", "LSE_MERGE_BYTES", "RingAttentionTime", "ring_attention_note", "ring_attention_time",
           "torch_ring_attention"]
