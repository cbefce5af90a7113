"""The training loop of a plan: what optplan's runtime probe runs and what its generated train.py is.

One file, standard library and torch only (deepspeed, accelerate and bitsandbytes are imported when the
plan needs them), so that ``optplan export --to train`` can write it out as ``train.py`` (this source,
with the plan in ``PLAN``) for a machine where optplan is not installed. :class:`Trainer` applies a plan's
strategy to a model on one rank and runs one optimizer step; the runtime probe
(``optplan.probes.runtime_child``) drives the same :class:`Trainer` for its measurements, so what optplan
measures is what the user launches.

What :class:`Trainer` applies (the strategy is ``optplan.estimators.strategy.Strategy`` as a dict):

* precision on the torch engine: ``fp32``; ``amp-bf16`` / ``amp-fp16`` (fp32 weights, ``torch.autocast``
  around forward and loss, fp16 with ``torch.amp.GradScaler``); ``bf16`` / ``fp16`` (16-bit weights and
  gradients, fp32 master copies stepped by the optimizer, :class:`MasterWeights`; under FSDP2
  ``MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)`` over fp32 shards, ``reduce_dtype`` 16-bit when the
  plan's ``fsdp_reduce_dtype`` says so); ``bf16-pure`` (bf16 weights and optimizer states; FSDP2 reduces in bf16
  unless ``fsdp_reduce_dtype`` is fp32). DeepSpeed takes precision from the ds_config as given;
* activation checkpointing of each repeated block (``block_class``): ``full`` (``torch.utils.checkpoint``,
  non-reentrant; of the first ``checkpoint_layers`` blocks only when the plan names a count) or ``selective`` (op-level, torchtitan's policy: attention outputs and every other matmul's output
  saved, the rest recomputed, :data:`SAC_SAVE_OPS`);
* ``compile`` (the plan's, or the probe's option): on the torch engine each repeated block is compiled on its own
  (``Module.compile()``, after checkpointing and before FSDP, as torchtitan does), else the whole model
  (``runner.compile()``); DeepSpeed's ``engine.compile()``; under ``accelerate launch`` accelerate.yaml's
  ``dynamo_config`` does it; the model file's ``loss_fn`` is compiled with it (``torch.compile(loss_fn)``, as
  torchtitan compiles its loss), unless the plan's ``compile_loss`` says otherwise (estimators/compiled_loss.py);
* data parallelism: DDP (torch's defaults, ``no_sync`` on all but the last micro-batch), FSDP2
  ``fully_shard`` on every block and then the root (``full``: reshard after forward; ``grad_op``: keep
  the unsharded parameters to backward; ``hybrid``: HSDP over a 2-D mesh, replicas x ``shard_size``;
  ``fsdp_grad_sync="step"``: ``set_requires_gradient_sync(False)`` on all but the last micro-batch),
  ``deepspeed.initialize`` with the ds_config, or ``accelerate.Accelerator.prepare`` under
  ``accelerate launch``;
* the optimizer named (AdamW lr 3e-4, betas 0.9/0.95, weight decay 0.1; SGD; Adafactor; bitsandbytes'
  AdamW8bit), and ``grad_accum`` micro-batches per optimizer step (loss / grad_accum).

Gradients stay allocated between steps (``zero_grad(set_to_none=False)``), as optplan's memory model
counts them.

As train.py (``python train.py --help``): it builds the model from the model file (``build_model()``, else
the model class), trains on ``train_dataloader(batch_size, seq_len, rank, world_size)`` when the file
defines it and on ``example_batch`` synthetic data otherwise (said loudly on rank 0), prints every
``--log-every`` steps the measured step time, tokens/s, samples/s, MFU and peak memory per GPU beside
the plan's predictions and band, and writes ``measurements.json`` at the end for
``optplan calibrate``. Before any step it checks the world size against the plan, the ds_config against
the plan and the first batch's shape; each problem is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

PLAN: dict[str, Any] = {}
"""The plan this file trains (filled in by ``optplan export --to train``; empty in optplan's own copy)."""

MEASUREMENTS_FORMAT = "optplan-measurements/1"
EXIT_BAD_INPUT = 2
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}
"""The autocast dtype of each AMP recipe (precision.py)."""
ADAMW_KW: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SGD_KW: dict[str, Any] = {"lr": 3e-4, "momentum": 0.9}
ADAFACTOR_KW: dict[str, Any] = {"lr": 1e-2}
"""Optimizer hyper-parameters (the planner's exported defaults); they do not change memory or time."""
FP16_INITIAL_SCALE = 2.0 ** 16
FP16_GROWTH_INTERVAL = 1000
SAC_SAVE_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_fused_attention_overrideable")
"""aten ops whose outputs selective checkpointing saves (matmuls and attention cores); the rest of a
checkpointed block is recomputed, and so is every second :data:`SAC_ALTERNATE_OPS` call (torchtitan's per-op
selective AC, ``_apply_op_sac`` in torchtitan/models/llama3/infra/parallelize.py: "saves output of all compute ops,
except every second mm")."""
SAC_ALTERNATE_OPS = ("mm", "addmm")
"""The matmuls of which selective checkpointing saves only every other output, counted per block call and apart in
the forward and in the recompute, as torchtitan does for ``aten.mm``; ``addmm`` (an ``nn.Linear`` with a bias, which
torchtitan's Llama never calls) is counted with it, so that a biased model keeps the same alternation rather than
recomputing every linear layer."""
MAX_LEN_NAMES = ("block_size", "max_position_embeddings", "max_seq_len", "n_positions", "n_ctx",
                 "max_seq_length", "context_length", "max_len")
_CONFIG_ATTRS = ("config", "cfg", "args", "params", "model_args", "hparams", "hp")
BNB_MISSING = "optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes"


class TrainFailure(Exception):
    """A readable end of a run with a status ("error", "oom", "nan" or "pruned") and a one-line reason.
    ``everywhere``: every rank fails the same way (only rank 0 need say so)."""

    def __init__(self, status: str, reason: str, *, everywhere: bool = False) -> None:
        flat = " ".join(str(reason).split())
        super().__init__(flat)
        self.status = status
        self.reason = flat if len(flat) <= 400 else flat[:399] + "…"
        self.everywhere = everywhere


def exc_text(exc: BaseException) -> str:
    """``"TypeName: message"`` on one line."""
    msg = " ".join(str(exc).split())[:240]
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


# ---------------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------------
class MasterWeights:
    """fp32 master copies of 16-bit parameters; the inner optimizer steps the masters.

    ``step()`` makes fp32 gradients from the 16-bit ones (divided by the loss scale under fp16, which
    skips the step and halves the scale when one is not finite), steps the inner optimizer, copies
    the masters back into the 16-bit parameters and frees the fp32 gradients.
    """

    def __init__(self, params: list[torch.Tensor], make: Callable[[list[torch.Tensor]], Any], *,
                 dynamic_scale: bool) -> None:
        self.params = params
        self.masters = [p.detach().float().clone() for p in params]
        self.optimizer = make(self.masters)
        self.dynamic_scale = dynamic_scale
        self.scale = FP16_INITIAL_SCALE if dynamic_scale else 1.0
        self.good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.dynamic_scale else loss

    def step(self) -> None:
        pairs = [(m, p) for m, p in zip(self.masters, self.params, strict=True) if p.grad is not None]
        for m, p in pairs:
            m.grad = p.grad.float()
        try:
            if self.dynamic_scale and pairs:
                grads = [m.grad for m, _ in pairs]
                found = torch.zeros(1, device=grads[0].device)
                inv = torch.full((1,), 1.0 / self.scale, device=grads[0].device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
                if found.item() > 0:
                    self.scale /= 2.0
                    self.good_steps = 0
                    self.skipped_steps += 1
                    return
                self.good_steps += 1
                if self.good_steps % FP16_GROWTH_INTERVAL == 0:
                    self.scale *= 2.0
            self.optimizer.step()
            with torch.no_grad():
                for m, p in pairs:
                    p.copy_(m)
        finally:
            for m, _ in pairs:
                m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


def make_optimizer(name: str, params: list[torch.Tensor]) -> Any:
    """The torch (or bitsandbytes) optimizer for a Strategy's optimizer name."""
    if name == "adamw":
        return torch.optim.AdamW(params, **ADAMW_KW)
    if name == "sgd":
        return torch.optim.SGD(params, **SGD_KW)
    if name == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise TrainFailure("error", f"optimizer adafactor needs torch.optim.Adafactor (torch >= 2.5); this "
                                        f"is torch {torch.__version__}", everywhere=True)
        return torch.optim.Adafactor(params, **ADAFACTOR_KW)
    if name in ("adamw8bit", "paged_adamw", "paged_adamw8bit"):
        try:
            import bitsandbytes as bnb  # type: ignore[import-not-found]
        except Exception as exc:  # noqa: BLE001 - missing, or broken on this platform
            raise TrainFailure("error", f"{BNB_MISSING.replace('adamw8bit', name)} ({exc_text(exc)})",
                               everywhere=True) from None
        cls = {"adamw8bit": "AdamW8bit", "paged_adamw": "PagedAdamW", "paged_adamw8bit": "PagedAdamW8bit"}[name]
        return getattr(bnb.optim, cls)(params, **ADAMW_KW)
    raise TrainFailure("error", f"unknown optimizer {name!r}", everywhere=True)


def selective_context() -> Callable[[], Any] | None:
    """``context_fn`` for op-level selective checkpointing, or None when torch lacks it (the static profiler
    measures the selective activations with this same policy: probes/step_runner.py ``checkpointed``)."""
    try:
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    except ImportError:
        return None
    def overloads(names: tuple[str, ...]) -> set[Any]:
        found = set()
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is not None and hasattr(packet, "default"):
                found.add(packet.default)
        return found

    save, alternate = overloads(SAC_SAVE_OPS), overloads(SAC_ALTERNATE_OPS)

    def context() -> Any:
        counts = {False: 0, True: 0}  # matmul calls of this block call: in the forward, in the recompute

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            if op in alternate:
                counts[ctx.is_recompute] += 1
                if counts[ctx.is_recompute] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context


CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""A block's generation-cache arguments that checkpointing must not pass on."""


def without_generation_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of a checkpointed block call with its generation cache off, as transformers'
    ``GradientCheckpointingLayer.__call__`` does (modeling_layers.py): ``use_cache=False`` and no cache object, or
    the recompute in backward writes the cache a second time and its tensors change shape (DeepSeek-V2/V3's
    latent cache: ``CheckpointError``, recomputed [2·s, r] where [s, r] was saved)."""
    out = dict(kwargs)
    if out.get("use_cache"):
        out["use_cache"] = False
    for name in CACHE_KWARGS:
        if out.get(name) is not None:
            out[name] = None
    return out


def is_generation_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers generation cache (a subclass of ``transformers.cache_utils.Cache``:
    ``DynamicCache``, ``EncoderDecoderCache``...), recognised without importing transformers."""
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers.")
               for cls in type(value).__mro__)


def checkpointed_call(fn: Callable[..., Any], context_fn: Callable[[], Any] | None, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under non-reentrant ``torch.utils.checkpoint`` (with ``context_fn``, selective), its
    generation cache off; the one checkpointed call of the training loop and of the static profiler. A cache
    passed by position is dropped too: transformers 5's GPT-2 passes its ``DynamicCache`` as the block's second
    argument (``None`` only when the model's own ``gradient_checkpointing`` is on) and its attention updates it
    whatever ``use_cache`` says, so the recompute appended the keys a second time and ran other operators than the
    forward (selective checkpointing: "aten.slice.Tensor encountered during backward but not found in storage").
    A list argument is passed as a copy: the checkpoint keeps the object, and a caller that appends to it afterwards
    (torchvision DenseNet's block feeds each layer the list of features it grows) changed what the recompute read."""
    from torch.utils.checkpoint import checkpoint

    kwargs = without_generation_cache(kwargs)
    args = tuple(None if is_generation_cache(arg) else list(arg) if isinstance(arg, list) else arg for arg in args)
    if context_fn is None:
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def find_blocks(model: nn.Module, class_name: str | None) -> list[nn.Module]:
    """The outermost modules whose class name is ``class_name`` (nested ones are inside a checkpoint)."""
    if not class_name:
        return []
    found: list[nn.Module] = []
    inside: set[int] = set()
    for mod in model.modules():
        if id(mod) in inside:
            continue
        if type(mod).__name__ == class_name:
            found.append(mod)
            inside.update(id(m) for m in mod.modules())
    return found


def apply_checkpointing(blocks: list[nn.Module], mode: str, notes: list[str], count: int | None = None) -> str:
    """Wrap each block's forward in ``torch.utils.checkpoint`` (non-reentrant); returns the mode applied. With
    ``count`` (full checkpointing of some blocks: the plan's ``checkpoint_layers``) only the first ``count`` blocks,
    Megatron-LM's block method: their activations live longest, so they are the ones worth recomputing."""
    if mode == "none" or not blocks:
        return "none"
    if count is not None and mode == "full":
        blocks = blocks[:count]
    context_fn = None
    if mode == "selective":
        context_fn = selective_context()
        if context_fn is None:
            notes.append(f"selective checkpointing needs torch.utils.checkpoint.create_selective_checkpoint_contexts "
                         f"(torch >= 2.4); torch {torch.__version__} lacks it, so every block is fully checkpointed")
            mode = "full"
    for blk in blocks:
        blk.forward = partial(checkpointed_call, blk.forward, context_fn)  # instance attribute shadows it
    return mode


def max_positions(model: nn.Module) -> int | None:
    """The model's maximum sequence length when a config attribute names it, else None."""
    sources: list[Any] = [getattr(model, a, None) for a in _CONFIG_ATTRS]
    sources = [s for s in sources if s is not None and not isinstance(s, (torch.Tensor, nn.Module)) and not callable(s)]
    for src in [*sources, model]:
        for name in MAX_LEN_NAMES:
            value = src.get(name) if isinstance(src, Mapping) else getattr(src, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def to_device(obj: Any, device: torch.device, float_dtype: torch.dtype | None) -> Any:
    """``obj`` (a tensor, or a dict/tuple/list of them) on ``device``; float tensors cast to ``float_dtype``."""
    if isinstance(obj, torch.Tensor):
        t = obj.to(device, non_blocking=False)
        if float_dtype is not None and t.is_floating_point() and t.dtype != float_dtype:
            t = t.to(float_dtype)
        return t
    if isinstance(obj, Mapping):
        moved = {k: to_device(v, device, float_dtype) for k, v in obj.items()}
        try:
            return moved if type(obj) is dict else type(obj)(moved)
        except Exception:  # noqa: BLE001 - a mapping type that cannot be rebuilt from a dict
            return moved
    if isinstance(obj, tuple):
        items = [to_device(v, device, float_dtype) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [to_device(v, device, float_dtype) for v in obj]
    return obj


def deepspeed_arch_list(value: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's op builder can parse it: arch-specific and family suffixes dropped
    (``9.0a`` -> ``9.0``, ``10.0f+PTX`` -> ``10.0+PTX``), duplicates kept once; None when unset."""
    if value is None:
        return None
    out: list[str] = []
    for entry in value.replace(";", " ").split():
        fixed = re.sub(r"^(\d+\.\d+)[a-zA-Z]+", r"\1", entry)
        if fixed not in out:
            out.append(fixed)
    return (";" if ";" in value else " ").join(out)


def ds_config_recipe(config: Mapping[str, Any]) -> str:
    """The precision recipe a ds_config's ``bf16`` / ``fp16`` / ``torch_autocast`` sections select."""
    def on(name: str) -> bool:
        section = config.get(name)
        return isinstance(section, Mapping) and bool(section.get("enabled", False))

    if on("bf16"):
        return "bf16-pure" if config["bf16"].get("bf16_master_weights_and_grads") else "bf16"
    if on("fp16"):
        return "fp16"
    if on("torch_autocast"):
        dtype = str(config["torch_autocast"].get("dtype", "bfloat16"))
        return "amp-fp16" if dtype in ("float16", "fp16", "half", "torch.float16") else "amp-bf16"
    return "fp32"


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor in a tensor / tuple / list / dict (depth first), or None."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            t = first_tensor(item)
            if t is not None:
                return t
    return None


def _autocast_on_cpu() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4 takes no device type
        return torch.is_autocast_cpu_enabled()


def _cuda_cross_entropy(input: Any, target: Any, weight: Any = None, size_average: Any = None,
                        ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                        label_smoothing: float = 0.0) -> torch.Tensor | None:
    """CUDA autocast's cross entropy of a 16-bit input with class-index targets, or None where it is not that."""
    if (not isinstance(input, torch.Tensor) or input.dtype not in (torch.bfloat16, torch.float16)
            or not isinstance(target, torch.Tensor) or target.is_floating_point() or label_smoothing
            or size_average is not None or reduce is not None):
        return None
    log_probs = torch.log_softmax(input, 0 if input.dim() == 1 else 1, dtype=input.dtype)
    return torch.nn.functional.nll_loss(log_probs, target, weight, ignore_index=ignore_index, reduction=reduction)


class CudaAutocastLoss(torch.overrides.TorchFunctionMode):
    """Cross entropy of a 16-bit input as CUDA autocast runs it, for CPU runs that stand in for a GPU (optplan's
    probes and profile; on a GPU the loop does not use it).

    CPU autocast lists ``cross_entropy_loss`` among its fp32 ops: it upcasts a 16-bit input first (an fp32 copy,
    then an fp32 log-softmax kept for backward). CUDA autocast does not list it, so the composite runs there:
    ``log_softmax(x, class_dim, dtype=x.dtype)`` stays 16-bit (an explicit dtype is kept under its
    fp32_set_opt_dtype policy) and ``nll_loss`` (an fp32 op) upcasts only its input. PyTorch
    aten/src/ATen/autocast_mode.cpp (the CUDA and CPU lists) and aten/src/ATen/native/LossNLL.cpp
    (``cross_entropy_loss_symint``). Measured: GPT-2 small under AMP on an H200 held one 16-bit logits tensor less
    than the CPU policy (benchmarks/results/2026-11-26-H200). Only 16-bit inputs with class-index targets and no
    label smoothing are rewritten; everything else runs as called."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.cross_entropy and _autocast_on_cpu():
            out = _cuda_cross_entropy(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine", "OptimizedModule")
"""Wrappers whose forward takes anything and passes it to the model they hold (``.module``, ``._orig_mod``)."""


def forward_arity(model: nn.Module) -> int | None:
    """How many positional inputs the model's own forward takes (its wrappers looked through); None: any number."""
    for _ in range(4):
        if type(model).__name__ not in WRAPPERS:
            break
        model = getattr(model, "module", None) or getattr(model, "_orig_mod", model)
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(x)`` for a tensor, ``model(*x)`` for a tuple/list, ``model(**x)`` for a dict. A tuple longer than
    forward takes (``(images, labels)`` for a torchvision model's ``forward(x)``) gives forward its first items; the
    loss gets the whole batch."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        arity = forward_arity(model)
        return model(*(batch if not arity else batch[:arity]))
    return model(batch)


def first_param_module(model: nn.Module) -> nn.Module | None:
    """The first layer: the first leaf module (in ``modules()`` order) that owns parameters, else the first module
    that owns any directly (a learned position table on the root does not hide the embedding after it)."""
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    return next((m for m in owners if next(m.children(), None) is None), owners[0] if owners else None)


def default_loss(output: Any) -> tuple[torch.Tensor, str]:
    """The loss without ``loss_fn``, and the rule that chose it (for a note): a scalar output;
    ``output["loss"]``; the first scalar tensor of a tuple/list/dict; ``output["logits"]``'s mean (Hugging Face's
    name for the prediction, wherever it sits in a dict); else the first tensor's mean."""
    if isinstance(output, torch.Tensor):
        if output.dim() == 0:
            return output, "the model's output (a scalar tensor)"
        return output.float().mean(), "output.float().mean() of the output tensor"
    if isinstance(output, Mapping):
        if isinstance(output.get("loss"), torch.Tensor):
            return output["loss"], 'output["loss"]'
        items = list(output.items())
    elif isinstance(output, (list, tuple)):
        items = [(f"element {i}", item) for i, item in enumerate(output)]
    else:
        raise TypeError(f"the output is a {type(output).__name__}, not a tensor, tuple, list or dict")
    named = [(key if isinstance(output, (list, tuple)) else f"output[{key!r}]", item) for key, item in items
             if isinstance(item, torch.Tensor)]
    for name, item in named:
        if item.dim() == 0:
            return item, f"the first scalar tensor of the output ({name})"
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"].float().mean(), "output['logits'].float().mean()"
    for name, item in named:
        return item.float().mean(), f".float().mean() of the output's first tensor ({name})"
    raise TypeError("the output holds no tensor")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------------
# the plan applied on one rank
# ---------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def fsdp_deferred_sync(module: Any) -> Iterator[None]:
    """Run one micro-batch without FSDP's gradient reduce-scatter: FSDP2's ``set_requires_gradient_sync(False)``
    (restored after), FSDP1's ``no_sync()``; the unsharded gradients accumulate until a synced backward."""
    setter = getattr(module, "set_requires_gradient_sync", None)
    if setter is None:
        with module.no_sync():
            yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)


class Trainer:
    """One rank's model under a strategy: :meth:`setup_device`, :meth:`setup_distributed`, then
    :meth:`setup_training` on the built model, then :meth:`one_step` per optimizer step."""

    def __init__(self, strategy: Mapping[str, Any], *, device_type: str = "cpu",
                 ds_config: dict[str, Any] | None = None, block_class: str | None = None, compile: bool = False,
                 use_accelerate: bool = False, shard_size: int | None = None, notes: list[str] | None = None) -> None:
        self.strategy: dict[str, Any] = dict(strategy)
        self.device_type = device_type
        self.ds_config = ds_config
        self.block_class = block_class
        self.compile = compile or bool(self.strategy.get("compile"))
        self.compiled_blocks = False  # each repeated block torch.compile'd (the plan's compile, torch engine)
        self.use_accelerate = use_accelerate
        self.shard_size = shard_size
        self.notes: list[str] = notes if notes is not None else []
        self.phase = "setup"
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.engine: str = self.strategy.get("engine", "torch")
        self.fsdp: str = self.strategy.get("fsdp", "none")
        self.precision: str = self.strategy.get("precision", "fp32")
        self.mbs = int(self.strategy.get("mbs", 1))
        self.grad_accum = int(self.strategy.get("grad_accum", 1))
        self.dist_on = False
        self.scaler: Any = None
        self.master: MasterWeights | None = None
        self.optimizer: Any = None
        self.engine_obj: Any = None  # the DeepSpeed engine
        self.model: nn.Module | None = None  # the module that owns the parameters (unwrapped)
        self.runner: Any = None  # what forward is called on (DDP / compiled / engine)
        self.autocast_dtype: torch.dtype | None = None
        self.loss_autocast_dtype: torch.dtype | None = None  # the engine autocasts forward only: the loss too
        self.input_dtype: torch.dtype | None = None
        self.loss_fn: Callable[[Any, Any], Any] | None = None
        self.loss_note: str | None = None
        self.compiled_loss_fn: Callable[[Any, Any], Any] | None = None  # loss_fn under torch.compile (compiles_loss)
        self.accelerator: Any = None
        self.checkpointing_applied = "none"
        self.track_ddp_buckets = False  # optplan's CPU memory probe: keep DDP's flat buckets in sight
        self.ddp_buckets: dict[int, torch.Tensor] = {}
        self.before_optimizer_step: Callable[[], None] | None = None

    def note(self, text: str) -> None:
        if self.rank == 0:
            self.notes.append(text)

    # -- device and process group -------------------------------------------------------------------
    def setup_device(self) -> torch.device:
        if self.device_type == "cuda":
            if not torch.cuda.is_available():
                raise TrainFailure("error", f"device cuda requested but CUDA is not available (torch "
                                            f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'})")
            if self.local_rank >= torch.cuda.device_count():
                raise TrainFailure("error", f"rank {self.rank} needs GPU {self.local_rank} but only "
                                            f"{torch.cuda.device_count()} are visible")
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def checkpoint_blocks(self, blocks: list[nn.Module], mode: str) -> None:
        """The plan's activation checkpointing of ``blocks`` (``checkpointing_applied`` says what ran): every block,
        or the first ``checkpoint_layers`` of them; none here when accelerate's FSDP plugin checkpoints every block
        itself (two nested checkpoints would re-run each block's forward twice in backward)."""
        count = self.strategy.get("checkpoint_layers")
        if mode == "full" and count is None and self.accelerate_checkpoints():
            self.checkpointing_applied = "full"
            self.note("full checkpointing by accelerate (fsdp_activation_checkpointing): every block, wrapped once")
            return
        self.checkpointing_applied = apply_checkpointing(blocks, mode, self.notes if self.rank == 0 else [],
                                                         None if count is None else int(count))
        if count is not None and blocks and self.checkpointing_applied == "full":
            self.note(f"full checkpointing of the first {min(int(count), len(blocks))} of {len(blocks)} blocks")

    def accelerate_checkpoints(self) -> bool:
        """Whether accelerate's FSDP plugin checkpoints every wrapped block itself (``fsdp_activation_checkpointing``
        in accelerate.yaml, applied in ``prepare``)."""
        plugin = getattr(getattr(self.accelerator, "state", None), "fsdp_plugin", None) if self.use_accelerate else None
        return bool(getattr(plugin, "activation_checkpointing", False))

    def setup_distributed(self) -> None:
        if self.use_accelerate:
            self.phase = "accelerate.Accelerator() (reading the accelerate launch environment)"
            if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
                self._deepspeed_arch_list()
            from accelerate import Accelerator

            self.accelerator = Accelerator()  # accumulation is this loop's own (loss / grad_accum)
            if self.accelerator.num_processes != self.world:
                # e.g. a MULTI_GPU accelerate.yaml where no GPU is visible: accelerate falls back to one
                # process per rank, which would train unsynchronised copies
                raise TrainFailure("error", f"accelerate set up {self.accelerator.num_processes} process(es) "
                                            f"({self.accelerator.distributed_type}) but {self.world} were started: "
                                            "run where the accelerate.yaml's devices are visible, or start "
                                            "launch.sh (torchrun) instead")
            self.dist_on = self.world > 1
            return
        if not (self.world > 1 or self.engine == "deepspeed" or self.fsdp != "none"):
            return
        if "MASTER_ADDR" not in os.environ:  # one process, not under torchrun: a group of one
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                              WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        backend = "nccl" if self.device_type == "cuda" else "gloo"
        self.phase = "initialising torch.distributed"
        if self.engine == "deepspeed":
            self.import_deepspeed().init_distributed(dist_backend=backend)
        else:
            import torch.distributed as dist

            kwargs: dict[str, Any] = {}
            if self.device_type == "cuda":
                kwargs["device_id"] = torch.device("cuda", self.local_rank)
            dist.init_process_group(backend=backend, **kwargs)
        self.dist_on = True

    def _deepspeed_arch_list(self) -> None:
        """Arch-specific TORCH_CUDA_ARCH_LIST entries (``9.0a``, set by some CUDA images) stop DeepSpeed's JIT op
        builder (it reads ``X.Y[+PTX]``: "invalid literal for int() with base 10: '0a'", deepspeedai/DeepSpeed#7589,
        met on the second H200 visit): the builder gets the plain ``9.0``, and rank 0 says so."""
        before = os.environ.get("TORCH_CUDA_ARCH_LIST")
        after = deepspeed_arch_list(before)
        if after is not None and after != before:
            os.environ["TORCH_CUDA_ARCH_LIST"] = after
            if self.rank == 0:
                self.notes.append(f"TORCH_CUDA_ARCH_LIST {before!r} read as {after!r} for DeepSpeed's op builder "
                                  "(it cannot parse arch-specific entries, deepspeedai/DeepSpeed#7589)")

    def import_deepspeed(self) -> Any:
        self.phase = "importing deepspeed"
        self._deepspeed_arch_list()
        try:
            import deepspeed
        except Exception as exc:  # noqa: BLE001
            raise TrainFailure("error", f"the deepspeed engine needs deepspeed (pip install deepspeed): "
                                        f"{exc_text(exc)}", everywhere=True) from None
        if self.device_type == "cpu" and os.environ.get("OPTPLAN_PROBE_DS_SHM", "") != "1":
            # DeepSpeed's CPU accelerator JIT-builds a shared-memory allreduce op (deepspeed_shm_comm, ~25 s
            # cold) at init; on CPU plain gloo collectives do (OPTPLAN_PROBE_DS_SHM=1 keeps it).
            import importlib

            # not `import deepspeed.comm.torch as m`: deepspeed.comm's attribute "torch" is torch itself
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        return deepspeed

    # -- the strategy -------------------------------------------------------------------------------
    def apply_precision(self, model: nn.Module) -> None:
        low = {"bf16": torch.bfloat16, "fp16": torch.float16, "bf16-pure": torch.bfloat16}
        plugin = getattr(getattr(self.accelerator, "state", None), "deepspeed_plugin", None)
        if self.engine == "deepspeed" and (not self.use_accelerate or plugin is not None):
            # the ds_config's sections decide; its bf16/fp16 engines hold the module in 16 bits and do not
            # cast the inputs, so float inputs are cast as a DeepSpeed training script does
            recipe = ds_config_recipe(self.ds_config or {})
            self.input_dtype = low.get(recipe)
            self.loss_autocast_dtype = AUTOCAST_DTYPES.get(recipe)
            return
        if self.use_accelerate:
            # accelerate's mixed_precision (autocast over fp32 weights) decides; so it does for a DeepSpeed plan's
            # accelerate.yaml launched without its DeepSpeed plugin (`accelerate launch --cpu`): the module stays fp32
            self.loss_autocast_dtype = AUTOCAST_DTYPES.get(self.precision)
            return
        p = self.weight_precision
        if p in AUTOCAST_DTYPES:
            self.autocast_dtype = AUTOCAST_DTYPES[p]
            return
        if p in low and not (self.fsdp != "none" and p in ("bf16", "fp16")):
            model.to(low[p])
            self.input_dtype = low[p]
        if self.precision == "fp8":
            self.apply_fp8(model)

    @property
    def weight_precision(self) -> str:
        """The recipe of the weights, gradients and master copies: fp8's are bf16's (estimators/precision.py)."""
        return "bf16" if self.precision == "fp8" else self.precision

    def apply_fp8(self, model: nn.Module) -> None:
        """fp8 matmuls: each ``nn.Linear`` whose dimensions are multiples of 16 becomes torchao's ``Float8Linear``
        (tensorwise scaling, torchtitan's float8 recipe), bf16 everywhere else. It needs a CUDA GPU with fp8 tensor
        cores and torchao; on the cpu device (a check of the script) the run says it keeps bf16 matmuls."""
        if self.device_type != "cuda":
            self.note("precision fp8 on the cpu device: fp8 matmuls need a CUDA GPU with fp8 tensor cores, so this "
                      "run keeps the plan's bf16 weights and fp32 master copies with bf16 matmuls")
            return
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise TrainFailure("error", f"precision fp8 needs fp8 tensor cores (compute capability >= 8.9: H100, "
                                        f"H200, L40S, B200); this GPU has {major}.{minor}: plan with --precision bf16",
                               everywhere=True)
        try:
            from torchao.float8 import convert_to_float8_training
        except ImportError:
            raise TrainFailure("error", "precision fp8 needs torchao's float8 training, which is not installed: "
                                        "pip install torchao, or plan with --precision bf16", everywhere=True) from None
        linear = sum(isinstance(m, nn.Linear) for m in model.modules())
        convert_to_float8_training(model, module_filter_fn=lambda m, _fqn: isinstance(m, nn.Linear)
                                   and m.in_features % 16 == 0 and m.out_features % 16 == 0)
        left = sum(type(m) is nn.Linear for m in model.modules())
        self.note(f"fp8: {linear - left} of {linear} Linear layers run torchao's Float8Linear (tensorwise scaling); "
                  "the rest of the model bf16")

    def build_optimizer(self, params: list[torch.Tensor]) -> Any:
        name = self.strategy.get("optimizer", "adamw")
        if self.engine == "torch" and self.fsdp == "none" and self.weight_precision in ("bf16", "fp16"):
            self.master = MasterWeights(params, partial(make_optimizer, name), dynamic_scale=self.precision == "fp16")
            return self.master
        return make_optimizer(name, params)

    def apply_fsdp(self, model: nn.Module, blocks: list[nn.Module], device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
        except ImportError:  # pragma: no cover - torch < 2.6 kept these in _composable
            from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        shard = self.shard_size if self.fsdp == "hybrid" and self.shard_size else self.world
        if self.fsdp == "hybrid" and 0 < shard < self.world and self.world % shard == 0:
            mesh = init_device_mesh(device.type, (self.world // shard, shard), mesh_dim_names=("replicate", "shard"))
            self.note(f"HSDP: {self.world // shard} replica(s) x {shard}-way sharding")
        else:
            mesh = init_device_mesh(device.type, (self.world,))
            if self.fsdp == "hybrid":
                self.note("fsdp hybrid with one replica group is full sharding")
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.fsdp != "grad_op"}
        reduce = self.strategy.get("fsdp_reduce_dtype", "auto")
        if self.weight_precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.weight_precision == "bf16" else torch.float16
            # fp32 unless the plan reduces in the 16-bit dtype (estimators/fsdp_grad_sync.py)
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=dtype, reduce_dtype=torch.float32 if reduce in ("auto", "fp32") else dtype)
        elif reduce == "fp32":  # 16-bit (bf16-pure) or fp32 weights, gradients reduced in fp32
            kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        if self.strategy.get("offload_params", "none") == "cpu":
            if device.type == "cuda":
                kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
            else:
                self.note("offload_params cpu on the cpu device: nothing to offload, not applied")
        for blk in blocks:
            fully_shard(blk, **kwargs)
        fully_shard(model, **kwargs)

    def setup_training(self, model: nn.Module, device: torch.device) -> None:
        """Precision, checkpointing, the data-parallel wrapper and the optimizer, on ``model``."""
        self.model = model
        blocks = find_blocks(model, self.block_class)
        mode = self.strategy.get("checkpointing", "none")
        if self.block_class and not blocks:
            self.note(f"no module of class {self.block_class} found: no checkpointing, and FSDP wraps the root only")
        if mode != "none" and not self.block_class:
            self.note(f"checkpointing {mode} needs block_class (the repeated block): not applied")
        self.phase = "applying the precision recipe"
        self.apply_precision(model)
        self.phase = "applying activation checkpointing"
        self.checkpoint_blocks(blocks, mode)
        if self.compile and blocks and self.engine == "torch" and not self.use_accelerate:
            # the plan's compile: each block on its own (torchtitan's per-block compile: after checkpointing,
            # before FSDP), which is what optplan prices as fused kernels (estimators/compute.py)
            self.phase = "compiling each block (torch.compile)"
            for blk in blocks:
                blk.compile()
            self.compiled_blocks = True
        params = [p for p in model.parameters() if p.requires_grad]
        runner: Any = model
        if self.use_accelerate:
            self.phase = "building the optimizer"
            plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
            ds_section = getattr(plugin, "deepspeed_config", None) or {}
            if isinstance(ds_section, dict) and "optimizer" in ds_section:
                # the DeepSpeed config builds the optimizer; accelerate refuses a second one from the code
                from accelerate.utils import DummyOptim

                optimizer = DummyOptim(params)
            else:
                optimizer = make_optimizer(self.strategy.get("optimizer", "adamw"), params)
            self.phase = "Accelerator.prepare(model, optimizer)"
            runner, self.optimizer = self.accelerator.prepare(model, optimizer)
            self.note(f"accelerate: {self.accelerator.distributed_type}, mixed precision "
                      f"{self.accelerator.mixed_precision}, {self.accelerator.num_processes} process(es)")
        elif self.engine == "deepspeed":
            ds = self.import_deepspeed()
            config = dict(self.ds_config or {})
            found = ds_config_recipe(config)
            if found != self.precision:
                self.note(f"the ds_config's precision sections say {found}, the plan {self.precision}: the run "
                          "follows the ds_config")
            kwargs: dict[str, Any] = {"model": model, "model_parameters": params, "config": config}
            if "optimizer" not in config:
                self.phase = "building the optimizer"
                kwargs["optimizer"] = make_optimizer(self.strategy.get("optimizer", "adamw"), params)
            self.phase = "deepspeed.initialize"
            engine, optimizer, _, _ = ds.initialize(**kwargs)
            self.engine_obj, self.optimizer, runner = engine, optimizer, engine
            if self.compile:
                self.phase = "compiling the model (engine.compile)"
                engine.compile()
        else:
            if self.fsdp != "none":
                self.phase = "fully_shard (FSDP2)"
                self.apply_fsdp(model, blocks, device)
                params = [p for p in model.parameters() if p.requires_grad]
            elif self.world > 1:
                from torch.nn.parallel import DistributedDataParallel as DDP

                self.phase = "DistributedDataParallel"
                runner = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                             gradient_as_bucket_view=False)  # torch's default: buckets beside the grads
                if self.track_ddp_buckets:
                    self.watch_ddp_buckets(runner)
            self.phase = "building the optimizer"
            self.optimizer = self.build_optimizer(params)
            if self.precision == "amp-fp16" or (self.fsdp != "none" and self.precision == "fp16"):
                if self.fsdp != "none":
                    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                    self.scaler = ShardedGradScaler(device.type)
                else:
                    self.scaler = torch.amp.GradScaler(device.type)
            if self.compile and not self.compiled_blocks:
                self.phase = "compiling the model (torch.compile)"
                runner.compile()
        self.runner = runner

    def watch_ddp_buckets(self, ddp: Any) -> None:
        """Keep a reference to each of DDP's flat gradient buckets (optplan's CPU memory figures): the
        reducer allocates them in C++ out of a tensor tracker's sight. The hook is DDP's default
        all-reduce (``default_hooks.allreduce_hook``)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        buckets = self.ddp_buckets

        def hook(state: Any, bucket: Any) -> Any:
            buckets[bucket.index()] = bucket.buffer()
            return allreduce_hook(state, bucket)

        # DDP checks the hook's annotations as objects (this module's are strings)
        hook.__annotations__ = {"state": object, "bucket": torch.distributed.GradBucket,
                                "return": torch.futures.Future[torch.Tensor]}
        ddp.register_comm_hook(None, hook)

    # -- one step -----------------------------------------------------------------------------------
    @property
    def compiles_loss(self) -> bool:
        """Whether ``loss_fn`` runs under torch.compile: the plan's ``compile_loss``, else its ``compile`` (not the
        probe's whole-model option), as torchtitan does and ``Strategy.loss_compiled`` prices it."""
        chosen = self.strategy.get("compile_loss")
        return self.engine != "megatron" and bool(self.strategy.get("compile") if chosen is None else chosen)

    def _loss_callable(self) -> Callable[[Any, Any], Any]:
        """``loss_fn``, compiled once when :attr:`compiles_loss` (a graph break runs that part eagerly)."""
        assert self.loss_fn is not None
        if self.compiles_loss and self.compiled_loss_fn is None:
            self.compiled_loss_fn = torch.compile(self.loss_fn)
            self.note("the loss function runs compiled (torch.compile of loss_fn: the plan's compile_loss/compile)")
        return self.compiled_loss_fn if self.compiles_loss and self.compiled_loss_fn else self.loss_fn

    def compute_loss(self, output: Any, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            self.phase = "loss_fn(output, batch)"
            loss = self._loss_callable()(output, batch)
        else:
            self.phase = "the default loss"
            try:
                loss, rule = default_loss(output)
            except TypeError as exc:
                raise TrainFailure("error", f"no loss: {exc}; define loss_fn(output, batch) returning a scalar "
                                            "tensor", everywhere=True) from None
            if self.loss_note is None:
                self.loss_note = f"no loss_fn: the loss is {rule}"
                self.note(self.loss_note)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TrainFailure("error", f"{self.phase} returned {shape}, not a scalar tensor", everywhere=True)
        if not loss.requires_grad:
            raise TrainFailure("error", f"{self.phase} does not depend on any trainable parameter", everywhere=True)
        return loss.reshape(())

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def _loss_autocast(self) -> contextlib.AbstractContextManager[Any]:
        """DeepSpeed's ``torch_autocast`` and accelerate's mixed precision autocast the module's forward only; the
        loss is taken under the same autocast, as torch AMP takes it (so a 16-bit cross entropy upcasts where
        autocast says: the first H200 visit measured DeepSpeed's GPT-2 AMP runs one fp32 logits tensor per
        sample under the prediction while their loss ran in bf16, benchmarks/results/2026-11-26-H200-visit2)."""
        if self.loss_autocast_dtype is None or self.autocast_dtype is not None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.loss_autocast_dtype)

    def _loss_policy(self) -> contextlib.AbstractContextManager[Any]:
        """On the CPU, a 16-bit cross entropy as CUDA autocast runs it (:class:`CudaAutocastLoss`), whoever turned
        autocast on (this loop, accelerate or DeepSpeed): the CPU run stands in for the GPU."""
        return CudaAutocastLoss() if self.device_type == "cpu" else contextlib.nullcontext()

    def _no_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """The micro-batches before the last skip the gradient reduction: DDP's ``no_sync``; FSDP only under
        ``fsdp_grad_sync="step"`` (its unsharded gradients accumulate until the last backward)."""
        if last or self.engine == "deepspeed":
            return contextlib.nullcontext()
        if self.fsdp != "none":
            if self.strategy.get("fsdp_grad_sync", "micro_batch") != "step":
                return contextlib.nullcontext()
            return fsdp_deferred_sync(self.runner)
        no_sync = getattr(self.runner, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def one_step(self, batch_for: Callable[[int], Any]) -> torch.Tensor:
        """One optimizer step of ``grad_accum`` micro-batches (``batch_for(i)`` gives micro-batch ``i``);
        returns the mean loss (a 0-d tensor)."""
        losses: list[torch.Tensor] = []
        for i in range(self.grad_accum):
            batch = batch_for(i)
            with self._no_sync(i == self.grad_accum - 1):
                self.phase = "forward"
                with self._autocast(), self._loss_policy():
                    out = call_model(self.runner, batch)
                    with self._loss_autocast():
                        loss = self.compute_loss(out, batch)
                del out
                self.phase = "backward"
                if self.engine_obj is not None:
                    self.engine_obj.backward(loss)
                    self.phase = "optimizer step"
                    self.engine_obj.step()
                elif self.accelerator is not None:
                    self.accelerator.backward(loss / self.grad_accum)
                else:
                    scaled = loss / self.grad_accum
                    if self.scaler is not None:
                        scaled = self.scaler.scale(scaled)
                    elif self.master is not None:
                        scaled = self.master.scale_loss(scaled)
                    scaled.backward()
            losses.append(loss.detach())
        if self.engine_obj is None:
            self.phase = "optimizer step"
            if self.before_optimizer_step is not None:
                self.before_optimizer_step()
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as optplan counts them
        return torch.stack([x.float() for x in losses]).mean()

    def sync(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize()

    def reduce_max(self, values: list[float]) -> list[float]:
        """The maximum of each value over the ranks (the values themselves on one process)."""
        if not self.dist_on or self.world == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64,
                         device=torch.device("cuda", self.local_rank) if self.device_type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]


# ---------------------------------------------------------------------------------------------------
# train.py: the model file, the data, the loop and what it reports
# ---------------------------------------------------------------------------------------------------
class Hooks:
    """Callbacks around train.py's steps (optplan's probe measures live tensor bytes through them)."""

    def run_step(self, trainer: Trainer, index: int, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        return step()

    def measured(self) -> dict[str, Any]:
        """Extra figures for measurements.json's ``measured`` section."""
        return {}


def load_model_file(path: str) -> Any:
    """The model file imported as a module (its folder first on ``sys.path``)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise TrainFailure("error", f"model file {path} not found: pass --model-file PATH (the file the plan was "
                                    "made for)", everywhere=True)
    spec = importlib.util.spec_from_file_location("optplan_model_file", p)
    if spec is None or spec.loader is None:
        raise TrainFailure("error", f"{path} cannot be imported as a Python module", everywhere=True)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(p.resolve().parent))
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001
        raise TrainFailure("error", f"importing {path} raised {exc_text(exc)}: make `python {path}` run "
                                    "cleanly", everywhere=True) from None
    return module


def build_model(module: Any, plan: Mapping[str, Any], device: torch.device) -> nn.Module:
    """The model from the file: ``plan["model_name"]`` or ``build_model()`` called, else the plan's model
    class constructed, else a module-level instance of it (moved to ``device``)."""
    name = plan.get("model_name") or "build_model"
    cls_name = plan.get("model_class") or ""
    with torch.device(device):
        if callable(getattr(module, name, None)) and not isinstance(getattr(module, name), nn.Module):
            model = getattr(module, name)()
        elif isinstance(getattr(module, cls_name, None), type):
            model = getattr(module, cls_name)()
        else:
            found = [v for v in vars(module).values() if isinstance(v, nn.Module) and type(v).__name__ == cls_name]
            if not found:
                raise TrainFailure("error", f"{module.__file__} has no {name}() and no model class {cls_name!r}: "
                                            "train the file the plan was made for (--model-file)", everywhere=True)
            model = found[0]
    if not isinstance(model, nn.Module):
        raise TrainFailure("error", f"{name}() returned {type(model).__name__}, not an nn.Module", everywhere=True)
    return model.to(device).train()


def _shapes(obj: Any) -> list[tuple[int, ...]]:
    if isinstance(obj, torch.Tensor):
        return [tuple(obj.shape)]
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [s for item in obj for s in _shapes(item)]
    return []


def check_batch(batch: Any, expected: Any, mbs: int, where: str) -> None:
    """A one-line TrainFailure unless ``batch`` holds tensors of ``expected``'s shapes (``example_batch``'s),
    or, without one, tensors whose first dimension is the plan's micro-batch ``mbs``."""
    got = _shapes(batch)
    if not got:
        raise TrainFailure("error", f"{where} gave {type(batch).__name__} with no tensor: yield what forward takes "
                                    "(a tensor, tuple/list or dict of tensors)", everywhere=True)
    want = _shapes(expected) if expected is not None else None
    if want is not None and got != want:
        raise TrainFailure("error", f"{where} gave a batch of shape(s) {got}, but the plan's micro-batch is {want} "
                                    f"(example_batch({mbs}, seq_len)): make it yield batches of batch_size and "
                                    "seq_len as passed", everywhere=True)
    if want is None and any(not s or s[0] != mbs for s in got):
        raise TrainFailure("error", f"{where} gave a batch of shape(s) {got}, not {mbs} sample(s) per micro-batch: "
                                    "make it yield batches of batch_size samples", everywhere=True)


def load_ds_config(path: str, plan: Mapping[str, Any], world: int) -> dict[str, Any]:
    """The ds_config.json as a dict, checked against the plan before DeepSpeed sees it."""
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except FileNotFoundError:
        raise TrainFailure("error", f"DeepSpeed config {path} not found: pass --deepspeed PATH (launch.sh passes "
                                    "the ds_config.json written beside it)", everywhere=True) from None
    except (OSError, ValueError) as exc:
        raise TrainFailure("error", f"DeepSpeed config {path} is not readable JSON ({exc_text(exc)}): re-export it "
                                    "with optplan export plan.json --to deepspeed", everywhere=True) from None
    s = plan.get("strategy", {})
    problems = []
    if not isinstance(config, dict):
        problems.append(f"it holds a {type(config).__name__}, not a JSON object")
    else:
        zero = config.get("zero_optimization", {})
        stage = zero.get("stage", 0) if isinstance(zero, dict) else zero
        if not isinstance(zero, dict) or stage not in (0, 1, 2, 3):
            problems.append(f"zero_optimization.stage is {stage!r}, not 0-3")
        expect = {"train_micro_batch_size_per_gpu": s.get("mbs"), "gradient_accumulation_steps": s.get("grad_accum")}
        if s.get("mbs") and s.get("grad_accum"):
            expect["train_batch_size"] = int(s["mbs"]) * int(s["grad_accum"]) * world
        for key, want in expect.items():
            if key in config and want is not None and config[key] != want:
                problems.append(f"{key} is {config[key]!r}, the plan's is {want}")
    if problems:
        raise TrainFailure("error", f"DeepSpeed config {path}: {'; '.join(problems)}: re-export it with optplan export "
                                    "plan.json --to deepspeed, or re-plan", everywhere=True)
    return config


def _human_bytes(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.3g} ms"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.3g}%"


def _rate(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.1f}"


def figures(plan: Mapping[str, Any], step_s: float | None, world: int) -> dict[str, float | None]:
    """Tokens/s, samples/s and MFU (the plan's model FLOPs ÷ (step time x GPUs x the GPU's dense 16-bit
    peak), PaLM's definition, Chowdhery et al. 2022 App. B) of a measured step time (s)."""
    s = plan.get("strategy", {})
    pred = plan.get("prediction") or {}
    samples = int(s.get("mbs", 1)) * int(s.get("grad_accum", 1)) * int(s.get("dp", world))
    if not step_s:
        return {"samples_per_s": None, "tokens_per_s": None, "mfu": None}
    seq = plan.get("tokens_per_sample")
    flops, peak = pred.get("model_flops_per_step"), pred.get("mfu_peak_flops_per_gpu")
    return {"samples_per_s": samples / step_s, "tokens_per_s": samples * seq / step_s if seq else None,
            "mfu": flops / (step_s * world * peak) if flops and peak else None}


def report_line(plan: Mapping[str, Any], step: int, steps: int, loss: float, step_s: float | None, world: int,
                memory: Mapping[str, Any], *, cpu: bool = False) -> str:
    """``step 20/100 loss 6.91 | measured 412 ms vs predicted 398 ms [370, 430] | tokens/s ... | peak ...``
    (``cpu``: the memory prediction is the CPU accounting of the same run, live tensor bytes)."""
    pred = plan.get("prediction") or {}
    got = figures(plan, step_s, world)
    parts = [f"step {step}/{steps} loss {loss:.4g}"]
    band = (f" [{pred['step_s_low'] * 1e3:.3g}, {pred['step_s_high'] * 1e3:.3g}]"
            if pred.get("step_s_low") and pred.get("step_s_high") else "")
    parts.append(f"measured {_ms(step_s)} vs predicted {_ms(pred.get('step_s'))}{band}")
    parts.append(f"tokens/s {_rate(got['tokens_per_s'])} (predicted {_rate(pred.get('tokens_per_s'))})")
    parts.append(f"samples/s {_rate(got['samples_per_s'])} (predicted {_rate(pred.get('samples_per_s'))})")
    mfu, pmfu = got["mfu"], pred.get("mfu")
    parts.append(f"MFU {_pct(mfu)} (predicted {_pct(pmfu)})")
    if cpu:
        parts.append(f"peak live tensors {_human_bytes(memory.get('peak_allocated_bytes'))} per rank (predicted "
                     f"{_human_bytes(pred.get('cpu_allocated_bytes'))})")
    else:
        parts.append(f"peak allocated {_human_bytes(memory.get('peak_allocated_bytes'))}, reserved "
                     f"{_human_bytes(memory.get('peak_reserved_bytes'))} per GPU (predicted "
                     f"{_human_bytes(pred.get('allocated_bytes'))} allocated, {_human_bytes(pred.get('total_bytes'))} "
                     "with overhead)")
    return " | ".join(parts)


def software() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "platform": platform.platform()}
    for name in ("deepspeed", "accelerate"):
        mod = sys.modules.get(name)
        out[name] = getattr(mod, "__version__", None) if mod is not None else None
    with contextlib.suppress(Exception):
        if torch.cuda.is_available():
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def write_json_atomic(path: str, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` to ``path`` through a temporary file and a rename (never a half-written file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def parse_args(argv: list[str] | None, plan: Mapping[str, Any]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=f"Train {plan.get('model', 'the model')} with the plan optplan made "
                                            f"({plan.get('label', 'see PLAN')}).")
    p.add_argument("--model-file", default=plan.get("model_file", ""), help="the model file (default: the plan's)")
    p.add_argument("--deepspeed", default=None, help="ds_config.json (DeepSpeed plans; default: beside this file)")
    p.add_argument("--steps", type=int, default=int(plan.get("steps", 100)), help="optimizer steps to run")
    p.add_argument("--log-every", type=int, default=10, help="print measured vs predicted every N steps")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the measured step time")
    p.add_argument("--measurements", default="measurements.json", help="where rank 0 writes its measurements")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    return p.parse_args(argv)


def _resolve(path: str) -> str:
    """``path`` as given when it exists from the working folder, else beside this file (as given, then by its
    name: the exports copied to another machine)."""
    if not path or os.path.exists(path):
        return path
    folder = Path(__file__).resolve().parent
    for here in (folder / path, folder / Path(path).name):
        if here.exists():
            return str(here)
    return path


def run_training(plan: Mapping[str, Any], args: argparse.Namespace, hooks: Hooks | None = None) -> dict[str, Any]:
    """Train ``args.steps`` optimizer steps with ``plan``; returns the measurements (rank 0 also writes them)."""
    hooks = hooks or Hooks()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    s = dict(plan.get("strategy") or {})
    if not s:
        raise TrainFailure("error", "PLAN has no strategy: this file is optplan's template; export a plan with "
                                    "optplan export plan.json --to train", everywhere=True)
    if s.get("engine") == "megatron" or any(int(s.get(k, 1)) > 1 for k in ("tp", "pp", "cp")):
        raise TrainFailure("error", "tensor/pipeline/context-parallel plans run on Megatron-LM's pretrain_gpt.py "
                                    "(launch.sh starts it), not on train.py", everywhere=True)
    want = int(plan.get("world_size", world))
    if world != want:
        raise TrainFailure("error", f"this run has {world} process(es) but the plan is for {want} ({plan.get('nodes', 1)} "
                                    f"node(s) x {plan.get('procs_per_node', want)}): start it with launch.sh, or "
                                    f"re-plan for {world} GPU(s) with optplan recommend --gpus {world}", everywhere=True)
    if args.steps < 1 or args.log_every < 1:
        raise TrainFailure("error", "--steps and --log-every must be at least 1", everywhere=True)
    device_type = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    ds_config = None
    if s.get("engine") == "deepspeed":
        ds_config = load_ds_config(_resolve(args.deepspeed or plan.get("ds_config_file", "ds_config.json")), plan, world)
    notes: list[str] = []
    section = (ds_config or {}).get("optimizer")
    if device_type == "cpu" and isinstance(section, dict) and "torch_adam" not in (section.get("params") or {}):
        # DeepSpeed's fused Adam would be JIT-built on the CPU (~40 s); torch's Adam keeps the same states
        ds_config = {**(ds_config or {}), "optimizer": {**section, "params": {**(section.get("params") or {}),
                                                                           "torch_adam": True}}}
        notes.append("on the CPU the ds_config's optimizer runs as torch's Adam (torch_adam: true)")
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", plan.get("procs_per_node", world)))
    trainer = Trainer(s, device_type=device_type, ds_config=ds_config, block_class=plan.get("block_class"),
                      use_accelerate=bool(os.environ.get("ACCELERATE_MIXED_PRECISION")), notes=notes,
                      shard_size=int(plan.get("procs_per_node", procs)))
    device = trainer.setup_device()
    trainer.setup_distributed()
    trainer.phase = "loading the model file"
    module = load_model_file(_resolve(args.model_file))
    torch.manual_seed(args.seed)
    model = build_model(module, plan, device)
    trainer.loss_fn = getattr(module, "loss_fn", None)
    seq = int(plan.get("seq_len") or getattr(module, "OPTPLAN", {}).get("seq_len") or max_positions(model) or 1024)
    trainer.setup_training(model, device)
    torch.manual_seed(args.seed + rank)
    example = getattr(module, "example_batch", None)
    expected = example(trainer.mbs, seq) if callable(example) else None
    if callable(getattr(module, "train_dataloader", None)):
        data_source = "train_dataloader"
        where = f"train_dataloader({trainer.mbs}, {seq}, rank={rank}, world_size={world})"
        iterator: Iterator[Any] = iter(module.train_dataloader(trainer.mbs, seq, rank, world))
    else:
        first = first_param_module(model)
        if expected is None and not isinstance(first, nn.Embedding):
            raise TrainFailure("error", "the model file has no train_dataloader and no example_batch, and its inputs "
                                        "cannot be inferred: define train_dataloader(batch_size, seq_len, rank, "
                                        "world_size)", everywhere=True)
        data_source = "synthetic example_batch" if expected is not None else "synthetic token ids"
        where = f"example_batch({trainer.mbs}, {seq})"
        vocab = first.num_embeddings if isinstance(first, nn.Embedding) else 0

        def synthetic() -> Iterator[Any]:
            while True:
                yield example(trainer.mbs, seq) if callable(example) else torch.randint(0, vocab, (trainer.mbs, seq))

        iterator = synthetic()
        if rank == 0:
            print(f"WARNING: {module.__file__} defines no train_dataloader(batch_size, seq_len, rank, world_size): "
                  f"training on SYNTHETIC data ({data_source}); the loss means nothing", file=sys.stderr, flush=True)
    pending: list[Any] = []
    try:
        pending.append(next(iterator))
    except StopIteration:
        raise TrainFailure("error", f"{where} yielded nothing", everywhere=True) from None
    check_batch(pending[0], expected, trainer.mbs, where)

    def batch_for(_: int) -> Any:
        trainer.phase = "reading the data"
        try:
            raw = pending.pop() if pending else next(iterator)
        except StopIteration:
            raise TrainFailure("error", f"{where} ran out of batches", everywhere=True) from None
        return to_device(raw, device, trainer.input_dtype)

    if rank == 0:
        gpu = str(plan.get("gpu", ""))
        here = torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu"
        if gpu and gpu.split("-")[0].lower() not in here.lower():
            notes.append(f"the plan is for {gpu}; this run is on {here}: measured and predicted times differ by "
                         "the hardware, not only the model")
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        print(f"training {plan.get('model', '')} for {args.steps} step(s) on {world} x {device_type}: "
              f"{plan.get('label', '')}", flush=True)
    times: list[float] = []
    losses: list[float] = []
    memory: dict[str, Any] = {}
    for k in range(args.steps):
        trainer.sync()
        t0 = time.perf_counter()
        loss = hooks.run_step(trainer, k, lambda: trainer.one_step(batch_for))
        trainer.sync()
        dt, bad = trainer.reduce_max([time.perf_counter() - t0, 0.0 if math.isfinite(float(loss)) else 1.0])
        losses.append(float(loss))
        if bad:
            raise TrainFailure("nan", f"the loss is not finite at step {k + 1}")
        times.append(dt)
        if device_type == "cuda":
            peak = trainer.reduce_max([float(torch.cuda.max_memory_allocated()), float(torch.cuda.max_memory_reserved())])
            memory = {"peak_allocated_bytes": int(peak[0]), "peak_reserved_bytes": int(peak[1])}
        memory.update({k: v for k, v in hooks.measured().items() if k == "peak_allocated_bytes"})
        if rank == 0 and ((k + 1) % args.log_every == 0 or k + 1 == args.steps):
            recent = times[max(min(args.warmup, len(times) - 1), len(times) - args.log_every):]
            print(report_line(plan, k + 1, args.steps, losses[-1], statistics.median(recent), world, memory,
                              cpu=device_type == "cpu"), flush=True)
    timed = times[min(args.warmup, len(times) - 1):]
    step_s = statistics.median(timed)
    measured = {"status": "ok", "steps": args.steps, "warmup_steps": len(times) - len(timed), "step_times_s": times,
                "step_s": step_s, **figures(plan, step_s, world), "losses": losses, **memory, **hooks.measured(),
                "checkpointing_applied": trainer.checkpointing_applied, "data": data_source,
                # the memory's loss: on the CPU the tracker's steps run eagerly (dynamo skips frames under it)
                "loss_compiled": trainer.compiled_loss_fn is not None and device_type == "cuda"}
    if device_type == "cuda":
        free, total = torch.cuda.mem_get_info()
        measured["non_torch_bytes"] = int(max(0, total - free - torch.cuda.memory_reserved()))
    doc = {"format": MEASUREMENTS_FORMAT, "plan": dict(plan), "measured": measured, "notes": notes,
           "cluster": {"world_size": world, "procs_per_node": procs, "device": device_type,
                       "device_name": torch.cuda.get_device_name(device) if device_type == "cuda" else platform.processor() or "cpu"},
           "software": software(), "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if rank == 0:
        write_json_atomic(args.measurements, doc)
        use = (f": fold it into later plans with optplan calibrate {args.measurements}" if "peak_allocated_bytes" in
               measured else " (no memory measured: on the CPU only a run under optplan's live-tensor tracker, python "
               "-m optplan.probes.runtime_child --train-script train.py -- ARGS, gives optplan calibrate one)")
        print(f"wrote {args.measurements}{use}", flush=True)
    return doc


def main(argv: list[str] | None = None, hooks: Hooks | None = None) -> int:
    args = parse_args(argv, PLAN)
    rank = int(os.environ.get("RANK", "0"))
    try:
        run_training(PLAN, args, hooks)
    except TrainFailure as exc:
        if args.debug:
            raise
        if rank == 0 or not exc.everywhere:
            prefix = f"[rank {rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not exc.everywhere else ""
            print(f"error: {prefix}{exc.reason}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - one line; --debug shows the traceback
        if args.debug:
            raise
        print(f"error: [rank {rank}] {exc_text(exc)} (rerun with --debug for the traceback)", file=sys.stderr, flush=True)
        return 1
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
