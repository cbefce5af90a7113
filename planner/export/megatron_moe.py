"""Megatron-LM arguments for Mixture-of-Experts and multi-head-latent-attention models (the part of
``pretrain_gpt.py``'s argv that megatron.py leaves to this module), their flag definitions and their rules.

Flags follow Megatron-LM's ``megatron/training/arguments.py`` ``_add_moe_args`` and ``_add_mla_args`` (commit
000c4ac2, 2025) and the Megatron-Core MoE guide (``megatron/core/transformer/moe/README.md``):

- ``--num-experts E --moe-router-topk K --moe-ffn-hidden-size F`` (the expert width; ``--ffn-hidden-size`` stays
  the dense layers' width), ``--moe-shared-expert-intermediate-size S·F`` for shared experts,
  ``--moe-layer-freq`` as a Python list of 0/1 per layer when some layers are dense (first_dense, moe_every),
  else 1;
- ``--expert-model-parallel-size ep`` and, for plans whose experts split unlike the other layers (``etp`` set
  and not tp), ``--expert-tensor-parallel-size etp`` (MoE parallel folding; Megatron's default is tp),
  ``--moe-grouped-gemm`` (one grouped GEMM over the local experts, what the
  time model assumes) and ``--moe-token-dispatcher-type alltoall`` (the dispatcher the all-to-all is priced for),
  or ``--moe-token-dispatcher-type flex --moe-enable-deepep`` for plans with ``dispatcher=deepep`` (DeepEP: the
  Megatron-Core MoE guide, "set --moe-token-dispatcher-type=flex and --moe-enable-deepep");
- ``--moe-router-load-balancing-type aux_loss`` (Megatron's default, the balanced routing the plan assumes) with
  ``--moe-aux-loss-coeff 0.01`` (:data:`MOE_AUX_LOSS_COEFF`: the flag's own help, "a starting value of 1e-2 is
  recommended"; its default 0.0 turns the loss off, and unbalanced routing is not what the plan priced);
- ``--overlap-moe-expert-parallel-comm --delay-wgrad-compute`` for plans with ``ep_overlap`` (the MoE guide's
  "EP A2A Overlap" pair; estimators/ep_overlap.py), with Megatron's rules for it: ep > 1, the alltoall or flex
  dispatcher, no full recomputation, a bf16/fp16 model, an interleaved pipeline when pp > 1;
- MLA: ``--multi-latent-attention --kv-lora-rank --q-lora-rank --qk-head-dim --qk-pos-emb-head-dim
  --v-head-dim``.

Rules (``validate_args``, ``TransformerConfig.__post_init__`` and ``parallel_state.initialize_model_parallel``):
experts divisible by ep; the world divisible by tp·pp·cp and by etp·ep·pp (the expert mesh etp-ep-edp-pp, etp
defaulting to tp: "world_size is not divisible by expert_tensor_model_pipeline_parallel size"); expert tensor
parallelism splits the expert width (``moe_ffn_hidden_size % etp``); "when using MoE and tensor parallelism, sequence
parallelism must be used" (``validate_args``; ``TransformerConfig`` says it for ep > 1 with tp > 1); top-k <=
experts; DeepEP only with the flex dispatcher, the flex dispatcher only with DeepEP and TP x EP > 1
(``MoEFlexTokenDispatcher``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from optplan.estimators.profile import TransformerShape
from optplan.estimators.strategy import Strategy

MOE_AUX_LOSS_COEFF = 0.01
"""--moe-aux-loss-coeff the export passes (dimensionless): Megatron-LM's recommended starting value (the flag's help
in megatron/training/arguments.py); its default 0.0 disables the load-balancing loss."""


def layer_pattern(shape: TransformerShape) -> list[int]:
    """1 for each MoE layer, 0 for each dense one (estimators/moe.py counting)."""
    moe = shape.moe
    assert moe is not None
    return [int(i >= moe.first_dense and (i - moe.first_dense + 1) % moe.moe_every == 0) for i in range(shape.layers)]


def moe_args(shape: TransformerShape, s: Strategy) -> list[str]:
    """The MoE and MLA arguments of a plan (empty for a dense multi-head model)."""
    args: list[str] = []
    moe = shape.moe
    if moe is not None:
        pattern = layer_pattern(shape)
        freq = "1" if all(pattern) else "[" + ",".join(map(str, pattern)) + "]"
        args += ["--num-experts", str(moe.experts), "--moe-router-topk", str(moe.topk),
                 "--moe-ffn-hidden-size", str(moe.moe_ffn), "--moe-layer-freq", freq,
                 "--expert-model-parallel-size", str(s.ep)]
        if s.expert_tp != s.tp:
            args += ["--expert-tensor-parallel-size", str(s.expert_tp)]
        args += ["--moe-grouped-gemm"]
        args += (["--moe-token-dispatcher-type", "flex", "--moe-enable-deepep"] if s.dispatcher == "deepep"
                 else ["--moe-token-dispatcher-type", "alltoall"])
        args += ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", repr(MOE_AUX_LOSS_COEFF)]
        if moe.shared_experts:
            args += ["--moe-shared-expert-intermediate-size", str(moe.shared_experts * moe.moe_ffn)]
        if s.ep_overlap:  # the MoE guide's pair for "EP A2A Overlap"
            args += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    if shape.head_dim is not None and shape.mla is None:
        args += ["--kv-channels", str(shape.head_dim)]  # the per-head width (Megatron's default: hidden / heads)
    mla = shape.mla
    if mla is not None:
        args += ["--multi-latent-attention", "--kv-lora-rank", str(mla.kv_lora), "--qk-head-dim", str(mla.nope_dim),
                 "--qk-pos-emb-head-dim", str(mla.rope_dim), "--v-head-dim", str(mla.v_dim)]
        if mla.q_lora is not None:
            args += ["--q-lora-rank", str(mla.q_lora)]
    return args


def dense_ffn(shape: TransformerShape) -> int:
    """``--ffn-hidden-size``: the dense layers' MLP width (an MoE shape's ``ffn`` is its mean active width)."""
    if shape.moe is not None:
        return shape.moe.dense_ffn or shape.moe.moe_ffn
    return shape.ffn or 4 * shape.hidden


def add_moe_flags(add: Callable[..., Any]) -> None:
    """Megatron-LM's definitions (names, types, defaults, choices) of the flags :func:`moe_args` writes."""
    add("--num-experts", type=int, default=None)
    add("--moe-router-topk", type=int, default=2)
    add("--moe-ffn-hidden-size", type=int, default=None)
    add("--moe-layer-freq", type=str, default="1")
    add("--expert-model-parallel-size", type=int, default=1)
    add("--expert-tensor-parallel-size", type=int, default=None)
    add("--moe-grouped-gemm", action="store_true")
    add("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall", "flex"])
    add("--moe-enable-deepep", action="store_true")
    add("--moe-router-load-balancing-type", default="aux_loss",
        choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    add("--moe-aux-loss-coeff", type=float, default=0.0)
    add("--moe-shared-expert-intermediate-size", type=int, default=None)
    add("--overlap-moe-expert-parallel-comm", action="store_true")
    add("--delay-wgrad-compute", action="store_true")
    add("--kv-channels", type=int, default=None)
    add("--multi-latent-attention", action="store_true")
    add("--kv-lora-rank", type=int, default=32)
    add("--q-lora-rank", type=int, default=None)
    add("--qk-head-dim", type=int, default=128)
    add("--qk-pos-emb-head-dim", type=int, default=64)
    add("--v-head-dim", type=int, default=128)


def moe_rule_violation(ns: argparse.Namespace, world: int, vpp: int = 1) -> str | None:
    """The first of Megatron's MoE rules ``ns`` (parsed arguments, ``vpp`` virtual stages per rank) breaks at
    ``world`` GPUs, else None."""
    ep = ns.expert_model_parallel_size
    experts = ns.num_experts
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    if ep < 1:
        return "--expert-model-parallel-size must be >= 1"
    if experts is None:
        return None if ep == 1 else "--expert-model-parallel-size > 1 needs --num-experts: add it, or use ep 1"
    if experts % ep:
        return (f"num_experts ({experts}) must be divisible by expert_model_parallel_size ({ep}): choose an ep that "
                "divides the experts")
    if ns.moe_enable_deepep and ns.moe_token_dispatcher_type != "flex":
        return ("DeepEP backend is only supported with flex token dispatcher (TransformerConfig): add "
                "--moe-token-dispatcher-type flex")
    if ns.moe_token_dispatcher_type == "flex" and not ns.moe_enable_deepep:
        return ("the flex token dispatcher runs DeepEP (MoEFlexTokenDispatcher: 'Please set --moe-enable-deepep'): "
                "add --moe-enable-deepep")
    etp = ns.expert_tensor_parallel_size or tp  # validate_args: None means tp
    if etp < 1:
        return "--expert-tensor-parallel-size must be >= 1"
    if ns.moe_token_dispatcher_type == "flex" and etp * ep <= 1:
        return "Flex token dispatcher requires TPxEP > 1: raise --expert-model-parallel-size"
    if ns.moe_router_topk > experts:
        return f"--moe-router-topk {ns.moe_router_topk} is more than the {experts} experts: lower it"
    if world % (etp * ep * pp):
        return (f"world_size ({world}) is not divisible by expert_tensor_model_pipeline_parallel size "
                f"({etp * ep * pp} = etp {etp} x ep {ep} x pp {pp}; parallel_state): choose an ep (or "
                "--expert-tensor-parallel-size) whose product with pp divides the world")
    width = ns.moe_ffn_hidden_size or ns.ffn_hidden_size
    if width and width % etp:
        return (f"the expert width {width} is not divisible by the expert tensor-parallel size {etp} (expert tensor "
                "parallelism splits it)")
    if tp > 1 and not ns.sequence_parallel:
        return ("when using MoE and tensor parallelism, sequence parallelism must be used (validate_args; "
                "TransformerConfig for ep > 1): add --sequence-parallel")
    return _overlap_violation(ns, ep, pp, vpp)


def _overlap_violation(ns: argparse.Namespace, ep: int, pp: int, vpp: int) -> str | None:
    """Megatron's rules for ``--overlap-moe-expert-parallel-comm`` and ``--delay-wgrad-compute``
    (``TransformerConfig.__post_init__``, Megatron-LM d98e8a64)."""
    if ns.delay_wgrad_compute and not ns.overlap_moe_expert_parallel_comm:
        return ("overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute: add "
                "--overlap-moe-expert-parallel-comm or drop --delay-wgrad-compute")
    if not ns.overlap_moe_expert_parallel_comm:
        return None
    if ep <= 1:
        return ("overlap_moe_expert_parallel_comm is only supported with expert model parallelism: raise "
                "--expert-model-parallel-size or drop the overlap")
    if ns.moe_token_dispatcher_type not in ("alltoall", "flex"):
        return "overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher: change the dispatcher"
    if ns.recompute_granularity == "full" or ns.recompute_method is not None:
        return "disable full recomputation when enabling overlap_moe_expert_parallel_comm: use selective or none"
    if "moe" in (ns.recompute_modules or []):
        return "disable moe in recompute_modules when enabling overlap_moe_expert_parallel_comm: drop it"
    if not (ns.bf16 or ns.fp16):
        return "overlap_moe_expert_parallel_comm is only supported with bf16 or fp16 model: add --bf16"
    if pp > 1 and vpp <= 1:
        return ("If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when "
                "pipeline_model_parallel_size > 1: interleave the pipeline")
    return None
