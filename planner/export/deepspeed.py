"""DeepSpeed ``ds_config.json`` for a Strategy (pure function; deepspeed is not imported here).

Key names and behaviours follow deepspeed 0.19.8 (``deepspeed/runtime/config.py``,
``runtime/precision_config.py``, ``runtime/constants.py``, ``runtime/zero/config.py``,
``runtime/zero/offload_config.py``, ``runtime/engine.py``):

- AMP recipes use the ``torch_autocast`` section (``enabled``, ``dtype``, optional
  ``lower_precision_safe_modules``: the module classes whose gradients are reduced in the autocast
  dtype, default Linear and Conv1d/2d/3d). Parameters stay fp32; the engine wraps forward in
  ``torch.autocast`` and adds a GradScaler itself for float16. ``bf16``/``fp16`` stay disabled.
- ``bf16-pure`` is ``bf16`` with ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``;
  DeepSpeed accepts those with ZeRO 1-3 only, and with optimizer offload only with its own CPU Adam.
- An optimizer named in the config is built by DeepSpeed; ``SGD`` resolves to ``torch.optim.SGD``,
  which ZeRO treats as untested (``zero_allow_untested_optimizer`` must be true). 8-bit AdamW and
  Adafactor are no DeepSpeed optimizers: the config leaves the optimizer out (and sets
  ``zero_allow_untested_optimizer`` under ZeRO) and the training script passes its own optimizer
  (``bitsandbytes.optim.AdamW8bit``, ``torch.optim.Adafactor``) to ``deepspeed.initialize(optimizer=...)``
  (see ``deepspeed_notes``). Under optimizer offload DeepSpeed refuses client optimizers that are not
  its CPU Adam/Lion (``zero_force_ds_cpu_optimizer``, ``runtime/engine.py``), so those plans are refused.
- NVMe optimizer offload works with ZeRO-3 only (ZeRO-1/2 silently treat it as CPU offload), and
  DeepSpeed does not notice a missing ``nvme_path``: the exporter always writes one.
- ``activation_checkpointing`` configures DeepSpeed's full (per-block) checkpointing; selective
  checkpointing (the training loop's op-level policy, estimators/selective.py) is done in the model, so a
  selective plan gets no section, only a note.

Plans a ds_config.json cannot express are refused with one OptplanError line naming the fix: another
engine (torch FSDP/DDP, Megatron-LM), tensor/pipeline/context parallelism (ds_config covers ZeRO data
parallelism; those need Megatron-DeepSpeed arguments), and fp8 (DeepSpeed's config has no fp8 recipe).

Bucket sizes come from ``optplan.estimators.buckets.deepspeed_buckets`` so the memory estimate and
the exported file agree.
"""

from __future__ import annotations

import json
from typing import Any

from optplan.estimators.buckets import DeepSpeedBuckets, deepspeed_buckets
from optplan.estimators.errors import OptplanError
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.planner.export.context import SELECTIVE_CHECKPOINTING_HOWTO

DEFAULT_NVME_PATH = "/local_nvme"

ADAMW_PARAMS: dict[str, Any] = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
SGD_PARAMS: dict[str, Any] = {"lr": 3e-4, "momentum": 0.9, "weight_decay": 0.0}

FP16_SECTION: dict[str, Any] = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}

_AUTOCAST_DTYPE = {"amp-bf16": "bfloat16", "amp-fp16": "float16"}

CLIENT_OPTIMIZER_NOTE = (
    "optimizer adamw8bit is not a DeepSpeed optimizer: ds_config.json has no 'optimizer' section; build "
    "bitsandbytes.optim.AdamW8bit(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, "
    "weight_decay=0.1) in the training script and pass it as deepspeed.initialize(optimizer=...)"
)
ADAFACTOR_NOTE = (
    "optimizer adafactor is not a DeepSpeed optimizer: ds_config.json has no 'optimizer' section; build "
    "torch.optim.Adafactor(model.parameters(), lr=1e-2) (torch >= 2.5; factored second moment, no first "
    "moment) in the training script and pass it as deepspeed.initialize(optimizer=...); under ZeRO 1-3 "
    "DeepSpeed hands it flat 1-D partitions, so its second moment is not factored there"
)
SELECTIVE_CHECKPOINTING_NOTE = (
    f"{SELECTIVE_CHECKPOINTING_HOWTO}; ds_config.json has no activation_checkpointing section, which configures "
    "DeepSpeed's full checkpointing only"
)
CLIENT_OPTIMIZERS = ("adamw8bit", "adafactor")
"""Optimizers the training script builds and hands to ``deepspeed.initialize(optimizer=...)``."""


def _check_exportable(strategy: Strategy) -> None:
    """Raise OptplanError for strategies DeepSpeed cannot run as planned (message names the fix)."""
    if strategy.engine == "torch":
        raise OptplanError(
            "this plan runs on the torch engine (DDP/FSDP), which ds_config.json cannot configure: export it "
            "for torch FSDP/accelerate instead, or plan with --engine deepspeed"
        )
    if strategy.engine != "deepspeed":
        raise OptplanError(
            f"this plan runs on the {strategy.engine} engine, which ds_config.json cannot configure: launch it "
            "with Megatron-LM's own arguments, or plan with --engine deepspeed"
        )
    if strategy.model_parallel:
        degrees = ", ".join(f"{name}={getattr(strategy, name)}" for name in ("tp", "pp", "cp")
                            if getattr(strategy, name) > 1)
        raise OptplanError(
            f"DeepSpeed's ds_config.json covers ZeRO data parallelism, and this plan uses {degrees}: "
            "tensor/pipeline/context-parallel plans need Megatron-DeepSpeed arguments; plan with "
            "--tp 1 --pp 1 --cp 1 for a ds_config.json"
        )
    if strategy.precision == "fp8":
        raise OptplanError(
            "DeepSpeed's config has no fp8 recipe: use Transformer Engine (te.fp8_autocast around TE layers) "
            "in the training script, or plan with --precision bf16"
        )
    if strategy.precision == "bf16-pure":
        if strategy.zero == 0:
            raise OptplanError(
                "bf16-pure needs ZeRO stage 1-3 in DeepSpeed (bf16_master_weights_and_grads is a ZeRO "
                "feature): use --zero 1 or higher, or --precision bf16 with ZeRO-0"
            )
        if strategy.offload_optimizer != "none" and strategy.optimizer != "adamw":
            raise OptplanError(
                f"bf16-pure with optimizer offload needs DeepSpeed's CPU Adam, not {strategy.optimizer}: "
                "use --optimizer adamw, or drop the optimizer offload"
            )
    if strategy.optimizer == "adamw8bit" and strategy.offload_optimizer != "none":
        raise OptplanError(
            "adamw-8bit (bitsandbytes) cannot run under DeepSpeed optimizer offload, which needs "
            "DeepSpeed's CPU Adam: use --optimizer adamw with the offload, or drop the offload"
        )
    if strategy.optimizer == "adafactor" and strategy.offload_optimizer != "none":
        raise OptplanError(
            "adafactor is a client optimizer, and DeepSpeed's optimizer offload needs its own CPU Adam: "
            "use --optimizer adamw with the offload, or drop the offload"
        )
    if strategy.offload_optimizer == "nvme" and strategy.zero != 3:
        raise OptplanError(
            f"NVMe optimizer offload needs ZeRO-3 in DeepSpeed (ZeRO-{strategy.zero} would silently "
            "offload to CPU instead): use --zero 3, or offload the optimizer to cpu"
        )


def _precision_sections(strategy: Strategy) -> dict[str, Any]:
    precision = strategy.precision
    if precision == "fp32":
        return {"bf16": {"enabled": False}, "fp16": {"enabled": False}}
    if precision == "bf16":
        return {"bf16": {"enabled": True}}
    if precision == "fp16":
        return {"fp16": dict(FP16_SECTION)}
    if precision in _AUTOCAST_DTYPE:
        # fp32 parameters, autocast compute; DeepSpeed adds a GradScaler for float16 by itself.
        return {
            "bf16": {"enabled": False},
            "fp16": {"enabled": False},
            "torch_autocast": {"enabled": True, "dtype": _AUTOCAST_DTYPE[precision]},
        }
    if precision == "bf16-pure":
        return {
            "bf16": {
                "enabled": True,
                "bf16_master_weights_and_grads": True,
                "bf16_optimizer_states": True,
            }
        }
    raise OptplanError(f"precision {precision!r} has no DeepSpeed export")  # pragma: no cover


def _optimizer_sections(strategy: Strategy) -> dict[str, Any]:
    if strategy.optimizer == "adamw":
        return {"optimizer": {"type": "AdamW", "params": dict(ADAMW_PARAMS, betas=list(ADAMW_PARAMS["betas"]))}}
    if strategy.optimizer == "sgd":
        out: dict[str, Any] = {"optimizer": {"type": "SGD", "params": dict(SGD_PARAMS)}}
        if strategy.zero > 0:
            # torch.optim.SGD is not in ZeRO's tested list; without this flag initialize() asserts.
            out["zero_allow_untested_optimizer"] = True
        return out
    if strategy.optimizer in CLIENT_OPTIMIZERS:
        # Client-side optimizer (bitsandbytes AdamW8bit, torch Adafactor): no optimizer section; ZeRO
        # asserts on optimizers outside its tested list unless zero_allow_untested_optimizer is set.
        return {"zero_allow_untested_optimizer": True} if strategy.zero > 0 else {}
    raise OptplanError(f"optimizer {strategy.optimizer!r} has no DeepSpeed export")  # pragma: no cover


def _offload(device: str, nvme_path: str) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        section["nvme_path"] = nvme_path
    return section


def _buckets(sizes: DeepSpeedBuckets | ModelProfile) -> DeepSpeedBuckets:
    """The bucket sizes: given, or derived from the model's profile."""
    return sizes if isinstance(sizes, DeepSpeedBuckets) else deepspeed_buckets(sizes)


def _zero_section(strategy: Strategy, buckets: DeepSpeedBuckets, nvme_path: str) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": strategy.zero,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": buckets.reduce_bucket_size,
        "allgather_bucket_size": buckets.allgather_bucket_size,
    }
    if strategy.zero == 3:
        zero.update(
            stage3_prefetch_bucket_size=buckets.stage3_prefetch_bucket_size,
            stage3_param_persistence_threshold=buckets.stage3_param_persistence_threshold,
            stage3_max_live_parameters=buckets.stage3_max_live_parameters,
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if strategy.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(strategy.offload_optimizer, nvme_path)
    if strategy.offload_params != "none":
        zero["offload_param"] = _offload(strategy.offload_params, nvme_path)
    return zero


def render_ds_config(strategy: Strategy, profile: DeepSpeedBuckets | ModelProfile, *, gradient_clipping: float = 1.0,
                     nvme_path: str = DEFAULT_NVME_PATH) -> dict[str, Any]:
    """The ds_config dict for ``strategy`` (a fresh dict; JSON-serialisable).

    ``profile`` is the model's profile or the bucket sizes already derived from it (an ExportPlan's
    ``buckets``). ``nvme_path`` is written only when the strategy offloads to NVMe. Raises OptplanError for a
    strategy DeepSpeed cannot run as planned (bf16-pure at ZeRO-0, NVMe optimizer offload below
    ZeRO-3, 8-bit AdamW, Adafactor or SGD-with-bf16-pure under optimizer offload, an engine other
    than deepspeed, tp/pp/cp > 1, fp8).
    """
    _check_exportable(strategy)
    if gradient_clipping < 0:
        raise OptplanError(f"gradient clipping must be >= 0 (got {gradient_clipping}); 0 disables it")
    uses_nvme = "nvme" in (strategy.offload_optimizer, strategy.offload_params)
    if uses_nvme and not (isinstance(nvme_path, str) and nvme_path.strip()):
        raise OptplanError("NVMe offload needs a directory on a local NVMe drive: pass --nvme-path PATH")
    config: dict[str, Any] = {
        "train_batch_size": strategy.global_batch,
        "train_micro_batch_size_per_gpu": strategy.mbs,
        "gradient_accumulation_steps": strategy.grad_accum,
        "gradient_clipping": float(gradient_clipping),
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    config.update(_precision_sections(strategy))
    config.update(_optimizer_sections(strategy))
    config["zero_optimization"] = _zero_section(strategy, _buckets(profile), nvme_path)
    if strategy.checkpointing == "full":
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
        }
    return config


def ds_config_text(strategy: Strategy, profile: DeepSpeedBuckets | ModelProfile, *, gradient_clipping: float = 1.0,
                   nvme_path: str = DEFAULT_NVME_PATH) -> str:
    """``render_ds_config`` as indented JSON with a trailing newline (the ds_config.json text)."""
    config = render_ds_config(strategy, profile, gradient_clipping=gradient_clipping, nvme_path=nvme_path)
    return json.dumps(config, indent=2) + "\n"


def deepspeed_notes(strategy: Strategy) -> tuple[str, ...]:
    """What the training script must do for this export beyond ``--deepspeed ds_config.json``."""
    notes: list[str] = []
    if strategy.optimizer == "adamw8bit":
        notes.append(CLIENT_OPTIMIZER_NOTE)
    if strategy.optimizer == "adafactor":
        notes.append(ADAFACTOR_NOTE)
    if strategy.checkpointing == "full":
        which = ("each repeated block" if strategy.checkpoint_layers is None else
                 f"the first {strategy.checkpoint_layers} repeated blocks (partial checkpointing; train.py does)")
        notes.append(
            f"activation checkpointing: wrap {which} with deepspeed.checkpointing.checkpoint "
            "(or torch.utils.checkpoint); the ds_config section only configures DeepSpeed's version"
        )
    if strategy.checkpointing == "selective":
        notes.append(SELECTIVE_CHECKPOINTING_NOTE)
    if strategy.precision in _AUTOCAST_DTYPE:
        notes.append(
            f"{strategy.precision}: keep the model in fp32 and do not cast it; DeepSpeed runs forward under "
            f"torch.autocast({_AUTOCAST_DTYPE[strategy.precision]}) and reduces Linear/Conv gradients in that dtype"
        )
    return tuple(notes)
