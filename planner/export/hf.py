"""Hugging Face ``TrainingArguments`` for a plan: a pure function ExportPlan -> JSON text (its validator:
planner/export/hf_check.py).

The file (``hf_training_args.json``) holds ``TrainingArguments`` fields only, so a training script loads it
with ``TrainingArguments(**json.load(f))`` or ``HfArgumentParser(TrainingArguments).parse_json_file(...)``.
What the script must do beyond that is in ``hf_notes``. Field names, defaults and behaviours follow
transformers 5.23 (``training_args.py``, ``trainer.py``, ``trainer_optimizer.py``,
``integrations/deepspeed.py``) with accelerate 1.15 (``utils/dataclasses.py``, ``utils/fsdp_utils.py``):

- Batch: ``per_device_train_batch_size`` = micro-batch, ``gradient_accumulation_steps`` = accumulation;
  the data-parallel size is the number of processes the launcher starts (``TrainingArguments.world_size``).
- Precision (``training_args.py`` §5 "Mixed Precision": ``fp16``/``bf16`` set accelerate's
  ``mixed_precision``): ``amp-bf16`` and ``bf16`` -> ``bf16: true``; ``amp-fp16`` and ``fp16`` ->
  ``fp16: true``; ``fp32`` -> both false. Without DeepSpeed the Trainer runs autocast over fp32 parameters
  (DDP), or FSDP's MixedPrecisionPolicy(param_dtype=reduce_dtype=bf16|fp16) over fp32 sharded parameters
  (accelerate ``FullyShardedDataParallelPlugin.set_mixed_precision``; ``fsdp2_prepare_model`` upcasts
  16-bit parameters to fp32 masters). For an unsharded model that is the same 16 bytes/parameter of model
  state with AdamW as the ``bf16``/``fp16`` recipes (2 + 2 + 12 against 4 + 4 + 8), but autocast holds other
  activations, so torch plans without FSDP in those recipes are refused (below). Under DeepSpeed the flags must equal ds_config's ``bf16.enabled``/``fp16.enabled``
  (``HfTrainerDeepSpeedConfig.trainer_config_process`` records a mismatch otherwise): ``bf16`` and
  ``bf16-pure`` -> ``bf16: true`` (the pure-bf16 keys live in ds_config.json); ``fp16`` -> ``fp16: true``;
  the AMP recipes -> both false, because their ds_config disables ``bf16``/``fp16`` and autocasts through
  its ``torch_autocast`` section.
- Optimizer (``OptimizerNames`` in ``training_args.py``; ``trainer_optimizer.py`` handlers): ``adamw`` ->
  ``adamw_torch_fused`` (torch AdamW, ``fused=True``), ``adamw8bit`` -> ``adamw_bnb_8bit`` (bitsandbytes
  AdamW, 8-bit states), ``adafactor`` -> ``adafactor`` (transformers' Adafactor with
  ``scale_parameter=False, relative_step=False``: absolute learning rate, 1e-3 as its docstring recommends),
  ``sgd`` -> ``sgd`` (torch SGD; ``optim_args: "momentum=0.9"``). Learning rate, betas, epsilon and weight
  decay equal ``deepspeed.ADAMW_PARAMS`` / ``SGD_PARAMS``, the values ds_config.json names, because HF's
  DeepSpeed integration compares them (``optimizer.params.lr|betas|eps|weight_decay``). With an optimizer
  section in ds_config the Trainer ignores ``optim`` and DeepSpeed builds the optimizer
  (``deepspeed_optim_sched``); the scheduler is HF's (cosine, 1 % warmup: ``warmup_steps`` < 1 is a ratio).
- Clipping: ``max_grad_norm`` = ds_config's ``gradient_clipping`` (1.0 unless changed; compared by HF).
- Activation checkpointing: transformers 5.x renamed ``gradient_checkpointing[_kwargs]`` to
  ``activation_checkpointing[_kwargs]`` (the old names are deprecated aliases, removed in v6; 5.17 has only
  the old names, 5.24 both), so the file uses the names the installed TrainingArguments has
  (:func:`checkpointing_field`; the old ones when transformers is not installed: every 4.x and 5.x takes
  them) with ``{"use_reentrant": false}``. Under FSDP the Trainer refuses both FSDP's and its own
  checkpointing (``trainer.py``), and FSDP's is preferred (no redundant all-gather), so FSDP plans set
  ``fsdp_config.activation_checkpointing`` instead. Selective recompute has no TrainingArguments switch
  (a note says to do it in the model).
- Sharding: the deepspeed engine -> ``deepspeed: <ds_config name>`` (the file written by
  ``optplan.planner.export.deepspeed``); torch FSDP -> ``fsdp: true`` and ``fsdp_config`` for FSDP2
  (``version: 2``, the default in 5.x; ``reshard_after_forward`` true = FULL_SHARD, false = SHARD_GRAD_OP;
  ``cpu_offload`` = FSDP2's CPUOffloadPolicy: parameters, gradients and the optimizer step on the CPU;
  ``TRANSFORMER_BASED_WRAP`` of ``transformer_layer_cls_to_wrap = [block_class]``); plain DDP on several GPUs
  -> ``ddp_find_unused_parameters: false`` (the Trainer's default is true for models outside
  ``PreTrainedModel``, an extra pass over the graph every step).

Refused plans (``NotExportable``, one line naming the fix): the megatron engine; the ``bf16``/``fp16`` recipes on the torch engine without FSDP (16-bit
weights with fp32 masters, which ``bf16: true`` runs as autocast: ``context.refuse_autocast_for_16bit_weights``); tensor, pipeline or
context parallelism; fp8 (TrainingArguments has no fp8 switch); ``bf16-pure`` on the torch engine (no
TrainingArguments switch keeps bf16 parameters: ``bf16: true`` is autocast, and accelerate upcasts FSDP
parameters to fp32 masters); partial checkpointing (``checkpoint_layers``: TrainingArguments checkpoint every
layer or none); hybrid FSDP (FSDP2's HSDP needs an accelerate ``ParallelismConfig`` object,
which JSON cannot carry); FSDP without a repeated block class to wrap; and every deepspeed-engine plan that
ds_config.json cannot express (the rules of ``optplan.planner.export.deepspeed``).

The renderer imports no third-party package (``installed_transformers_version`` reads package metadata only).
"""

from __future__ import annotations

import json
import math
import re
from importlib import metadata
from typing import Any

from optplan.estimators.errors import OptplanError
from optplan.estimators.strategy import Strategy
from optplan.planner.export.context import (
    SELECTIVE_CHECKPOINTING_HOWTO,
    ExportPlan,
    NotExportable,
    refuse_autocast_for_16bit_weights,
    sixteen_bit_reduce_note,
)
from optplan.planner.export.deepspeed import ADAMW_PARAMS, SGD_PARAMS

TRANSFORMERS_VERSION_READ = "5.23.0"
"""The transformers version whose sources the mappings above were read from."""

MAX_GRAD_NORM = 1.0
"""Default ``max_grad_norm``: ds_config's default ``gradient_clipping`` (``render_ds_config``)."""
ADAFACTOR_LR = 1e-3
"""transformers' Adafactor with ``scale_parameter=False, relative_step=False`` (``optimization.py`` docstring)."""
WARMUP_RATIO = 0.01
"""``warmup_steps`` below 1 is a fraction of the training steps (``TrainingArguments.get_warmup_steps``)."""
LR_SCHEDULER = "cosine"

OPTIM_NAMES: dict[str, str] = {
    "adamw": "adamw_torch_fused",
    "adamw8bit": "adamw_bnb_8bit",
    "adafactor": "adafactor",
    "sgd": "sgd",
    "paged_adamw": "paged_adamw_32bit",
    "paged_adamw8bit": "paged_adamw_8bit",
}
"""optplan optimizer -> ``TrainingArguments.optim`` (``OptimizerNames`` values, transformers 5.23)."""

FSDP_RESHARD: dict[str, bool] = {"full": True, "grad_op": False}
"""FSDP2 ``reshard_after_forward``: true = FULL_SHARD (ZeRO-3), false = SHARD_GRAD_OP (ZeRO-2)."""

FSDP_CONFIG_DEFAULTS: dict[str, Any] = {
    "version": 2, "reshard_after_forward": True, "cpu_offload": False, "activation_checkpointing": False,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_layer_cls_to_wrap": None,
}
"""What ``TrainingArguments._process_fsdp_args`` assumes for a key the file leaves out."""

_DDP_NOTE = (
    "launch one process per GPU (torchrun/accelerate launch, see launch.sh); an unlaunched Trainer spreads one "
    "process over all visible GPUs with nn.DataParallel"
)


# --- rendering ----------------------------------------------------------------------------------------


def _check_exportable(plan: ExportPlan) -> None:
    """Raise NotExportable for plans TrainingArguments cannot express (the message names the fix)."""
    s = plan.strategy
    if s.engine == "megatron":
        raise NotExportable(
            "this plan runs on the megatron engine, which Hugging Face TrainingArguments cannot configure: "
            "launch it with Megatron-LM's own arguments, or plan with --engine deepspeed or --engine torch"
        )
    if s.model_parallel:
        degrees = ", ".join(f"{n}={getattr(s, n)}" for n in ("tp", "pp", "cp") if getattr(s, n) > 1)
        raise NotExportable(
            f"Hugging Face TrainingArguments cover data parallelism (DDP, FSDP, DeepSpeed ZeRO) and this plan uses "
            f"{degrees}: plan with --tp 1 --pp 1 --cp 1, or launch it with Megatron-LM"
        )
    if s.precision == "fp8":
        raise NotExportable(
            "TrainingArguments have no fp8 switch: run fp8 through accelerate (mixed_precision fp8 with "
            "Transformer Engine) or the Lightning export (precision 'transformer-engine'), or plan with "
            "--precision bf16"
        )
    if s.checkpoint_layers is not None:
        raise NotExportable(
            f"TrainingArguments checkpoint every layer or none, and this plan checkpoints the first "
            f"{s.checkpoint_layers} blocks only (partial checkpointing): use the train.py or accelerate export "
            "(train.py checkpoints those blocks itself), or plan with --checkpointing full"
        )
    if s.engine == "deepspeed":
        from optplan.planner.export.deepspeed import render_ds_config

        try:  # the ds_config.json this file points to must exist
            render_ds_config(s, plan.buckets)
        except OptplanError as exc:
            raise NotExportable(str(exc)) from exc
        return
    # torch engine
    refuse_autocast_for_16bit_weights(plan, f"TrainingArguments' {s.precision}=true")
    if s.precision == "bf16-pure":
        raise NotExportable(
            "TrainingArguments have no pure-bf16 switch (bf16=true is autocast over fp32 parameters, and accelerate "
            "upcasts FSDP parameters to fp32): use the Lightning export (precision 'bf16-true'), --engine deepspeed "
            "(ds_config bf16_master_weights_and_grads), or --precision bf16"
        )
    if s.fsdp == "hybrid":
        raise NotExportable(
            "hybrid FSDP (HSDP) needs an accelerate ParallelismConfig(dp_replicate_size, dp_shard_size) object with "
            "FSDP2, which a TrainingArguments JSON cannot carry: use the accelerate or Lightning export, or plan "
            "with --fsdp full"
        )
    if s.fsdp != "none" and not plan.block_class:
        raise NotExportable(
            "FSDP wraps one repeated block at a time and the model profile names no repeated block class: profile "
            "a model whose layers repeat, or plan with --engine deepspeed"
        )


def _precision_args(s: Strategy) -> dict[str, bool]:
    if s.engine == "deepspeed":
        # Must equal ds_config bf16.enabled / fp16.enabled (HfTrainerDeepSpeedConfig.trainer_config_process).
        return {"bf16": s.precision in ("bf16", "bf16-pure"), "fp16": s.precision == "fp16"}
    return {"bf16": s.precision in ("bf16", "amp-bf16"), "fp16": s.precision in ("fp16", "amp-fp16")}


def _optimizer_args(s: Strategy) -> dict[str, Any]:
    out: dict[str, Any] = {"optim": OPTIM_NAMES[s.optimizer]}
    if s.optimizer in ("adamw", "adamw8bit", "paged_adamw", "paged_adamw8bit"):
        betas = ADAMW_PARAMS["betas"]
        out.update(learning_rate=float(ADAMW_PARAMS["lr"]), weight_decay=float(ADAMW_PARAMS["weight_decay"]),
                   adam_beta1=float(betas[0]), adam_beta2=float(betas[1]), adam_epsilon=float(ADAMW_PARAMS["eps"]))
    elif s.optimizer == "sgd":
        out.update(learning_rate=float(SGD_PARAMS["lr"]), weight_decay=float(SGD_PARAMS["weight_decay"]),
                   optim_args=f"momentum={SGD_PARAMS['momentum']}")
    else:  # adafactor
        out.update(learning_rate=ADAFACTOR_LR, weight_decay=0.0)
    return out


NEW_CHECKPOINTING_FIELD = "activation_checkpointing"
OLD_CHECKPOINTING_FIELD = "gradient_checkpointing"


CHECKPOINTING_RENAMED_IN = (5, 23)
"""The transformers release whose TrainingArguments first has ``activation_checkpointing[_kwargs]`` (checked on the
wheels: 5.22.0's training_args.py has only ``gradient_checkpointing``, 5.23.0 both)."""


def installed_transformers_version() -> tuple[int, int] | None:
    """(major, minor) of the installed transformers, read from its metadata (no import: the renderers stay
    fast), or None when it is not installed or its version does not parse."""
    try:
        text = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else None


def checkpointing_field(version: tuple[int, int] | None = None) -> str:
    """TrainingArguments' name for activation checkpointing: ``activation_checkpointing`` from transformers 5.23
    (:data:`CHECKPOINTING_RENAMED_IN`), else ``gradient_checkpointing``: 5.17, the GPU machine's release in
    benchmarks/results/2026-11-26-H200, rejects the new name, and every 4.x and 5.x release takes the old one
    (also chosen when transformers is not installed). ``version`` defaults to the installed one."""
    have = installed_transformers_version() if version is None else version
    return NEW_CHECKPOINTING_FIELD if have is not None and have >= CHECKPOINTING_RENAMED_IN else OLD_CHECKPOINTING_FIELD


def hf_training_args(plan: ExportPlan, *, ds_config_name: str = "ds_config.json", output_dir: str = "out",
                     max_grad_norm: float = MAX_GRAD_NORM) -> dict[str, Any]:
    """The TrainingArguments fields for ``plan`` (a fresh, JSON-serialisable dict).

    ``max_grad_norm`` must equal the ``gradient_clipping`` ds_config.json was rendered with (HF compares
    them). Raises NotExportable for plans TrainingArguments cannot express and OptplanError for an empty
    name or a negative clipping norm.
    """
    for label, value in (("ds_config name", ds_config_name), ("output_dir", output_dir)):
        if not isinstance(value, str) or not value.strip():
            raise OptplanError(f"{label} must be a non-empty string (got {value!r})")
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) \
            or not math.isfinite(max_grad_norm) or max_grad_norm < 0:
        raise OptplanError(f"max_grad_norm must be a finite number >= 0 (got {max_grad_norm!r}); 0 disables clipping")
    _check_exportable(plan)
    s = plan.strategy
    args: dict[str, Any] = {
        "output_dir": output_dir,
        "per_device_train_batch_size": s.mbs,
        "gradient_accumulation_steps": s.grad_accum,
    }
    args.update(_optimizer_args(s))
    args.update(lr_scheduler_type=LR_SCHEDULER, warmup_steps=WARMUP_RATIO, max_grad_norm=float(max_grad_norm))
    args.update(_precision_args(s))
    own_checkpointing = s.checkpointing == "full" and s.fsdp == "none"
    field = checkpointing_field()
    args[field] = own_checkpointing
    if own_checkpointing:
        args[f"{field}_kwargs"] = {"use_reentrant": False}
    if s.engine == "deepspeed":
        args["deepspeed"] = ds_config_name
    elif s.fsdp != "none":
        args["fsdp"] = True
        args["fsdp_config"] = {
            "version": 2,
            "reshard_after_forward": FSDP_RESHARD[s.fsdp],
            "cpu_offload": s.offload_params == "cpu",
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": [plan.block_class],
            "activation_checkpointing": s.checkpointing == "full",
        }
    elif plan.world_size > 1:
        args["ddp_find_unused_parameters"] = False
    args.update(fsdp_accumulation_args(s))
    if s.compile:
        args["torch_compile"] = True
    return args


def fsdp_accumulation_args(s: Strategy) -> dict[str, Any]:
    """TrainingArguments that make the Trainer reduce FSDP's gradients as the plan does under gradient accumulation
    (empty when the plan has no FSDP or no accumulation). Without ``sync_each_batch`` transformers' Trainer runs
    every micro-batch but the last under ``accelerator.no_sync`` (FSDP2: ``set_requires_gradient_sync(False)``),
    which holds each unit's gradient unsharded until the last micro-batch: the plan's ``fsdp_grad_sync="step"``
    (estimators/fsdp_grad_sync.py, written explicitly as ``sync_each_batch: false``); a ``"micro_batch"`` plan
    prices a reduce-scatter per micro-batch, what ``sync_each_batch: true`` makes the Trainer do."""
    if s.fsdp == "none" or s.engine != "torch" or s.grad_accum <= 1:
        return {}
    return {"accelerator_config": {"gradient_accumulation_kwargs": {"sync_each_batch": s.fsdp_grad_sync != "step"}}}


def render_hf_training_args(plan: ExportPlan, *, ds_config_name: str = "ds_config.json", output_dir: str = "out",
                            max_grad_norm: float = MAX_GRAD_NORM) -> str:
    """``hf_training_args`` as JSON text (indent 2, trailing newline): the ``hf_training_args.json`` file."""
    args = hf_training_args(plan, ds_config_name=ds_config_name, output_dir=output_dir, max_grad_norm=max_grad_norm)
    return json.dumps(args, indent=2) + "\n"


def hf_notes(plan: ExportPlan) -> tuple[str, ...]:
    """What the training script must do beyond ``TrainingArguments(**json.load(f))`` (plan must be exportable)."""
    _check_exportable(plan)
    s = plan.strategy
    notes: list[str] = []
    if plan.world_size > 1 or s.engine != "torch":
        notes.append(f"{_DDP_NOTE}: {plan.nodes} node(s) x {plan.procs_per_node} process(es)")
    else:
        notes.append("single GPU: run with CUDA_VISIBLE_DEVICES set to one GPU; an unlaunched Trainer spreads "
                     "one process over all visible GPUs with nn.DataParallel")
    if s.engine == "deepspeed":
        notes.append("the deepspeed key names ds_config.json (optplan's DeepSpeed export) relative to the directory "
                     "the script runs in; both files must be exported from the same plan (HF checks batch size, "
                     "accumulation, clipping, optimizer hyper-parameters and bf16/fp16 against it)")
        if s.precision in ("amp-bf16", "amp-fp16"):
            notes.append(f"{s.precision}: bf16 and fp16 stay false: ds_config.json disables DeepSpeed's bf16/fp16 "
                         "modes and autocasts through its torch_autocast section; keep the model in fp32")
        if s.optimizer in ("adamw8bit", "adafactor"):
            notes.append(f"{s.optimizer}: ds_config.json has no optimizer section, so the Trainer builds "
                         f"optim={OPTIM_NAMES[s.optimizer]} itself and hands it to DeepSpeed")
    if s.optimizer in ("adamw8bit", "paged_adamw", "paged_adamw8bit"):
        notes.append(f"{OPTIM_NAMES[s.optimizer]} needs bitsandbytes installed (pip install bitsandbytes)")
    if s.checkpointing == "full" and s.fsdp == "none":
        notes.append("activation checkpointing: the Trainer calls model.activation_checkpointing_enable() "
                     "(PreTrainedModel); a model without it must checkpoint its blocks itself "
                     "(torch.utils.checkpoint.checkpoint(..., use_reentrant=False))")
    if s.checkpointing == "selective":
        notes.append(f"TrainingArguments has no switch for it: {SELECTIVE_CHECKPOINTING_HOWTO}")
    if s.fsdp != "none":
        notes.append(f"FSDP2 wraps each {plan.block_class} (fsdp_config.transformer_layer_cls_to_wrap): the name "
                     "must be the class name of the model's repeated block")
        reduce_note = sixteen_bit_reduce_note(s, "the Trainer (accelerate)", amp_gathers_16bit=True)
        if reduce_note:
            notes.append(reduce_note)
    if s.compile:
        notes.append("torch_compile: the Trainer compiles the whole model (torch.compile); the plan priced each "
                     "block's elementwise ops as fused, which whole-model compilation also gives")
    return tuple(notes)
