"""Megatron-LM ``pretrain_gpt.py`` arguments for a megatron-engine plan (pure function ExportPlan -> argv).

Flag names, defaults and rules follow Megatron-LM's ``megatron/training/arguments.py`` (NVIDIA/Megatron-LM,
commit 000c4ac2, 2025) and the Megatron-Core classes it hands them to:

- Parallelism: ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
  ``--context-parallel-size``, ``--sequence-parallel`` (``_add_distributed_args`` /
  ``_add_training_args``). Megatron derives the data-parallel size itself as
  ``world_size // (tp·pp·cp)`` (``validate_args``), so there is no dp flag.
- Interleaved pipeline: ``--num-layers-per-virtual-pipeline-stage L/(pp·vpp)``. Current Megatron-LM has
  both this flag and the newer ``--num-virtual-stages-per-pipeline-rank`` (at most one of them may be set,
  ``validate_args``); the per-stage layer count is the one older releases also accept, and with an even
  split both give ``virtual_pipeline_model_parallel_size = vpp``. The validator accepts either.
- Layers that pp (x vpp) does not divide (DeepSeek-V3's 61, Qwen3-235B's 94): ``--pipeline-model-parallel-layout``
  with the balanced split the estimate priced (:mod:`optplan.planner.export.megatron_layout`; Megatron-Core 0.13
  and later, MR 2795), instead of the virtual-stage flags (``validate_args`` allows one of the three).
- ZeRO-1 is Megatron's distributed optimizer, ``--use-distributed-optimizer`` (optimizer states sharded
  over data-parallel ranks); the engine has no ZeRO-2/3 and no offload (``Strategy`` refuses those).
- ``comm_overlap`` plans add ``--tp-comm-overlap`` (tp > 1; Transformer Engine userbuffers, sequence parallelism
  required), ``--overlap-grad-reduce`` and, with the distributed optimizer, ``--overlap-param-gather``
  (estimators/tp_overlap.py; NVIDIA's own Megatron-Bridge recipes run them), checked against Megatron's rules for
  them.
- Batch: ``--micro-batch-size mbs`` and ``--global-batch-size mbs·grad_accum·dp``; Megatron runs
  ``global / (mbs·dp)`` micro-batches per step (``megatron/core/num_microbatches_calculator.py``).
- Model: ``--num-layers --hidden-size --ffn-hidden-size --num-attention-heads``, GQA as
  ``--group-query-attention --num-query-groups kv_heads``, ``--seq-length`` and
  ``--max-position-embeddings`` (>= seq length, ``validate_args``). A gated (Llama-style) block becomes
  ``--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
  --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0`` (Llama 2/3 keep input
  and output embeddings separate and use no dropout); a GPT block keeps Megatron's GPT defaults
  (LayerNorm, learned absolute positions, biases, tied embeddings).
- Mixture-of-Experts and multi-head latent attention: :mod:`optplan.planner.export.megatron_moe` (experts,
  top-k, expert width and layer pattern, ``--expert-model-parallel-size``, grouped GEMM, all-to-all dispatcher;
  MLA ranks and head dimensions), with Megatron's MoE rules.
- Precision (``_add_mixed_precision_args`` / ``_add_transformer_engine_args``): ``--bf16``, ``--fp16``,
  fp8 as ``--bf16 --fp8-format hybrid`` (Transformer Engine, the default ``--transformer-impl``); fp32 is
  Megatron's default. Megatron casts the model (no autocast mode) and keeps fp32 main parameters, so the
  ``amp-*`` and ``bf16-pure`` recipes are refused.
- Recompute: full = ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``
  (every layer's input kept, the layer recomputed); partial (``checkpoint_layers`` N) = ``--recompute-method block
  --recompute-num-layers N`` (the first N layers of each pipeline stage, estimators/partial_checkpointing.py), selective = ``--recompute-granularity selective``
  (core attention only, Megatron's default ``--recompute-modules``; Megatron forbids a recompute method with it),
  moe = ``--recompute-granularity selective --recompute-modules moe`` (the MoE layers, estimators/moe_recompute.py).
- Attention: ``--attention-backend flash`` for flash plans, ``unfused`` (materialised s x s scores) for
  the others (``AttnBackend`` in ``megatron/core/transformer/enums.py``; ``--use-flash-attn`` is the
  legacy-model flag).
- Optimizer: ``--optimizer adam`` (Megatron's Adam is AdamW: decoupled weight decay) with the same
  hyper-parameters as the DeepSpeed export (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1), or
  ``--optimizer sgd --sgd-momentum 0.9``; ``--clip-grad 1.0``. 8-bit AdamW and Adafactor do not exist
  in Megatron-LM and are refused.
- Vocabulary: Megatron takes the vocabulary from its tokenizer (``--tokenizer-type``,
  ``--tokenizer-model``) and pads it to a multiple of ``--make-vocab-size-divisible-by`` x tp, so no
  vocabulary flag is exported; ``--vocab-size`` only matters for ``--tokenizer-type NullTokenizer``
  (mock-data smoke tests), see :func:`megatron_notes`. Data, tokenizer, iteration count and learning-rate
  schedule are the user's: they go on the launch script's command line.

Environment: Megatron asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with tp > 1 or cp > 1 on GPUs before
Blackwell (``validate_args``); :func:`megatron_env` says so and the launch scripts export it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from optplan.estimators.attention_kernels import attention_kernel
from optplan.estimators.pipeline_layout import MAX_EXTRA_STAGES, is_even
from optplan.estimators.profile import TransformerShape
from optplan.planner.export.context import ExportPlan, NotExportable
from optplan.planner.export.megatron_layout import layout_violation, megatron_layout, parse_megatron_layout
from optplan.planner.export.megatron_moe import add_moe_flags, dense_ffn, moe_args, moe_rule_violation
from optplan.planner.validate import ExportValidationError

PRETRAIN_SCRIPT = "pretrain_gpt.py"
"""The Megatron-LM entry point for GPT-style (decoder-only) models, at the root of a Megatron-LM checkout."""

LEARNING_RATE = 3e-4
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.1
SGD_MOMENTUM = 0.9
CLIP_GRAD = 1.0

_REFUSED_PRECISION: Mapping[str, str] = MappingProxyType({
    "amp-bf16": "Megatron-LM has no autocast (AMP) mode, it casts the model: plan with --precision bf16",
    "amp-fp16": "Megatron-LM has no autocast (AMP) mode, it casts the model: plan with --precision fp16",
    "bf16-pure": ("Megatron-LM keeps fp32 main parameters (no bf16 master weights): plan with --precision bf16, "
                  "or use --engine deepspeed for bf16-pure"),
})


def _fmt(value: float) -> str:
    """A float as Megatron's argparse ``type=float`` reads it back exactly (``repr``)."""
    return repr(float(value))


def _seq_len(plan: ExportPlan) -> int:
    shape = plan.transformer
    seq = plan.seq_len if plan.seq_len is not None else (shape.max_seq_len if shape is not None else None)
    if seq is None:
        raise NotExportable(f"the plan for {plan.model} has no sequence length, which Megatron-LM needs "
                            "(--seq-length): plan with --seq-len N")
    return seq


def _check_exportable(plan: ExportPlan) -> None:
    """Raise NotExportable for plans Megatron-LM's pretrain_gpt.py cannot run as planned."""
    s = plan.strategy
    if s.engine != "megatron":
        raise NotExportable(
            f"this plan runs on the {s.engine} engine, and Megatron-LM arguments describe megatron-engine "
            "plans: export ds_config.json/launch.sh for it, or plan with --engine megatron"
        )
    if plan.transformer is None:
        raise NotExportable(
            f"Megatron-LM builds its own GPT model from the transformer's dimensions, and the profile of "
            f"{plan.model} has none: profile a model whose config states hidden size, layers and heads, or "
            "plan with --engine deepspeed|torch"
        )
    if s.precision in _REFUSED_PRECISION:
        raise NotExportable(f"precision {s.precision}: {_REFUSED_PRECISION[s.precision]}")
    if s.optimizer not in ("adamw", "sgd"):
        raise NotExportable(f"Megatron-LM has no {s.optimizer} optimizer (it offers adam and sgd): plan with "
                            "--optimizer adamw, or use --engine deepspeed|torch for it")


def megatron_args(plan: ExportPlan) -> list[str]:
    """The ``pretrain_gpt.py`` arguments for a megatron-engine plan (a fresh list of plain words).

    Raises NotExportable (one line naming the fix) for plans of another engine, without a transformer
    shape or sequence length, with a precision or optimizer Megatron-LM lacks, and for plans that break
    one of Megatron's own divisibility rules (see :func:`validate_megatron_args`).
    """
    _check_exportable(plan)
    s = plan.strategy
    shape = plan.transformer
    assert shape is not None  # _check_exportable
    seq = _seq_len(plan)
    problem = _rule_violation(_PlanView.from_plan(plan, seq))
    if problem:
        raise NotExportable(problem)

    args = [
        "--tensor-model-parallel-size", str(s.tp),
        "--pipeline-model-parallel-size", str(s.pp),
    ]
    if s.pp > 1 and not is_even(shape.layers, s.pp, s.vpp):
        args += ["--pipeline-model-parallel-layout", megatron_layout(shape.layers, s.pp, s.vpp)]
    elif s.vpp > 1:
        args += ["--num-layers-per-virtual-pipeline-stage", str(shape.layers // (s.pp * s.vpp))]
    args += ["--context-parallel-size", str(s.cp)]
    if s.sp:
        args.append("--sequence-parallel")
    if s.zero == 1:
        args.append("--use-distributed-optimizer")
    if s.comm_overlap:  # Megatron's tensor/data-parallel overlap (estimators/tp_overlap.py)
        if s.tp > 1:
            args.append("--tp-comm-overlap")
        args.append("--overlap-grad-reduce")
        if s.zero == 1:
            args.append("--overlap-param-gather")
    args += [
        "--micro-batch-size", str(s.mbs),
        "--global-batch-size", str(s.global_batch),
        "--seq-length", str(seq),
        "--max-position-embeddings", str(max(seq, shape.max_seq_len or 0)),
        "--num-layers", str(shape.layers),
        "--hidden-size", str(shape.hidden),
        "--ffn-hidden-size", str(dense_ffn(shape)),
        "--num-attention-heads", str(shape.heads),
    ]
    if shape.kv_heads is not None and shape.kv_heads < shape.heads:
        args += ["--group-query-attention", "--num-query-groups", str(shape.kv_heads)]
    args += moe_args(shape, s)
    if shape.gated:
        args += [
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        ]
        if shape.rope_theta is not None:  # Megatron's --rotary-base is an int (default 10000)
            args += ["--rotary-base", str(round(shape.rope_theta))]
    if shape.norm_eps is not None:  # default 1e-5
        args += ["--norm-epsilon", _fmt(shape.norm_eps)]
    if s.precision in ("bf16", "fp8"):
        args.append("--bf16")
    elif s.precision == "fp16":
        args.append("--fp16")
    if s.precision == "fp8":
        args += ["--fp8-format", "hybrid"]
    if s.checkpointing == "full" and s.checkpoint_layers is not None:  # the first N layers of each stage
        args += ["--recompute-granularity", "full", "--recompute-method", "block",
                 "--recompute-num-layers", str(s.checkpoint_layers)]
    elif s.checkpointing == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif s.checkpointing == "selective":
        args += ["--recompute-granularity", "selective"]
    elif s.checkpointing == "moe":
        args += ["--recompute-granularity", "selective", "--recompute-modules", "moe"]
    args += ["--attention-backend", attention_backend(plan)]
    if s.optimizer == "adamw":
        args += ["--optimizer", "adam", "--adam-beta1", _fmt(ADAM_BETAS[0]), "--adam-beta2", _fmt(ADAM_BETAS[1]),
                 "--adam-eps", _fmt(ADAM_EPS), "--weight-decay", _fmt(WEIGHT_DECAY)]
    else:
        args += ["--optimizer", "sgd", "--sgd-momentum", _fmt(SGD_MOMENTUM), "--weight-decay", "0.0"]
    args += ["--lr", _fmt(LEARNING_RATE), "--clip-grad", _fmt(CLIP_GRAD)]
    moe_problem = moe_rule_violation(parse_megatron_args(args), plan.world_size, s.vpp)
    if moe_problem:
        raise NotExportable(moe_problem)
    return args


def megatron_env(plan: ExportPlan) -> dict[str, str]:
    """Environment variables Megatron-LM needs for this plan (a fresh dict).

    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with tp > 1 or cp > 1: ``validate_args`` asserts it on GPUs before
    Blackwell so that tensor/context-parallel communication kernels are scheduled before the compute
    they overlap with; a plan with the expert-parallel all-to-all overlap takes 32 instead (its streams must run
    concurrently: the MoE guide asks for more than 1, and ``validate_args`` only warns then with tp or cp > 1,
    naming "1 or 32" as the choice; the plan priced the all-to-all overlap, not the tensor-parallel one).
    """
    s = plan.strategy
    if s.ep_overlap:  # the all-to-all overlap needs concurrent streams (MoE guide: "CUDA_DEVICE_MAX_CONNECTIONS > 1")
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if (s.tp > 1 or s.cp > 1) else {}


def megatron_notes(plan: ExportPlan) -> tuple[str, ...]:
    """What the user adds on the command line for pretrain_gpt.py (data, tokenizer, schedule)."""
    shape = plan.transformer
    vocab = shape.vocab if shape is not None and shape.vocab else None
    mock = ("--mock-data --tokenizer-type NullTokenizer"
            + (f" --vocab-size {vocab}" if vocab else " --vocab-size V"))
    return (
        "pass the data and the schedule on the command line: --data-path PREFIX --split 99,1,0 (or "
        "--mock-data), --train-iters N (or --train-samples), --lr-decay-style cosine --lr-warmup-iters W, "
        "--save/--load DIR --save-interval K",
        "Megatron-LM takes the vocabulary from its tokenizer, not from a flag: pass --tokenizer-type "
        f"HuggingFaceTokenizer --tokenizer-model TOKENIZER (the Hugging Face id or folder of {plan.model}'s "
        f"tokenizer); for a smoke test without data: {mock}",
        "Megatron builds the model itself from these dimensions; to start from existing weights convert "
        "them to a Megatron checkpoint first (tools/checkpoint/convert.py) and pass --load",
        *_numerics_notes(shape),
    )


def attention_backend(plan: ExportPlan) -> str:
    """Megatron-LM's --attention-backend for the kernel the time model priced on the plan's GPU
    (estimators/attention_kernels.py): ``fused`` (Transformer Engine's cuDNN fused attention) where Megatron is
    priced at cuDNN's measured speed (Hopper, Blackwell), ``flash`` (FlashAttention) where the GPU's fitted
    fractions stand (A100: fitted on runs that used it), ``unfused`` without memory-efficient attention."""
    if not plan.strategy.flash:
        return "unfused"
    kernel = attention_kernel("megatron", plan.gpu)
    return "fused" if kernel is not None and kernel.name == "cudnn" else "flash"


def _numerics_notes(shape: TransformerShape | None) -> tuple[str, ...]:
    """What the model did not state that Megatron then takes from its defaults (rotary base, norm epsilon), and a
    rotary base Megatron's integer flag rounds."""
    if shape is None:
        return ()
    rotary = shape.rope_theta if shape.gated else 0.0  # learned positions (GPT): no rotary base to state
    unstated = [f"its {what} (Megatron then uses {default}; change it with {flag})" for what, value, default, flag in (
        ("rotary base", rotary, "10000", "--rotary-base"),
        ("normalisation epsilon", shape.norm_eps, "1e-5", "--norm-epsilon")) if value is None]
    notes = [f"the model does not state {' or '.join(unstated)}: check against the model's weights"] \
        if unstated else []
    if shape.gated and shape.rope_theta is not None and shape.rope_theta != round(shape.rope_theta):
        notes.append(f"rotary base {shape.rope_theta:g} is passed as {round(shape.rope_theta)}: Megatron-LM's "
                     "--rotary-base takes an integer")
    return tuple(notes)


class _PlanView:
    """The numbers Megatron's rules are about, whether read from a plan or from parsed arguments."""

    __slots__ = ("world", "tp", "pp", "cp", "vpp", "sp", "layers", "heads", "query_groups", "hidden", "ffn",
                 "mbs", "gbs", "seq", "max_pos", "interleave_ok", "layout")

    def __init__(self, **kw: object) -> None:
        for name in self.__slots__:
            setattr(self, name, kw[name])

    @classmethod
    def from_plan(cls, plan: ExportPlan, seq: int) -> _PlanView:
        s, shape = plan.strategy, plan.transformer
        assert shape is not None
        return cls(world=plan.world_size, tp=s.tp, pp=s.pp, cp=s.cp, vpp=s.vpp, sp=s.sp, layers=shape.layers,
                   heads=shape.heads, query_groups=shape.kv_heads or shape.heads, hidden=shape.hidden,
                   ffn=dense_ffn(shape), mbs=s.mbs, gbs=s.global_batch, seq=seq,
                   max_pos=max(seq, shape.max_seq_len or 0), interleave_ok=True,
                   layout=s.pp > 1 and not is_even(shape.layers, s.pp, s.vpp))


def _rule_violation(v: _PlanView) -> str | None:
    """The first of Megatron-LM's own rules the numbers break (one line naming the fix), else None.

    Sources (Megatron-LM 000c4ac2): ``megatron/training/arguments.py`` ``validate_args`` (world size
    divisible by tp·pp·cp; layers divisible by pp, and per-stage layers by the virtual-stage size, unless a
    custom ``--pipeline-model-parallel-layout`` places them (megatron_layout.py);
    interleaving needs pp > 1 with p2p overlap (the default) else pp > 2; hidden divisible by heads;
    seq divisible by 2·cp when cp > 1; max position embeddings >= seq; sequence parallelism is switched
    off at tp 1), ``megatron/core/transformer/transformer_config.py`` ``TransformerConfig.__post_init__``
    (heads and query groups multiples of tp), ``megatron/core/tensor_parallel/layers.py``
    (``ColumnParallelLinear`` splits the FFN width over tp), ``megatron/core/num_microbatches_calculator.py``
    (global batch divisible by micro-batch x dp) and ``megatron/core/pipeline_parallel/schedules.py``
    (interleaved schedule: micro-batches divisible by pp in older releases; later ones group micro-batches
    by ``--microbatch-group-size-per-virtual-pipeline-stage``, which defaults to pp; the planner's Strategy
    enforces the same rule).
    """
    model = v.tp * v.pp * v.cp
    if v.world % model:
        return (f"world size {v.world} is not divisible by tp·pp·cp = {model} (Megatron derives dp = world / "
                "(tp·pp·cp)): re-plan with a GPU count that is a multiple of it")
    dp = v.world // model
    if v.layers % v.pp and not v.layout:
        return (f"{v.layers} layers are not divisible by --pp {v.pp} (Megatron splits layers evenly over "
                "pipeline stages): choose a pp that divides the layer count, or give --pipeline-model-parallel-layout")
    if v.pp * v.vpp > v.layers + (MAX_EXTRA_STAGES if v.layout else 0):
        return (f"pp {v.pp} x vpp {v.vpp} virtual stages exceed the {v.layers} layers: lower --vpp or --pp")
    if v.vpp > 1:
        if (v.layers // v.pp) % v.vpp and not v.layout:
            return (f"{v.layers // v.pp} layers per pipeline stage are not divisible by --vpp {v.vpp} (Megatron "
                    "needs whole layers per virtual stage): choose pp·vpp dividing the layer count")
        if v.pp < (2 if v.interleave_ok else 3):
            return (f"the interleaved schedule needs pp > {1 if v.interleave_ok else 2} (got {v.pp}): raise --pp "
                    "or use --vpp 1")
    if v.hidden % v.heads:
        return (f"hidden size {v.hidden} is not divisible by {v.heads} heads (Megatron's kv_channels): fix the "
                "model dimensions")
    if v.heads % v.tp:
        return (f"num_attention_heads ({v.heads}) must be a multiple of tensor_model_parallel_size ({v.tp}): "
                "choose a tp that divides the head count")
    if v.heads % v.query_groups:
        return (f"{v.heads} attention heads are not divisible by {v.query_groups} query groups: fix the model's "
                "kv_heads")
    if v.query_groups % v.tp:
        return (f"num_query_groups ({v.query_groups}) must be a multiple of tensor_model_parallel_size ({v.tp}): "
                "choose a tp that divides the key-value head count")
    if v.ffn % v.tp:
        return (f"FFN width {v.ffn} is not divisible by tp {v.tp} (ColumnParallelLinear splits it): choose a tp "
                "that divides it")
    if v.gbs % (v.mbs * dp):
        return (f"global batch {v.gbs} is not divisible by micro-batch {v.mbs} x dp {dp}: set --global-batch-size "
                "to a multiple of mbs·dp")
    if v.vpp > 1 and (v.gbs // (v.mbs * dp)) % v.pp:
        return (f"the interleaved schedule needs the micro-batches per step ({v.gbs // (v.mbs * dp)}) divisible by "
                f"pp {v.pp}: change the gradient accumulation, or use --vpp 1")
    if v.sp and v.tp == 1:
        return ("sequence parallelism needs tensor parallelism (Megatron turns it off at tp 1): set --tp > 1 or "
                "drop --sequence-parallel")
    if v.cp > 1 and v.seq % (2 * v.cp):
        return (f"seq-length {v.seq} must be a multiple of 2 * context-parallel-size ({2 * v.cp}): choose a "
                "sequence length or cp that fits")
    if v.max_pos < v.seq:
        return (f"max_position_embeddings ({v.max_pos}) must be >= seq_length ({v.seq}): raise "
                "--max-position-embeddings")
    return None


def _overlap_violation(ns: argparse.Namespace) -> str | None:
    """Megatron-LM's rules for its communication overlaps (``megatron/training/arguments.py`` ``validate_args``):
    --tp-comm-overlap only with --sequence-parallel; --overlap-param-gather only with the distributed optimizer and
    with --overlap-grad-reduce."""
    if ns.tp_comm_overlap and not ns.sequence_parallel:
        return ("Tensor parallel communication/GEMM overlap can happen only when sequence parallelism is enabled: add "
                "--sequence-parallel or drop --tp-comm-overlap")
    if ns.overlap_param_gather and not ns.use_distributed_optimizer:
        return "--overlap-param-gather only supported with distributed optimizer: add --use-distributed-optimizer"
    if ns.overlap_param_gather and not ns.overlap_grad_reduce:
        return "Must use --overlap-param-gather with --overlap-grad-reduce: add --overlap-grad-reduce"
    return None


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises ExportValidationError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ExportValidationError(f"Megatron-LM would reject the arguments: {message}")


def _parser() -> _RaisingParser:
    """The subset of Megatron-LM's argparse definitions (names, types, defaults, choices as in
    ``megatron/training/arguments.py``) that the export uses, plus their documented alternatives."""
    p = _RaisingParser(prog=PRETRAIN_SCRIPT, allow_abbrev=False, add_help=False)
    add = p.add_argument
    for flag, default in (("--tensor-model-parallel-size", 1), ("--pipeline-model-parallel-size", 1),
                          ("--context-parallel-size", 1)):
        add(flag, type=int, default=default)
    add("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    add("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    add("--pipeline-model-parallel-layout", type=str, default=None)
    add("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    add("--sequence-parallel", action="store_true")
    add("--use-distributed-optimizer", action="store_true")
    add("--tp-comm-overlap", action="store_true")
    add("--overlap-grad-reduce", action="store_true")
    add("--overlap-param-gather", action="store_true")
    add("--micro-batch-size", type=int, default=None)
    add("--global-batch-size", type=int, default=None)
    add("--seq-length", type=int, default=None)
    add("--max-position-embeddings", type=int, default=None)
    add("--num-layers", type=int, default=None)
    add("--hidden-size", type=int, default=None)
    add("--ffn-hidden-size", type=int, default=None)
    add("--num-attention-heads", type=int, default=None)
    add("--group-query-attention", action="store_true")
    add("--num-query-groups", type=int, default=1)
    add("--swiglu", action="store_true")
    add("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    add("--position-embedding-type", default="learned_absolute",
        choices=["learned_absolute", "rope", "mrope", "relative", "none"])
    add("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    add("--untie-embeddings-and-output-weights", action="store_true")
    add("--rotary-base", type=int, default=10000)
    add("--norm-epsilon", type=float, default=1e-5)
    add("--attention-dropout", type=float, default=0.1)
    add("--hidden-dropout", type=float, default=0.1)
    add("--bf16", action="store_true")
    add("--fp16", action="store_true")
    add("--fp8-format", default=None, choices=["e4m3", "hybrid"], dest="fp8")
    add("--recompute-granularity", default=None, choices=["full", "selective"])
    add("--recompute-method", default=None, choices=["uniform", "block"])
    add("--recompute-num-layers", type=int, default=None)
    add("--recompute-modules", nargs="*", type=str, default=None)
    add("--attention-backend", default="auto", choices=["flash", "fused", "unfused", "local", "auto"])
    add("--use-flash-attn", action="store_true")
    add("--optimizer", default="adam", choices=["adam", "sgd", "muon", "dist_muon"])
    add("--adam-beta1", type=float, default=0.9)
    add("--adam-beta2", type=float, default=0.999)
    add("--adam-eps", type=float, default=1e-08)
    add("--sgd-momentum", type=float, default=0.9)
    add("--weight-decay", type=float, default=0.01)
    add("--lr", type=float, default=None)
    add("--clip-grad", type=float, default=1.0)
    add_moe_flags(add)
    return p


def parse_megatron_args(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed with Megatron-LM's definitions of the exported flags (ExportValidationError on
    unknown flags or bad values; the message names them)."""
    if isinstance(argv, str) or not all(isinstance(a, str) for a in argv):
        raise ExportValidationError("Megatron-LM arguments must be a list of strings (one word each)")
    return _parser().parse_args(list(argv))


def validate_megatron_args(argv: list[str], plan: ExportPlan) -> None:
    """Check ``argv`` (pretrain_gpt.py arguments) against Megatron-LM's own rules and against ``plan``.

    Parses with Megatron's flag definitions (unknown flags, bad values and missing required arguments
    ``--num-layers --hidden-size --num-attention-heads --max-position-embeddings --micro-batch-size``
    are errors, as in ``validate_args``), then applies Megatron's rules with the plan's world size (see
    :func:`_rule_violation` for the sources: world divisible by tp·pp·cp, layers by pp·vpp, heads and
    query groups by tp, global batch by mbs·dp, sequence parallelism only with tp > 1, seq by 2·cp,
    fp16 xor bf16, no recompute method with selective recompute), and finally compares every exported
    setting with what :func:`megatron_args` derives from the plan. Raises ExportValidationError (one line).
    """
    ns = parse_megatron_args(argv)
    for dest, flag in (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
                       ("num_attention_heads", "--num-attention-heads"),
                       ("max_position_embeddings", "--max-position-embeddings"),
                       ("micro_batch_size", "--micro-batch-size")):
        if getattr(ns, dest) is None:
            raise ExportValidationError(f"Megatron-LM requires {flag} (validate_args): add it")
    if ns.fp16 and ns.bf16:
        raise ExportValidationError("--fp16 and --bf16 are exclusive in Megatron-LM: keep one")
    if sum(x is not None for x in (ns.num_layers_per_virtual_pipeline_stage, ns.num_virtual_stages_per_pipeline_rank,
                                   ns.pipeline_model_parallel_layout)) > 1:
        raise ExportValidationError("Megatron-LM accepts only one of --num-layers-per-virtual-pipeline-stage, "
                                    "--num-virtual-stages-per-pipeline-rank and --pipeline-model-parallel-layout: "
                                    "keep one")
    if ns.recompute_modules is not None and ns.recompute_granularity != "selective":
        raise ExportValidationError("--recompute-modules takes effect with --recompute-granularity selective only: "
                                    "add it, or drop --recompute-modules")
    if ns.recompute_granularity == "selective" and ns.recompute_method is not None:
        raise ExportValidationError("Megatron-LM supports no --recompute-method with selective recompute: drop "
                                    "--recompute-method")
    tp, pp, cp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size, ns.context_parallel_size
    if min(tp, pp, cp) < 1:
        raise ExportValidationError("parallel sizes must be >= 1: fix --tensor/--pipeline-model-parallel-size, "
                                    "--context-parallel-size")
    vpp = 1
    stages: list[str] | None = None
    if ns.pipeline_model_parallel_layout is not None:
        try:
            stages = parse_megatron_layout(ns.pipeline_model_parallel_layout)
        except ValueError as exc:
            raise ExportValidationError(f"Megatron-LM would reject the arguments: {exc}") from exc
        problem = layout_violation(stages, ns.num_layers, pp)
        if problem:
            raise ExportValidationError(f"Megatron-LM would reject the arguments: {problem}")
        vpp = len(stages) // pp
    elif ns.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = ns.num_layers // pp if ns.num_layers % pp == 0 else None
        if per_stage is None or ns.num_layers_per_virtual_pipeline_stage < 1 or \
                per_stage % ns.num_layers_per_virtual_pipeline_stage:
            raise ExportValidationError(
                f"{ns.num_layers} layers over pp {pp} do not split into virtual stages of "
                f"{ns.num_layers_per_virtual_pipeline_stage} layers (validate_args): fix "
                "--num-layers-per-virtual-pipeline-stage")
        vpp = per_stage // ns.num_layers_per_virtual_pipeline_stage
    elif ns.num_virtual_stages_per_pipeline_rank is not None:
        vpp = ns.num_virtual_stages_per_pipeline_rank
    gbs = ns.global_batch_size
    if gbs is None:  # Megatron's default: one micro-batch per step
        gbs = ns.micro_batch_size * max(1, plan.world_size // (tp * pp * cp))
    seq = ns.seq_length if ns.seq_length is not None else 0
    view = _PlanView(world=plan.world_size, tp=tp, pp=pp, cp=cp, vpp=vpp, sp=ns.sequence_parallel,
                     layers=ns.num_layers, heads=ns.num_attention_heads,
                     query_groups=ns.num_query_groups if ns.group_query_attention else ns.num_attention_heads,
                     hidden=ns.hidden_size, ffn=ns.ffn_hidden_size or 4 * ns.hidden_size, mbs=ns.micro_batch_size,
                     gbs=gbs, seq=seq, max_pos=ns.max_position_embeddings, interleave_ok=ns.overlap_p2p_comm,
                     layout=stages is not None)
    if seq < 1:
        raise ExportValidationError("Megatron-LM needs --seq-length for GPT pretraining: add it")
    if ns.group_query_attention and ns.num_query_groups < 1:
        raise ExportValidationError("--num-query-groups must be >= 1: fix it")
    problem = _rule_violation(view) or _overlap_violation(ns) or moe_rule_violation(ns, plan.world_size, vpp)
    if problem:
        raise ExportValidationError(f"Megatron-LM would reject the arguments: {problem}")
    if ns.recompute_granularity == "full":  # Megatron-Core TransformerConfig.__post_init__'s recompute checks
        per_rank = ns.num_layers // pp
        if ns.recompute_method is None:
            raise ExportValidationError("Megatron-LM needs --recompute-method uniform|block with --recompute-granularity "
                                        "full: add it")
        if ns.recompute_num_layers is None or not 1 <= ns.recompute_num_layers <= per_rank:
            raise ExportValidationError(f"--recompute-num-layers must be between 1 and the {per_rank} layers of a "
                                        "pipeline rank with --recompute-granularity full: fix it")

    try:
        expected = parse_megatron_args(megatron_args(plan))
    except NotExportable as exc:
        raise ExportValidationError(f"the plan has no Megatron-LM export: {exc}") from exc
    # The virtual-stage size may be stated either way; compare the resulting degree.
    if vpp != plan.strategy.vpp:
        raise ExportValidationError(f"the arguments give {vpp} virtual pipeline stage(s) per rank but the plan has "
                                    f"vpp {plan.strategy.vpp}: fix the virtual-pipeline flag")
    want_layout = expected.pipeline_model_parallel_layout
    if (stages is not None or want_layout is not None) and (
            stages != (parse_megatron_layout(want_layout) if want_layout is not None else None)):
        raise ExportValidationError("the pipeline layout in the arguments is not the one the plan priced"
                                    + (f" ({want_layout})" if want_layout else " (an even split)")
                                    + ": re-export the plan")
    skip = {"num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank", "overlap_p2p_comm",
            "use_flash_attn", "pipeline_model_parallel_layout"}
    flags = {a.dest: a.option_strings[0] for a in _parser()._actions if a.option_strings}
    for dest, want in vars(expected).items():
        if dest in skip:
            continue
        got = getattr(ns, dest)
        if dest == "attention_backend" and ns.use_flash_attn and want == "flash" and got == "auto":
            continue  # the legacy flag asks for the same kernel
        if got != want:
            raise ExportValidationError(f"{flags.get(dest, dest)} is {got!r} in the arguments but the plan needs "
                                        f"{want!r}: re-export the plan")
