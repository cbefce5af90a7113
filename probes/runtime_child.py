"""Runtime probe child: a few real training steps of a user's model under one strategy.

``python -m optplan.probes.runtime_child --spec SPEC.json --out RESULT.json`` (one process), or the
same module under ``torchrun`` (``optplan.probes.distributed`` builds the command). The spec is
:class:`optplan.probes.runtime.ProbeSpec` as JSON (the strategy as a plain dict).

Imports: the standard library, torch, ``optplan.probes.contract``, ``optplan.probes.memtrack`` and
``optplan.probes.model_errors`` (no pydantic, optuna, typer, rich, yaml or textual), plus deepspeed
when the strategy's engine is DeepSpeed and bitsandbytes for ``adamw8bit``. It therefore runs in a bare
training environment (torch only) next to the user's own stack.

What one probe does (every rank does the same):

1. seeds torch with ``spec.seed`` and builds the model with the file's builder on the real device
   (a module-level instance is moved there), reseeds with ``seed + rank`` for the data;
2. applies the strategy: precision (see below), activation checkpointing of the repeated block
   (modules whose class name is ``block_class``), data parallelism (DDP, FSDP2 ``fully_shard`` or
   ``deepspeed.initialize``) and ``torch.compile``;
3. runs ``warmup_steps`` + ``timed_steps`` optimizer steps of ``grad_accum`` micro-batches each
   (forward, loss, backward; optimizer step; zero_grad), on ``min(grad_accum, 4)`` batches made up
   front by ``example_batch(mbs, seq_len)`` or the inferred token batch (so making data is not timed);
4. on CPU, one extra step after the second step (the first when only one runs; DDP rebuilds its
   gradient buckets in the second) runs under a live-tensor tracker
   (:class:`~optplan.probes.memtrack.MemTracker`) for the memory figures; it is neither timed nor in
   ``losses``. Every tensor alive before it (parameters, gradients, optimizer states, fp32 master
   copies, inputs and anything else Python can reach) is registered with its category, so
   ``peak_allocated_bytes`` is the peak of all live tensor bytes of that step (bytes);
5. writes its result JSON (rank 0 to ``--out``, rank r to ``--out + ".rank{r}"``; write then rename).

Precision recipes on the torch engine (DeepSpeed takes them from the ds_config as given):

* ``fp32``: fp32 parameters, no autocast;
* ``amp-bf16`` / ``amp-fp16``: fp32 parameters, ``torch.autocast(device, bf16/fp16)`` around forward
  and loss; fp16 adds ``torch.amp.GradScaler`` (also on CPU, where torch 2.3+ supports it; under FSDP
  ``ShardedGradScaler``);
* ``bf16`` / ``fp16``: 16-bit parameters and gradients; the optimizer steps fp32 master copies and
  copies them back (:class:`MasterWeights`; its fp32 gradients exist only during the step); fp16 adds
  dynamic loss scaling (initial scale 2**16, halved on overflow with the step skipped, doubled after
  1000 good steps). Under FSDP2 these are ``MixedPrecisionPolicy(param_dtype=16-bit,
  reduce_dtype=fp32)`` with fp32 sharded parameters (FSDP's own mixed precision);
* ``bf16-pure``: the model in bf16 and the optimizer on the bf16 parameters (bf16 moments);
* ``fp8``: refused (needs Transformer Engine or torchao, not emulated).

Floating-point input tensors are cast to the parameters' dtype when the model is held in 16 bits
without autocast (as a training script would), DeepSpeed's bf16/fp16 engines included.

Measurements: step time per optimizer step, ``time.perf_counter`` around the step (with
``torch.cuda.synchronize`` on CUDA), the maximum over ranks (``all_reduce(MAX)`` after every step,
which also makes NaN and pruning decisions collective so no rank is left waiting). CUDA memory:
``max_memory_allocated`` / ``max_memory_reserved`` over the whole run and the non-torch bytes
(driver total - free - reserved at the end). ``memory_cap_bytes`` caps live tensor bytes on CPU
(the tracked step raises "oom" above it) and sets ``torch.cuda.set_per_process_memory_fraction`` on
CUDA.

Gradients stay allocated between steps (``zero_grad(set_to_none=False)``), as the profile and the
estimators count them; torch's default ``set_to_none=True`` frees them after the step, which lowers a peak
that falls in forward by up to one gradient copy (the estimate is then an upper bound). Engines: DDP uses
torch's defaults (``gradient_as_bucket_view=False``: the reducer's buckets are a second gradient copy, as
memory.py counts) and ``no_sync`` on all but the last micro-batch; FSDP2 wraps each repeated block and then the root (``grad_op`` = ``reshard_after_forward=
False``; ``hybrid`` on one node is full sharding); DeepSpeed gets the ds_config as given plus a torch
optimizer when the config has no "optimizer" section. On CPU the probe skips DeepSpeed's JIT-built
shared-memory allreduce (``deepspeed_shm_comm``, ~25 s cold) and uses plain gloo collectives
(``OPTPLAN_PROBE_DS_SHM=1`` keeps it).

Limits of the CPU memory figure: storage sizes without allocator rounding; one-time allocations of the
first steps are not in it; under ``torch.compile`` it is the eager step's (dynamo skips frames while a
TorchDispatchMode is active); categories are what the storage was when first seen, re-tagged to
"grad" once it becomes a ``.grad`` (FSDP2's unsharded parameters are "unsharded_param").

Exit code: 0 with a result written for "ok" and "pruned", 3 with a result written for a failure (so
torchrun stops the other ranks), anything else when the process died before writing.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

from optplan.probes._safe_path import drop_working_folder  # noqa: E402

drop_working_folder()  # before torch: no stray numpy.py from the working folder (Python 3.10)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import faulthandler  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Iterator, Mapping  # noqa: E402
from functools import partial  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from optplan.probes.contract import (  # noqa: E402
    BATCH_FIX,
    DEFAULT_TOKEN_SEQ_LEN,
    ModelContract,
    call_model,
    check_batch_type,
    default_loss,
    exc_text,
    first_param_module,
    load_contract,
)
from optplan.probes.memtrack import MemTracker  # noqa: E402
from optplan.probes.model_errors import ModelFileError, one_line  # noqa: E402

EXIT_OK = 0
EXIT_FAILED = 3
"""Exit code of a rank that wrote a failure result (error, oom, nan)."""

MAX_PREMADE_BATCHES = 4
"""Distinct micro-batches made before the steps (reused in turn)."""

DATA_PARALLEL_ONLY = "the probe runs data-parallel strategies only (tp/pp/cp = 1, engines torch and deepspeed)"
FP8_REFUSED = ("fp8 needs Transformer Engine / torchao fp8 layers, which the probe does not emulate: probe "
               "with precision bf16 (fp8 keeps bf16 weights and fp32 master states)")
BNB_MISSING = "optimizer adamw8bit needs bitsandbytes in the probe's environment: pip install bitsandbytes"

ADAMW_KW: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SGD_KW: dict[str, Any] = {"lr": 3e-4, "momentum": 0.9}
ADAFACTOR_KW: dict[str, Any] = {"lr": 1e-2}
"""Optimizer hyper-parameters (the planner's exported defaults); they do not change memory or time."""

FP16_INITIAL_SCALE = 2.0 ** 16
FP16_GROWTH_INTERVAL = 1000

MAX_LEN_NAMES = ("block_size", "max_position_embeddings", "max_seq_len", "n_positions", "n_ctx",
                 "max_seq_length", "context_length", "max_len")
_CONFIG_ATTRS = ("config", "cfg", "args", "params", "model_args", "hparams", "hp")
"""Where a model's maximum sequence length is read (as ``optplan.probes.static`` does)."""

SAC_SAVE_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_fused_attention_overrideable")
"""aten ops whose outputs selective checkpointing saves (matmuls and attention cores); the rest of a
checkpointed block is recomputed (op-level SAC as in torchtitan, without its every-other-matmul rule)."""

_OOM_MARK = "optplan-probe-oom"


# ---------------------------------------------------------------------------------------------------
# failures
# ---------------------------------------------------------------------------------------------------
class ProbeFailure(Exception):
    """A readable end of the probe with a status ("error", "oom", "nan" or "pruned")."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = one_line(reason, 400)


class ProbeOOM(ProbeFailure):
    """Live tensor bytes went over ``memory_cap_bytes`` (raised by :class:`ProbeTracker`)."""

    def __init__(self, reason: str) -> None:
        super().__init__("oom", reason)

    def __str__(self) -> str:  # recognisable after being wrapped by autograd or a collective
        return f"{_OOM_MARK}: {self.reason}"


def _human(n: float) -> str:
    """Bytes as "812 B", "3.4 KiB", "1.2 MiB", "2.50 GiB"."""
    if n < 1024:
        return f"{n:.0f} B"
    if n < 2**20:
        return f"{n / 1024:.1f} KiB"
    if n < 2**30:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**30:.2f} GiB"


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


_PEER_FAILURE = re.compile(
    r"connection (closed|reset) by peer|broken pipe|remote worker|communicator was aborted|"
    r"connection refused|socket timeout|ncclremoteerror|rendezvous.*(closed|shut)", re.I)


def peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` says another rank went away (a collective lost its peer): this rank is a victim."""
    return any(_PEER_FAILURE.search(str(e)) for e in _exception_chain(exc))


def classify(exc: BaseException, phase: str) -> tuple[str, str]:
    """(status, one-line reason) for an exception raised while ``phase`` ran."""
    for e in _exception_chain(exc):
        if isinstance(e, ProbeOOM):
            return "oom", f"{e.reason} during {phase}"
        if isinstance(e, ProbeFailure):
            return e.status, e.reason
        if isinstance(e, ModelFileError):
            return "error", str(e)
    text = str(exc)
    if _OOM_MARK in text:
        return "oom", one_line(text.split(_OOM_MARK + ":", 1)[-1], 400) + f" during {phase}"
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    lowered = text.lower()
    if (oom_type is not None and isinstance(exc, oom_type)) or "cuda out of memory" in lowered:
        return "oom", one_line(f"CUDA out of memory in {phase}: {cuda_oom_summary(text)}", 400)
    if isinstance(exc, MemoryError):
        return "oom", one_line(f"out of host memory in {phase} (MemoryError{': ' + text if text else ''})", 400)
    if isinstance(exc, RuntimeError) and ("out of memory" in lowered or "can't allocate memory" in lowered):
        return "oom", one_line(f"out of memory in {phase}: {text}", 400)
    if phase.startswith(("deepspeed", "importing deepspeed")) and (_OP_BUILD.search(text) or _in_op_build(exc)):
        return "error", one_line(
            f"DeepSpeed could not JIT-build an op during {phase} ({exc_text(exc)}): check that g++/ninja (and nvcc "
            f"with CUDA_HOME on GPU) work and {EXTENSIONS_VAR} is writable, or give a ds_config without an "
            "'optimizer' section (the probe then passes a torch optimizer)", 500)
    return "error", one_line(f"{phase} raised {exc_text(exc)}", 400)


def _in_op_build(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it chains) was raised inside DeepSpeed's op builder or torch's
    C++ extension loader (a compiler that fails even its version check says nothing of "build")."""
    for e in _exception_chain(exc):
        for frame in traceback.extract_tb(e.__traceback__):
            name = frame.filename.replace("\\", "/")
            if "/op_builder/" in name or name.endswith("cpp_extension.py"):
                return True
    return False


_OP_BUILD = re.compile(r"error building extension|ninja|cuda_home|nvcc|op_builder|\.so: cannot open|"
                       r"compiled with|jit|cpp_extension", re.I)
EXTENSIONS_VAR = "TORCH_EXTENSIONS_DIR"


def cuda_oom_summary(text: str) -> str:
    """The useful part of torch's CUDA OOM message: "tried to allocate 20.00 MiB; GPU 0 has a total
    capacity of 79.19 GiB of which 3.19 MiB is free" (without the allocator advice)."""
    body = re.sub(r"^\s*CUDA out of memory\.?\s*", "", text.strip())
    for stop in ("Including non-PyTorch memory", "Of the allocated memory", "If reserved but unallocated"):
        body = body.split(stop)[0]
    body = re.sub(r"\s*(Process \d+|This process) has .*? memory in use\.", "", body)
    parts = [p.strip().rstrip(".") for p in re.split(r"\.\s+", body) if p.strip()]
    return "; ".join(p[0].lower() + p[1:] if len(p) > 1 and p[1].islower() else p for p in parts)


# ---------------------------------------------------------------------------------------------------
# memory tracking (CPU)
# ---------------------------------------------------------------------------------------------------
def _local(t: Any) -> Any:
    """The local tensor of a DTensor (FSDP2 shards), else ``t``."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


class ProbeTracker(MemTracker):
    """MemTracker that sees DTensors' local shards, re-tags storages, and enforces a byte cap."""

    def __init__(self, cap_bytes: int | None = None) -> None:
        super().__init__()
        self.cap_bytes = cap_bytes

    def _add(self, t: torch.Tensor, category: str = "activation") -> None:
        t = _local(t)
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        super()._add(t, category)
        if self.cap_bytes is not None and self.live_bytes > self.cap_bytes:
            raise ProbeOOM(f"live tensor bytes {self.live_bytes:,} ({_human(self.live_bytes)}) exceed the memory cap "
                           f"of {self.cap_bytes:,} bytes ({_human(self.cap_bytes)})")

    def retag(self, t: Any, category: str) -> None:
        """Move a tracked storage's bytes to ``category`` (e.g. an activation that became ``p.grad``)."""
        key = self._storage_key(_local(t))
        if key is None or key not in self._sizes:
            return
        old = self._category[key]
        if old == category:
            return
        size = self._sizes[key]
        self._category[key] = category
        self.live_by_category[old] -= size
        self.live_by_category[category] = self.live_by_category.get(category, 0) + size


def _live_python_tensors(device_type: str) -> list[torch.Tensor]:
    """Every real tensor object the garbage collector knows of, on ``device_type`` (fake tensors that
    torch.compile keeps from tracing hold no memory and are skipped)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover
        FakeTensor = ()  # type: ignore[assignment,misc]  # noqa: N806
    out: list[torch.Tensor] = []
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor) or isinstance(obj, FakeTensor):
                continue
            local = _local(obj)
            if isinstance(local, FakeTensor) or local.device.type != device_type:
                continue
            out.append(obj)
        except Exception:  # noqa: BLE001 - weak proxies, half-built objects
            continue
    return out


def _optimizer_chain(opt: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside ``opt`` (DeepSpeed and master-weight wrappers hold one in ``.optimizer``)."""
    found: list[torch.optim.Optimizer] = []
    seen: set[int] = set()
    cur = opt
    while cur is not None and id(cur) not in seen and len(seen) < 8:
        seen.add(id(cur))
        if isinstance(cur, torch.optim.Optimizer):
            found.append(cur)
        cur = getattr(cur, "optimizer", None)
    return found


# ---------------------------------------------------------------------------------------------------
# precision: fp32 master weights for 16-bit parameters
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


# ---------------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------------
def make_optimizer(name: str, params: list[torch.Tensor]) -> Any:
    """The torch (or bitsandbytes) optimizer for a Strategy's optimizer name."""
    if name == "adamw":
        return torch.optim.AdamW(params, **ADAMW_KW)
    if name == "sgd":
        return torch.optim.SGD(params, **SGD_KW)
    if name == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise ProbeFailure("error", f"optimizer adafactor needs torch.optim.Adafactor (torch >= 2.5); this "
                                        f"is torch {torch.__version__}")
        return torch.optim.Adafactor(params, **ADAFACTOR_KW)
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb  # type: ignore[import-not-found]
        except Exception as exc:  # noqa: BLE001 - missing, or broken on this platform
            raise ProbeFailure("error", f"{BNB_MISSING} ({exc_text(exc)})") from None
        return bnb.optim.AdamW8bit(params, **ADAMW_KW)
    raise ProbeFailure("error", f"unknown optimizer {name!r}")


def _selective_context() -> Callable[[], Any] | None:
    """``context_fn`` for op-level selective checkpointing, or None when torch lacks it."""
    try:
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    except ImportError:
        return None
    save = set()
    for name in SAC_SAVE_OPS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            save.add(packet.default)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return partial(create_selective_checkpoint_contexts, policy)


def _checkpointed_call(fn: Callable[..., Any], context_fn: Callable[[], Any] | None, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

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


def apply_checkpointing(blocks: list[nn.Module], mode: str, notes: list[str]) -> str:
    """Wrap each block's forward in ``torch.utils.checkpoint`` (non-reentrant); returns the mode applied."""
    if mode == "none" or not blocks:
        return "none"
    context_fn = None
    if mode == "selective":
        context_fn = _selective_context()
        if context_fn is None:
            notes.append(f"selective checkpointing needs torch.utils.checkpoint.create_selective_checkpoint_contexts "
                         f"(torch >= 2.4); torch {torch.__version__} lacks it, so every block is fully checkpointed")
            mode = "full"
    for blk in blocks:
        blk.forward = partial(_checkpointed_call, blk.forward, context_fn)  # instance attribute shadows it
    return mode


def _config_sources(model: nn.Module) -> list[Any]:
    sources: list[Any] = []
    for attr in _CONFIG_ATTRS:
        obj = getattr(model, attr, None)
        if obj is not None and not isinstance(obj, (torch.Tensor, nn.Module)) and not callable(obj):
            sources.append(obj)
    sources.append(model)
    return sources


def max_positions(model: nn.Module) -> int | None:
    """The model's maximum sequence length when a config attribute names it, else None."""
    for src in _config_sources(model):
        for name in MAX_LEN_NAMES:
            value = src.get(name) if isinstance(src, Mapping) else getattr(src, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _to_device(obj: Any, device: torch.device, float_dtype: torch.dtype | None) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.to(device, non_blocking=False)
        if float_dtype is not None and t.is_floating_point() and t.dtype != float_dtype:
            t = t.to(float_dtype)
        return t
    if isinstance(obj, Mapping):
        moved = {k: _to_device(v, device, float_dtype) for k, v in obj.items()}
        try:
            return moved if type(obj) is dict else type(obj)(moved)
        except Exception:  # noqa: BLE001 - a mapping type that cannot be rebuilt from a dict
            return moved
    if isinstance(obj, tuple):
        items = [_to_device(v, device, float_dtype) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_to_device(v, device, float_dtype) for v in obj]
    return obj


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``, else "cpu"."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (torchrun, or optplan) dies: no orphans if the
    launcher is killed."""
    from optplan.probes._pdeathsig import die_with_launcher

    if not die_with_launcher():  # the launcher already died before prctl
        os._exit(EXIT_FAILED)


# ---------------------------------------------------------------------------------------------------
# the probe
# ---------------------------------------------------------------------------------------------------
class Probe:
    """One rank's run of a ProbeSpec (a dict); fills ``self.result``."""

    def __init__(self, spec: dict[str, Any], result: dict[str, Any]) -> None:
        self.spec = spec
        self.strategy: dict[str, Any] = dict(spec["strategy"])
        self.result = result
        self.notes: list[str] = result["notes"]
        self.phase = "setup"
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device_type: str = spec.get("device", "cpu")
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
        self.input_dtype: torch.dtype | None = None
        self.batches: list[Any] = []
        self.loss_fn: Callable[[Any, Any], Any] | None = None
        self.loss_note: str | None = None
        self.tracker: ProbeTracker | None = None
        self.ddp_buckets: dict[int, torch.Tensor] = {}  # CPU: DDP's flat gradient buckets, by index
        self.accelerator: Any = None  # accelerate.Accelerator under `accelerate launch` (optplan validate)
        self.use_accelerate = bool(spec.get("accelerate_config"))

    @property
    def where(self) -> str:
        """The phase for messages, e.g. "backward of the memory-tracked step"."""
        return f"{self.phase} of the memory-tracked step" if self.tracker is not None else self.phase

    # -- checks and setup -----------------------------------------------------------------------------
    def check_strategy(self) -> None:
        s = self.strategy
        if any(int(s.get(k, 1)) > 1 for k in ("tp", "pp", "cp")) or self.engine not in ("torch", "deepspeed"):
            raise ProbeFailure("error", DATA_PARALLEL_ONLY)
        if self.precision == "fp8":
            raise ProbeFailure("error", FP8_REFUSED)
        if self.engine == "deepspeed" and not isinstance(self.spec.get("ds_config"), dict):
            raise ProbeFailure("error", "the deepspeed engine needs the spec's ds_config (a dict for "
                                        "deepspeed.initialize)")
        dp = int(s.get("dp", 1))
        if dp != self.world and self.rank == 0:
            self.notes.append(f"the strategy has dp={dp} but the probe ran {self.world} process(es): sharded "
                              f"states are divided by {self.world}, not {dp}")

    def setup_device(self) -> torch.device:
        if self.device_type == "cuda":
            if not torch.cuda.is_available():
                raise ProbeFailure("error", f"device cuda requested but CUDA is not available (torch "
                                            f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'})")
            if self.local_rank >= torch.cuda.device_count():
                raise ProbeFailure("error", f"rank {self.rank} needs GPU {self.local_rank} but only "
                                            f"{torch.cuda.device_count()} are visible")
            torch.cuda.set_device(self.local_rank)
            device = torch.device("cuda", self.local_rank)
            self.result["device_name"] = torch.cuda.get_device_name(device)
            cap = self.spec.get("memory_cap_bytes")
            if cap:
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
            return device
        self.result["device_name"] = cpu_name()
        return torch.device("cpu")

    def setup_distributed(self) -> None:
        if self.use_accelerate:
            self.phase = "accelerate.Accelerator() (reading the accelerate launch environment)"
            from accelerate import Accelerator

            self.accelerator = Accelerator()  # accumulation is the probe's own loop (loss / grad_accum)
            self.dist_on = self.world > 1
            return
        need = self.world > 1 or self.engine == "deepspeed" or self.fsdp != "none"
        if not need:
            return
        if "MASTER_ADDR" not in os.environ:  # one process, not under torchrun: a group of one
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                              WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        backend = "nccl" if self.device_type == "cuda" else "gloo"
        self.phase = "initialising torch.distributed"
        if self.engine == "deepspeed":
            ds = self._import_deepspeed()
            ds.init_distributed(dist_backend=backend)
        else:
            import torch.distributed as dist

            kwargs: dict[str, Any] = {}
            if self.device_type == "cuda":
                kwargs["device_id"] = torch.device("cuda", self.local_rank)
            dist.init_process_group(backend=backend, **kwargs)
        self.dist_on = True

    def _import_deepspeed(self) -> Any:
        self.phase = "importing deepspeed"
        try:
            import deepspeed
        except Exception as exc:  # noqa: BLE001
            raise ProbeFailure("error", f"the deepspeed engine needs deepspeed in the probe's environment "
                                        f"(pip install deepspeed): {exc_text(exc)}") from None
        if self.device_type == "cpu" and os.environ.get("OPTPLAN_PROBE_DS_SHM", "") != "1":
            # DeepSpeed's CPU accelerator JIT-builds a shared-memory allreduce op (deepspeed_shm_comm) at
            # init; on CPU the probe uses plain gloo collectives instead (OPTPLAN_PROBE_DS_SHM=1 keeps it).
            import importlib

            # not `import deepspeed.comm.torch as m`: deepspeed.comm's attribute "torch" is torch itself
            ds_torch = importlib.import_module("deepspeed.comm.torch")
            ds_torch.build_shm_op = lambda: None
        return deepspeed

    # -- the model ----------------------------------------------------------------------------------
    def build(self, device: torch.device) -> ModelContract:
        self.phase = "loading the model file"
        path = self.spec["model_path"]
        sys.argv = [path]  # as if the user ran `python FILE`
        contract = load_contract(path, model_name=self.spec.get("model_name"), plain_defaults=True)
        self.notes.extend(n for n in contract.notes if self.rank == 0)
        torch.manual_seed(int(self.spec.get("seed", 0)))
        self.phase = contract.source
        if contract.source.startswith("instance "):
            model = getattr(contract.module, contract.source.split(" ", 1)[1])
        else:
            with torch.device(device):
                model = contract.builder()
        if not isinstance(model, nn.Module):
            raise ModelFileError(contract.display, f"{contract.source} returned {type(model).__name__}, not a "
                                 "torch.nn.Module", f"return the model (an nn.Module instance) from {contract.source}")
        if any(p.is_meta for p in model.parameters()):
            raise ModelFileError(contract.display, f"{contract.source} built parameters on the meta device",
                                 "build real weights (the runtime probe trains the model); optplan chooses the device")
        model = model.to(device)
        if not any(p.requires_grad for p in model.parameters()):
            raise ModelFileError(contract.display, "the model has no trainable parameters",
                                 "make sure parameters have requires_grad=True")
        model.train()
        self.model = model
        self.loss_fn = contract.loss_fn
        return contract

    def seq_len(self, contract: ModelContract, model: nn.Module) -> int:
        if self.spec.get("seq_len"):
            return int(self.spec["seq_len"])
        if contract.defaults.seq_len:
            return int(contract.defaults.seq_len)
        return max_positions(model) or DEFAULT_TOKEN_SEQ_LEN

    def make_batches(self, contract: ModelContract, model: nn.Module, device: torch.device) -> None:
        seq = self.seq_len(contract, model)
        fn = contract.example_batch
        if fn is not None:
            describe = f"example_batch({self.mbs}, {seq})"

            def make() -> Any:
                return fn(self.mbs, seq)
        else:
            first = first_param_module(model)
            if not isinstance(first, nn.Embedding):
                kind = type(first).__name__ if first is not None else "no parameterised module"
                raise ModelFileError(contract.display, f"no example_batch and the inputs cannot be inferred (the "
                                     f"first layer is {kind}, not an nn.Embedding)",
                                     "add example_batch(batch_size, seq_len) returning the inputs forward takes")
            vocab = first.num_embeddings
            describe = f"the inferred token batch [{self.mbs}, {seq}]"

            def make() -> Any:
                return torch.randint(0, vocab, (self.mbs, seq), dtype=torch.long, device=device)

            if self.rank == 0:
                self.notes.append(f"inferred token-id batch [{self.mbs}, {seq}] (ids below {vocab})")
        self.phase = describe
        torch.manual_seed(int(self.spec.get("seed", 0)) + self.rank)
        for _ in range(min(self.grad_accum, MAX_PREMADE_BATCHES)):
            try:
                batch = make()
            except Exception as exc:
                raise ModelFileError(contract.display, f"{describe} raised {exc_text(exc)}", BATCH_FIX) from None
            check_batch_type(batch, contract.display, describe)
            self.batches.append(_to_device(batch, device, self.input_dtype))

    # -- strategy -----------------------------------------------------------------------------------
    def apply_precision(self, model: nn.Module) -> None:
        p = self.precision
        low = {"bf16": torch.bfloat16, "fp16": torch.float16, "bf16-pure": torch.bfloat16}
        if self.engine == "deepspeed":
            # the ds_config's sections decide; its bf16/fp16 engines hold the module in 16 bits and do not
            # cast the inputs, so float inputs are cast as a DeepSpeed training script would
            recipe = ds_config_recipe(self.spec.get("ds_config") or {})
            self.input_dtype = low.get(recipe)
            return
        if self.use_accelerate:
            return  # accelerate's mixed_precision (autocast over fp32 weights) decides
        if p in ("amp-bf16", "amp-fp16"):
            self.autocast_dtype = torch.bfloat16 if p == "amp-bf16" else torch.float16
            return
        if p in low and not (self.fsdp != "none" and p in ("bf16", "fp16")):
            model.to(low[p])
            self.input_dtype = low[p]

    def build_optimizer(self, params: list[torch.Tensor]) -> Any:
        name = self.strategy.get("optimizer", "adamw")
        if self.engine == "torch" and self.fsdp == "none" and self.precision in ("bf16", "fp16"):
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

        mesh = init_device_mesh(device.type, (self.world,))
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.fsdp != "grad_op"}
        if self.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if self.strategy.get("offload_params", "none") == "cpu":
            if device.type == "cuda":
                kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
            elif self.rank == 0:
                self.notes.append("offload_params cpu on the cpu device: nothing to offload, not applied")
        if self.fsdp == "hybrid" and self.rank == 0:
            self.notes.append("fsdp hybrid on one node is full sharding (one replica group)")
        for blk in blocks:
            fully_shard(blk, **kwargs)
        fully_shard(model, **kwargs)

    def setup_training(self, model: nn.Module, device: torch.device) -> None:
        blocks = find_blocks(model, self.spec.get("block_class"))
        mode = self.strategy.get("checkpointing", "none")
        if self.spec.get("block_class") and not blocks and self.rank == 0:
            self.notes.append(f"no module of class {self.spec['block_class']} found: no checkpointing, and "
                              "FSDP wraps the root only")
        if mode != "none" and not self.spec.get("block_class") and self.rank == 0:
            self.notes.append(f"checkpointing {mode} needs block_class (the repeated block): not applied")
        self.phase = "applying the precision recipe"
        self.apply_precision(model)
        self.phase = "applying activation checkpointing"
        applied = apply_checkpointing(blocks, mode, self.notes)
        self.result["checkpointing_applied"] = applied
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
            if self.rank == 0:
                self.notes.append(f"accelerate: {self.accelerator.distributed_type}, mixed precision "
                                  f"{self.accelerator.mixed_precision}, {self.accelerator.num_processes} process(es)")
        elif self.engine == "deepspeed":
            ds = self._import_deepspeed()
            config = dict(self.spec["ds_config"])
            self.check_ds_precision(config)
            kwargs: dict[str, Any] = {"model": model, "model_parameters": params, "config": config}
            if "optimizer" not in config:
                self.phase = "building the optimizer"
                kwargs["optimizer"] = make_optimizer(self.strategy.get("optimizer", "adamw"), params)
            self.phase = "deepspeed.initialize"
            engine, optimizer, _, _ = ds.initialize(**kwargs)
            self.engine_obj, self.optimizer, runner = engine, optimizer, engine
            if self.spec.get("compile"):
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
                if device.type == "cpu":
                    self.watch_ddp_buckets(runner)
            self.phase = "building the optimizer"
            self.optimizer = self.build_optimizer(params)
            if self.precision == "amp-fp16" or (self.fsdp != "none" and self.precision == "fp16"):
                if self.fsdp != "none":
                    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                    self.scaler = ShardedGradScaler(device.type)
                else:
                    self.scaler = torch.amp.GradScaler(device.type)
            if self.spec.get("compile"):
                self.phase = "compiling the model (torch.compile)"
                runner.compile()
        if self.spec.get("compile") and self.device_type == "cpu" and self.rank == 0:
            self.notes.append("torch.compile: the CPU memory figure is of the eager step (torch.compile skips "
                              "frames while the probe's tensor tracker, a TorchDispatchMode, is active); the "
                              "step times are of the compiled model")
        self.runner = runner

    def watch_ddp_buckets(self, ddp: Any) -> None:
        """Keep a reference to each of DDP's flat gradient buckets (CPU memory figures). The reducer
        allocates them in C++ when it builds (and, after the first step, rebuilds) its buckets, out of the
        tracker's sight, so the tracked step registers them as "bucket" (what a GPU's
        ``max_memory_allocated`` counts all along). The hook is DDP's default all-reduce
        (``default_hooks.allreduce_hook``: divide by the world size, all-reduce the bucket in place)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        buckets = self.ddp_buckets

        def hook(state: Any, bucket: Any) -> Any:
            buckets[bucket.index()] = bucket.buffer()
            return allreduce_hook(state, bucket)

        # DDP checks the hook's annotations as objects (this module's are strings)
        hook.__annotations__ = {"state": object, "bucket": torch.distributed.GradBucket,
                                "return": torch.futures.Future[torch.Tensor]}
        ddp.register_comm_hook(None, hook)

    def check_ds_precision(self, config: dict[str, Any]) -> None:
        """Note when the ds_config's precision sections do not match the strategy (the ds_config wins)."""
        found = ds_config_recipe(config)
        if found != self.precision and self.rank == 0:
            self.notes.append(f"the ds_config's precision sections say {found}, the strategy {self.precision}: "
                              "the probe ran what the ds_config says")

    # -- steps --------------------------------------------------------------------------------------
    def compute_loss(self, output: Any, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            self.phase = "loss_fn(output, batch)"
            loss = self.loss_fn(output, batch)
        else:
            self.phase = "the default loss"
            try:
                loss, rule = default_loss(output)
            except TypeError as exc:
                raise ProbeFailure("error", f"no loss: {exc}; define loss_fn(output, batch) returning a scalar "
                                            "tensor") from None
            if self.loss_note is None:
                self.loss_note = f"no loss_fn: the loss is {rule}"
                if self.rank == 0:
                    self.notes.append(self.loss_note)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ProbeFailure("error", f"{self.phase} returned {shape}, not a scalar tensor")
        if not loss.requires_grad:
            raise ProbeFailure("error", f"{self.phase} does not depend on any trainable parameter")
        return loss.reshape(())

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def _no_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        no_sync = getattr(self.runner, "no_sync", None)
        if last or self.engine == "deepspeed" or no_sync is None or self.fsdp != "none":
            return contextlib.nullcontext()
        return no_sync()

    def one_step(self) -> torch.Tensor:
        """One optimizer step of ``grad_accum`` micro-batches; returns the mean loss (a 0-d tensor)."""
        losses: list[torch.Tensor] = []
        for i in range(self.grad_accum):
            batch = self.batches[i % len(self.batches)]
            last = i == self.grad_accum - 1
            with self._no_sync(last):
                self.phase = "forward"
                with self._autocast():
                    out = call_model(self.runner, batch)
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
            if self.tracker is not None:
                for p in self.model.parameters():  # gradients made by backward are "grad" from here on
                    if p.grad is not None:
                        self.tracker.retag(p.grad, "grad")
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as the profile counts them
        return torch.stack([x.float() for x in losses]).mean()

    def _sync(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize()

    def _reduce_max(self, values: list[float]) -> list[float]:
        if not self.dist_on or self.world == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64,
                         device=torch.device("cuda", self.local_rank) if self.device_type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def tracked_step(self, after: int) -> None:
        """One extra step under a ProbeTracker with everything alive registered (CPU memory figures)."""
        assert self.model is not None
        tracker = ProbeTracker(self.spec.get("memory_cap_bytes"))
        params = list(self.model.parameters())
        param_keys = set()
        for p in params:
            key = MemTracker._storage_key(_local(p))
            if key is not None:
                param_keys.add(key)
        tracker.track(params, category="param")
        tracker.track([p.grad for p in params], category="grad")
        for opt in _optimizer_chain(self.master or self.optimizer):
            for group in opt.param_groups:
                masters = [t for t in group["params"] if MemTracker._storage_key(_local(t)) not in param_keys]
                tracker.track(masters, category="master")
            tracker.track([v for st in opt.state.values() for v in (st.values() if isinstance(st, dict) else [st])
                           if isinstance(v, torch.Tensor)], category="optimizer")
        tracker.track(list(self.model.buffers()), category="buffer")
        tracker.track(list(self.ddp_buckets.values()), category="bucket")
        tracker.track(self.batches, category="input")
        rest = _live_python_tensors(self.device_type)
        if self.fsdp != "none":  # FSDP2's unsharded parameters (storage resized to 0 between uses)
            tracker.track([t for t in rest if isinstance(t, nn.Parameter)], category="unsharded_param")
        tracker.track(rest, category="other")
        hooks = []
        for p in params:
            if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
                hooks.append(p.register_post_accumulate_grad_hook(
                    lambda q: tracker.retag(q.grad, "grad") if q.grad is not None else None))
        self.tracker = tracker  # left set when the step raises, so the reason names the tracked step
        try:
            with tracker, tracker.watch_resizes():  # FSDP2 frees/gathers parameters by storage resizes
                loss = self.one_step()
        finally:
            for h in hooks:
                h.remove()
        self.tracker = None
        if not math.isfinite(float(loss)):
            raise ProbeFailure("nan", f"loss is {float(loss)} at the memory-tracked step (after step {after + 1})")
        self.result["peak_allocated_bytes"] = int(tracker.peak_bytes)
        self.result["peak_by_category_bytes"] = {k: int(v) for k, v in tracker.peak_by_category.items() if v > 0}

    def run_steps(self) -> None:
        warmup = int(self.spec.get("warmup_steps", 2))
        timed = int(self.spec.get("timed_steps", 5))
        limit = self.spec.get("stop_if_step_slower_than_s")
        track_cpu = self.device_type == "cpu"
        track_after = min(1, warmup + timed - 1)  # DDP rebuilds its gradient buckets in the second step
        losses: list[float] = []
        times: list[float] = []
        self.result["setup_s"] = round(time.perf_counter() - _STARTED, 3)
        for k in range(warmup + timed):
            self._sync()
            t0 = time.perf_counter()
            loss = self.one_step()
            self._sync()
            dt = time.perf_counter() - t0
            value = float(loss)
            bad = 0.0 if math.isfinite(value) else float(self.rank + 1)
            dt, bad = self._reduce_max([dt, bad])  # the highest rank with a non-finite loss, plus one
            losses.append(value)
            self.result["losses"] = losses
            kind = "warm-up" if k < warmup else "timed"
            if bad:
                shown = str(value) if not math.isfinite(value) else "not finite"
                on = f" on rank {int(bad) - 1}" if self.world > 1 else ""
                raise ProbeFailure("nan", f"loss is {shown} at step {k + 1} ({kind}){on}")
            if k >= warmup:
                times.append(dt)
                self.result["step_times_s"] = times
            if k == track_after and track_cpu:
                self.phase = "memory-tracked step"
                self.tracked_step(track_after)
            if k == warmup and limit is not None and dt > float(limit):
                raise ProbeFailure("pruned", f"the first timed step took {dt:.3g} s, slower than the limit of "
                                             f"{float(limit):g} s")

    # -- the whole run ------------------------------------------------------------------------------
    def run(self) -> None:
        self.check_strategy()
        device = self.setup_device()
        self.setup_distributed()
        contract = self.build(device)
        assert self.model is not None
        self.setup_training(self.model, device)
        self.phase = "making the batches"
        self.make_batches(contract, self.model, device)
        self.run_steps()
        self.phase = "finishing"
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            self.result["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
            self.result["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
            free, total = torch.cuda.mem_get_info()
            self.result["non_torch_bytes"] = int(max(0, total - free - torch.cuda.memory_reserved()))
        if self.master is not None and self.master.skipped_steps:
            self.notes.append(f"fp16 loss scaling skipped {self.master.skipped_steps} step(s) on overflow")


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


def _ddp_type() -> type:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


# ---------------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------------
def rank_out_path(out: str, rank: int) -> str:
    """Where rank ``rank`` writes its result: ``out`` for rank 0, ``out + ".rank{r}"`` otherwise."""
    return out if rank == 0 else f"{out}.rank{rank}"


def write_json_atomic(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` through a temporary file and a rename (never a half-written file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m optplan.probes.runtime_child",
                                     description="Run a few training steps of a model file under one strategy.")
    parser.add_argument("--spec", required=True, help="the ProbeSpec as a JSON file")
    parser.add_argument("--out", required=True, help="where rank 0 writes its result JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    _die_with_parent()
    sys.stdout.flush()
    os.dup2(2, 1)  # user prints (Python and C level) go to stderr; the result goes to a file
    sys.stdout = sys.stderr
    faulthandler.enable(file=sys.stderr, all_threads=True)
    rank = int(os.environ.get("RANK", "0"))
    result: dict[str, Any] = {
        "status": "ok", "reason": "", "rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "device_name": "", "torch_version": torch.__version__, "step_times_s": [], "losses": [],
        "peak_allocated_bytes": None, "peak_reserved_bytes": None, "non_torch_bytes": None,
        "peak_by_category_bytes": {}, "notes": [], "failed_at": None, "peer_failure": False, "setup_s": None,
    }
    probe: Probe | None = None
    try:
        with open(args.spec, encoding="utf-8") as fh:
            spec = json.load(fh)
        probe = Probe(spec, result)
        probe.run()
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a result
        status, reason = classify(exc, probe.where if probe is not None else "setup")
        result.update(status=status, reason=reason, failed_at=time.time(), peer_failure=peer_failure(exc))
        if status not in ("pruned",):
            traceback.print_exception(type(exc), exc, exc.__traceback__)
    if probe is not None and probe.device_type == "cuda" and result["peak_allocated_bytes"] is None:
        with contextlib.suppress(Exception):  # the peak before an OOM or crash still tells the planner something
            result["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
            result["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    timed = result["step_times_s"]
    if timed:
        ordered = sorted(timed)
        mid = len(ordered) // 2
        result["step_s"] = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        result["step_spread_s"] = max(timed) - min(timed)
    if result["status"] != "pruned" and probe is not None and probe.result.get("peak_allocated_bytes") is None \
            and result["status"] == "ok" and probe.device_type == "cpu":
        result["notes"].append("no memory figure: the tracked step did not run")
    code = EXIT_OK if result["status"] in ("ok", "pruned") else EXIT_FAILED
    try:
        write_json_atomic(rank_out_path(args.out, rank), result)
    finally:
        sys.stderr.flush()
    if code != EXIT_OK:
        os._exit(code)  # do not wait in collectives or destructors: torchrun stops the other ranks
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
