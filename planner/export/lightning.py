"""Lightning ``Trainer`` arguments for a plan: a pure function ExportPlan -> JSON text (its validator:
planner/export/lightning_check.py).

Schema of ``lightning.json`` (Lightning 2.6; sources: ``lightning/pytorch/trainer/trainer.py``,
``trainer/connectors/accelerator_connector.py``, ``strategies/{ddp,fsdp,deepspeed}.py``,
``fabric/strategies/{fsdp,deepspeed}.py``, ``fabric/connector.py`` ``_PRECISION_INPUT``)::

    {
      "accelerator": "gpu", "devices": 8, "num_nodes": 2,        # every key without a leading "_" is
      "strategy": "fsdp", "precision": "bf16-mixed",              # a lightning.pytorch.Trainer argument,
      "accumulate_grad_batches": 4,                               # usable as is
      "gradient_clip_val": 1.0, "gradient_clip_algorithm": "norm",
      "_strategy_kwargs": {...},   # present when the strategy needs more than its registry name
      "_optplan": {...}            # facts for the training script: batch size, optimizer, notes
    }

``strategy`` is a ``StrategyRegistry`` name ("ddp", "fsdp", "fsdp_cpu_offload", "deepspeed",
"deepspeed_stage_N[_offload[_nvme]]") or "auto" (one GPU). ``_strategy_kwargs`` are keyword arguments of that
registry entry's class (``StrategyRegistry[name]["strategy"]``), applied over the entry's ``init_params``; the
arguments that take module classes (``auto_wrap_policy``, ``activation_checkpointing_policy``, listed in
``_optplan.module_class_args``) hold class *names*, resolved against the model's modules, and
``device_mesh`` is a ``[replicas, shards]`` list (Lightning takes a tuple). Two lines apply the file::

    spec = json.load(open("lightning.json"))
    trainer = lightning.pytorch.Trainer(**lightning_trainer_kwargs(spec, model))

(``lightning_trainer_kwargs`` does exactly the resolution above; without optplan installed, do it by hand.)
``_optplan.batch_size`` is the per-GPU DataLoader batch size (Lightning takes it from the DataLoader) and
``_optplan.optimizer`` what ``configure_optimizers`` returns, unless DeepSpeed builds the optimizer.

Mappings:

- Processes: ``devices`` = processes per node, ``num_nodes`` = nodes; their product is the plan's world size.
- torch engine: one GPU -> "auto"; DDP -> "ddp"; FSDP -> "fsdp" (``fsdp_cpu_offload`` with parameter offload)
  with ``FSDPStrategy(sharding_strategy=FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD, auto_wrap_policy={block},
  activation_checkpointing_policy={block} for full checkpointing, cpu_offload=..., device_mesh=(nodes,
  GPUs per node) for HYBRID_SHARD)`` (Lightning's FSDPStrategy is torch FSDP1; ``CPUOffload(offload_params)``
  keeps parameters, gradients and the optimizer step on the CPU).
- deepspeed engine: ``DeepSpeedStrategy(config={...})`` with the ds_config of
  ``optplan.planner.export.deepspeed`` (same ZeRO, bucket, offload, precision, optimizer and activation
  checkpointing sections) minus what Lightning fills itself: ``gradient_accumulation_steps`` (Lightning refuses
  it in the config and sets it from ``accumulate_grad_batches``), ``gradient_clipping`` (from
  ``gradient_clip_val``) and ``train_batch_size`` (DeepSpeed derives it). The name is the registry preset that
  matches the stage and offload (``deepspeed_stage_3_offload`` ...), else "deepspeed"; a given config replaces
  the preset's arguments. With an optimizer section DeepSpeed builds the optimizer and Lightning does not call
  ``configure_optimizers`` (``DeepSpeedStrategy._initialize_deepspeed_train``).
- Precision (``_PRECISION_INPUT``): torch engine ``fp32`` -> "32-true", ``amp-bf16``/``bf16`` -> "bf16-mixed"
  (autocast over fp32 parameters under DDP; FSDP MixedPrecision(param_dtype=bf16) over fp32 sharded
  parameters: the same model-state bytes as the bf16 recipe), ``amp-fp16``/``fp16`` -> "16-mixed" (GradScaler),
  ``bf16-pure`` -> "bf16-true" (bf16 parameters and optimizer states, no master copy), ``fp8`` ->
  "transformer-engine" (Transformer Engine layers, bf16 weights; Lightning keeps no fp32 master copy, so model
  states take less memory than the plan's fp8 estimate). deepspeed engine: ``bf16`` -> "bf16-mixed", ``fp16``
  -> "16-mixed", ``bf16-pure`` -> "bf16-true", ``fp32`` and the AMP recipes -> "32-true" (DeepSpeed's own
  ``torch_autocast`` section autocasts; Lightning must not add a bf16/fp16 mode). Lightning's
  ``_format_precision_config`` leaves config sections that exist alone.

Refused plans (``NotExportable``, one line naming the fix): the megatron engine; the ``bf16``/``fp16`` recipes on the torch engine without FSDP
("bf16-mixed" is autocast there: ``context.refuse_autocast_for_16bit_weights``); tp/pp/cp > 1 (Lightning's
ModelParallelStrategy needs the model's own parallelisation code); fp8 with FSDP or DeepSpeed (their
precision plugins take no "transformer-engine"); FSDP without a repeated block class; a world size that does
not fill whole nodes; and every deepspeed-engine plan ds_config cannot express
(``optplan.planner.export.deepspeed``).

The renderer imports neither lightning nor torch; the validator and ``lightning_trainer_kwargs`` import
lightning lazily (about 3.5 s) and leave no global state behind.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
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
from optplan.planner.export.deepspeed import ADAMW_PARAMS, DEFAULT_NVME_PATH, SGD_PARAMS

LIGHTNING_VERSION_READ = "2.6.6"
"""The Lightning version whose sources the mappings above were read from."""

GRADIENT_CLIP_VAL = 1.0
"""Default ``gradient_clip_val``: ds_config's default ``gradient_clipping`` (``render_ds_config``)."""
TORCH_ADAFACTOR_LR = 1e-2
"""``torch.optim.Adafactor``'s default (its step is relative to the parameter RMS), as in
``deepspeed.ADAFACTOR_NOTE``."""

def _checkpointed_blocks(s: Strategy) -> str:
    """Which blocks full checkpointing wraps, in words: each, or the first ``checkpoint_layers`` (partial)."""
    return "each block" if s.checkpoint_layers is None else f"the first {s.checkpoint_layers} blocks"


MODULE_CLASS_ARGS: tuple[str, ...] = ("auto_wrap_policy", "activation_checkpointing_policy")
"""FSDPStrategy arguments that take a set of module classes; the JSON holds their names."""
RESERVED_KEYS: tuple[str, ...] = ("_strategy_kwargs", "_optplan")
"""The only keys with a leading underscore; every other key is a Trainer argument."""

FSDP_SHARDING: dict[str, str] = {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD_OP", "hybrid": "HYBRID_SHARD"}
"""optplan FSDP mode -> torch ``ShardingStrategy`` name (``FSDPStrategy(sharding_strategy=...)``)."""

_TORCH_PRECISION: dict[str, str] = {
    "fp32": "32-true", "amp-bf16": "bf16-mixed", "bf16": "bf16-mixed", "amp-fp16": "16-mixed",
    "fp16": "16-mixed", "bf16-pure": "bf16-true", "fp8": "transformer-engine",
}
_DEEPSPEED_PRECISION: dict[str, str] = {
    "fp32": "32-true", "amp-bf16": "32-true", "amp-fp16": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed",
    "bf16-pure": "bf16-true",
}
_DEEPSPEED_PRESETS: dict[tuple[int, str, str], str] = {
    (1, "none", "none"): "deepspeed_stage_1",
    (2, "none", "none"): "deepspeed_stage_2",
    (2, "cpu", "none"): "deepspeed_stage_2_offload",
    (3, "none", "none"): "deepspeed_stage_3",
    (3, "cpu", "cpu"): "deepspeed_stage_3_offload",
    (3, "nvme", "nvme"): "deepspeed_stage_3_offload_nvme",
}
"""(ZeRO stage, optimizer offload, parameter offload) -> the Lightning registry preset with exactly those."""
_LIGHTNING_FILLED = ("gradient_accumulation_steps", "gradient_clipping", "train_batch_size")
"""ds_config keys the Lightning config leaves out (Lightning or DeepSpeed derives them)."""


# --- rendering ----------------------------------------------------------------------------------------


def _check_exportable(plan: ExportPlan) -> None:
    s = plan.strategy
    if s.engine == "megatron":
        raise NotExportable(
            "this plan runs on the megatron engine, which a Lightning Trainer cannot configure: launch it with "
            "Megatron-LM's own arguments, or plan with --engine torch or --engine deepspeed"
        )
    if s.model_parallel:
        degrees = ", ".join(f"{n}={getattr(s, n)}" for n in ("tp", "pp", "cp") if getattr(s, n) > 1)
        raise NotExportable(
            f"this plan uses {degrees}, and Lightning's ModelParallelStrategy needs the model's own tensor/pipeline "
            "parallel code: plan with --tp 1 --pp 1 --cp 1, or launch it with Megatron-LM"
        )
    world, per_node = plan.world_size, plan.procs_per_node
    if world != per_node * plan.nodes:
        raise NotExportable(
            f"the plan uses {world} GPUs, not a whole number of {plan.gpus_per_node}-GPU nodes, and Lightning starts "
            "the same number of processes on every node: re-plan with a GPU count that fills whole nodes"
        )
    if s.engine == "deepspeed":
        from optplan.planner.export.deepspeed import render_ds_config

        try:
            render_ds_config(s, plan.buckets)
        except OptplanError as exc:
            raise NotExportable(str(exc)) from exc
        return
    refuse_autocast_for_16bit_weights(plan, f"Lightning's precision '{_TORCH_PRECISION[s.precision]}'")
    if s.precision == "fp8" and s.fsdp != "none":
        raise NotExportable(
            "Lightning's FSDP precision plugin has no 'transformer-engine' (fp8) mode: use DDP (--fsdp none) for "
            "fp8, or plan with --precision bf16"
        )
    if s.fsdp != "none" and s.fsdp_grad_sync == "step" and s.grad_accum > 1:
        raise NotExportable(
            "Lightning's Trainer reduce-scatters FSDP gradients after every micro-batch (its block_backward_sync "
            "skips only DDP's): plan with --fsdp-grad-sync micro_batch, or export accelerate or hf"
        )
    if s.fsdp != "none" and not plan.block_class:
        raise NotExportable(
            "FSDP wraps one repeated block at a time and the model profile names no repeated block class: profile "
            "a model whose layers repeat, or plan with --engine deepspeed"
        )


def _precision(s: Strategy) -> str:
    return (_DEEPSPEED_PRECISION if s.engine == "deepspeed" else _TORCH_PRECISION)[s.precision]


def _deepspeed_config(plan: ExportPlan, nvme_path: str) -> dict[str, Any]:
    """ds_config.json of the DeepSpeed export, less the keys Lightning fills (``_LIGHTNING_FILLED``)."""
    from optplan.planner.export.deepspeed import render_ds_config

    config = render_ds_config(plan.strategy, plan.buckets, nvme_path=nvme_path)
    for key in _LIGHTNING_FILLED:
        config.pop(key, None)
    return config


def _strategy(plan: ExportPlan, nvme_path: str) -> tuple[str, dict[str, Any] | None, str]:
    """(registry name or "auto", strategy kwargs or None, strategy class path)."""
    s = plan.strategy
    if s.engine == "deepspeed":
        name = _DEEPSPEED_PRESETS.get((s.zero, s.offload_optimizer, s.offload_params), "deepspeed")
        return name, {"config": _deepspeed_config(plan, nvme_path)}, "lightning.pytorch.strategies.DeepSpeedStrategy"
    if s.fsdp != "none":
        kwargs: dict[str, Any] = {
            "sharding_strategy": FSDP_SHARDING[s.fsdp],
            "auto_wrap_policy": [plan.block_class],
            "cpu_offload": s.offload_params == "cpu",
        }
        if s.checkpointing == "full" and s.checkpoint_layers is None:  # the policy takes every block of the class
            kwargs["activation_checkpointing_policy"] = [plan.block_class]
        if s.fsdp == "hybrid":
            kwargs["device_mesh"] = [plan.nodes, plan.procs_per_node]
        name = "fsdp_cpu_offload" if s.offload_params == "cpu" else "fsdp"
        return name, kwargs, "lightning.pytorch.strategies.FSDPStrategy"
    if plan.world_size > 1:
        return "ddp", None, "lightning.pytorch.strategies.DDPStrategy"
    return "auto", None, "lightning.pytorch.strategies.SingleDeviceStrategy"


BNB_OPTIMIZERS: dict[str, str] = {"adamw8bit": "bitsandbytes.optim.AdamW8bit",
                                  "paged_adamw": "bitsandbytes.optim.PagedAdamW",
                                  "paged_adamw8bit": "bitsandbytes.optim.PagedAdamW8bit"}
"""The bitsandbytes optimizer class configure_optimizers returns, by optplan optimizer."""


def _optimizer(s: Strategy) -> dict[str, Any]:
    betas = list(ADAMW_PARAMS["betas"])
    adamw = {"lr": ADAMW_PARAMS["lr"], "betas": betas, "eps": ADAMW_PARAMS["eps"],
             "weight_decay": ADAMW_PARAMS["weight_decay"]}
    if s.engine == "deepspeed" and s.optimizer in ("adamw", "sgd"):
        # What DeepSpeedEngine._configure_basic_optimizer builds from the config's optimizer section.
        cls = "torch.optim.SGD" if s.optimizer == "sgd" else \
            "deepspeed.ops.adam.DeepSpeedCPUAdam" if s.offload_optimizer != "none" else "deepspeed.ops.adam.FusedAdam"
        return {"built_by": "deepspeed", "config_section": "_strategy_kwargs.config.optimizer", "class": cls}
    if s.optimizer == "adamw":
        return {"built_by": "configure_optimizers", "class": "torch.optim.AdamW", "kwargs": dict(adamw, fused=True)}
    if s.optimizer in BNB_OPTIMIZERS:
        return {"built_by": "configure_optimizers", "class": BNB_OPTIMIZERS[s.optimizer], "kwargs": adamw}
    if s.optimizer == "adafactor":
        return {"built_by": "configure_optimizers", "class": "torch.optim.Adafactor",
                "kwargs": {"lr": TORCH_ADAFACTOR_LR}}
    return {"built_by": "configure_optimizers", "class": "torch.optim.SGD", "kwargs": dict(SGD_PARAMS)}


def lightning_notes(plan: ExportPlan) -> tuple[str, ...]:
    """What the training script must do beyond the Trainer arguments (also stored under ``_optplan.notes``)."""
    _check_exportable(plan)
    s = plan.strategy
    notes = [f"DataLoader(batch_size={s.mbs}) per GPU: global batch {s.global_batch} = {s.mbs} x accumulate "
             f"{s.grad_accum} x {plan.world_size} GPU(s)"]
    if plan.multi_node:
        notes.append(f"start the same script on each of the {plan.nodes} nodes (MASTER_ADDR, MASTER_PORT, NODE_RANK, "
                     "or SLURM's srun); Lightning starts the per-node processes")
    if s.fsdp != "none" and s.checkpointing == "full" and s.checkpoint_layers is None:
        notes.append(f"FSDP wraps (and checkpoints) each {plan.block_class}: auto_wrap_policy and "
                     "activation_checkpointing_policy name the model's repeated block class")
    elif s.fsdp != "none":
        notes.append(f"FSDP wraps each {plan.block_class}: auto_wrap_policy names the model's repeated block class")
    reduce_note = sixteen_bit_reduce_note(s, f"Lightning's precision '{_precision(s)}'",
                                         amp_gathers_16bit=False)
    if reduce_note:
        notes.append(reduce_note)
    if s.engine == "deepspeed":
        if s.optimizer in ("adamw", "sgd"):
            notes.append("DeepSpeed builds the optimizer from the config's optimizer section; Lightning then does "
                         "not call configure_optimizers (drop the section to use your own; under optimizer offload "
                         "it must be deepspeed.ops.adam.DeepSpeedCPUAdam)")
        if s.precision in ("amp-bf16", "amp-fp16"):
            notes.append(f"{s.precision}: precision '32-true' is deliberate: the config's torch_autocast section "
                         "makes DeepSpeed autocast the forward; keep the model in fp32")
        if s.checkpointing == "full":
            notes.append(f"activation checkpointing: wrap {_checkpointed_blocks(s)} with "
                         "deepspeed.checkpointing.checkpoint (Lightning configures it from the config's "
                         "activation_checkpointing section)")
    elif s.checkpointing == "full" and (s.fsdp == "none" or s.checkpoint_layers is not None):
        whose = "each block's" if s.checkpoint_layers is None else f"the first {s.checkpoint_layers} blocks'"
        notes.append(f"activation checkpointing: wrap {whose} forward in "
                     "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) in the model"
                     + ("" if s.checkpoint_layers is None else " (FSDPStrategy's activation_checkpointing_policy "
                                                               "would take every block of the class)"))
    if s.checkpointing == "selective":
        notes.append(SELECTIVE_CHECKPOINTING_HOWTO)
    if s.precision == "fp8":
        notes.append("fp8: precision 'transformer-engine' needs transformer_engine installed; Lightning swaps "
                     "nn.Linear/LayerNorm for TE layers and keeps bf16 weights without an fp32 master copy")
    if s.optimizer in BNB_OPTIMIZERS:
        notes.append(f"{s.optimizer}: configure_optimizers returns {BNB_OPTIMIZERS[s.optimizer]} "
                     "(pip install bitsandbytes)")
    if s.compile:
        notes.append("torch.compile: Lightning's Trainer has no switch for it: compile each repeated block "
                     "(block.compile()) in configure_model, as the plan priced (fused elementwise kernels)")
    if s.loss_compiled:
        notes.append("the plan compiles the loss function: call it compiled in training_step "
                     "(torch.compile(loss_fn): its fused cross entropy holds the logits and their gradient only, as "
                     "the plan priced the memory); an eager loss holds more: re-plan with --eager-loss to price it")
    return tuple(notes)


def lightning_spec(plan: ExportPlan, *, gradient_clip_val: float = GRADIENT_CLIP_VAL,
                   nvme_path: str = DEFAULT_NVME_PATH) -> dict[str, Any]:
    """The lightning.json document for ``plan`` (a fresh, JSON-serialisable dict; schema in the module docstring).

    Raises NotExportable for plans Lightning cannot run as planned, OptplanError for a negative clipping norm
    or an empty NVMe path when the plan offloads to NVMe.
    """
    if isinstance(gradient_clip_val, bool) or not isinstance(gradient_clip_val, (int, float)) \
            or not math.isfinite(gradient_clip_val) or gradient_clip_val < 0:
        raise OptplanError(f"gradient_clip_val must be a finite number >= 0 (got {gradient_clip_val!r}); "
                           "0 disables clipping")
    _check_exportable(plan)
    s = plan.strategy
    if "nvme" in (s.offload_optimizer, s.offload_params) and not (isinstance(nvme_path, str) and nvme_path.strip()):
        raise OptplanError("NVMe offload needs a directory on a local NVMe drive: pass --nvme-path PATH")
    name, strategy_kwargs, strategy_class = _strategy(plan, nvme_path)
    spec: dict[str, Any] = {
        "accelerator": "gpu",
        "devices": plan.procs_per_node,
        "num_nodes": plan.nodes,
        "strategy": name,
        "precision": _precision(s),
        "accumulate_grad_batches": s.grad_accum,
        "gradient_clip_val": float(gradient_clip_val),
        "gradient_clip_algorithm": "norm",
    }
    if strategy_kwargs is not None:
        spec["_strategy_kwargs"] = strategy_kwargs
    spec["_optplan"] = {
        "plan": s.label(),
        "world_size": plan.world_size,
        "batch_size": s.mbs,
        "global_batch": s.global_batch,
        "strategy_class": strategy_class,
        "module_class_args": [k for k in MODULE_CLASS_ARGS if strategy_kwargs and k in strategy_kwargs],
        "optimizer": _optimizer(s),
        "notes": list(lightning_notes(plan)),
    }
    return spec


def render_lightning_json(plan: ExportPlan, *, gradient_clip_val: float = GRADIENT_CLIP_VAL,
                          nvme_path: str = DEFAULT_NVME_PATH) -> str:
    """``lightning_spec`` as JSON text (indent 2, trailing newline): the ``lightning.json`` file."""
    return json.dumps(lightning_spec(plan, gradient_clip_val=gradient_clip_val, nvme_path=nvme_path), indent=2) + "\n"


# --- applying the file -------------------------------------------------------------------------------------


def _resolve_classes(names: Any, classes: Mapping[str, type], key: str) -> set[type]:
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise OptplanError(f"_strategy_kwargs.{key} must be a list of module class names (got {names!r})")
    missing = [n for n in names if n not in classes]
    if missing:
        raise OptplanError(f"_strategy_kwargs.{key} names {', '.join(map(repr, missing))}, which the model has no "
                           "module of: use the class name of the model's repeated block")
    return {classes[n] for n in names}


def build_strategy(name: str, strategy_kwargs: Mapping[str, Any], classes: Mapping[str, type]) -> Any:
    """The Lightning strategy object for registry ``name`` with ``strategy_kwargs`` from lightning.json.

    Class names under ``MODULE_CLASS_ARGS`` are looked up in ``classes`` (name -> module class) and
    ``device_mesh`` lists become tuples. Imports lightning.
    """
    from lightning.pytorch.strategies import StrategyRegistry

    if name not in StrategyRegistry:
        raise OptplanError(f"strategy {name!r} is not in Lightning's StrategyRegistry")
    entry = StrategyRegistry[name]
    kwargs = dict(copy.deepcopy(dict(strategy_kwargs)))
    for key in MODULE_CLASS_ARGS:
        if key in kwargs and kwargs[key] is not None:
            kwargs[key] = _resolve_classes(kwargs[key], classes, key)
    if isinstance(kwargs.get("device_mesh"), list):
        kwargs["device_mesh"] = tuple(kwargs["device_mesh"])
    return entry["strategy"](**{**entry["init_params"], **kwargs})


def lightning_trainer_kwargs(spec: Mapping[str, Any], model: Any = None) -> dict[str, Any]:
    """``Trainer(**lightning_trainer_kwargs(spec, model))``: the Trainer arguments of a lightning.json document.

    Keys with a leading underscore are dropped; with ``_strategy_kwargs`` the ``strategy`` name becomes the
    strategy object (module class names resolved against ``model.modules()``). Imports lightning only then.
    """
    kwargs = {k: copy.deepcopy(v) for k, v in spec.items() if not k.startswith("_")}
    strategy_kwargs = spec.get("_strategy_kwargs")
    if strategy_kwargs:
        classes: dict[str, type] = {}
        if model is not None:
            classes = {type(m).__name__: type(m) for m in model.modules()}
        elif any(k in strategy_kwargs for k in MODULE_CLASS_ARGS):
            raise OptplanError("lightning.json names module classes (FSDP wrapping): pass the model to resolve them")
        kwargs["strategy"] = build_strategy(kwargs.get("strategy", "auto"), strategy_kwargs, classes)
    return kwargs
