"""Runtime probe child: a few real training steps of a user's model under one strategy.

``python -m optplan.probes.runtime_child --spec SPEC.json --out RESULT.json`` (one process), or the
same module under ``torchrun`` (``optplan.probes.distributed`` builds the command). The spec is
:class:`optplan.probes.runtime.ProbeSpec` as JSON (the strategy as a plain dict).

Imports: the standard library, torch, ``optplan.probes.contract``, ``optplan.probes.memtrack`` and
``optplan.probes.model_errors`` (no pydantic, optuna, typer, rich, yaml or textual), plus deepspeed
when the strategy's engine is DeepSpeed and bitsandbytes for ``adamw8bit``. It therefore runs in a bare
training environment (torch only) next to the user's own stack.

What one probe does (every rank does the same):

0. imports the model file; with ``spec.device_lock`` (one process only) also what its device work would import
   on first use, then it waits for an exclusive ``flock`` on that file before its first use of the device and
   holds it until its result is written and its device memory is back with the driver (probes/device_lock.py):
   probes started together overlap their imports and teardowns, never their device work (``device_wait_s`` in
   the result; ``timeline_s`` marks each phase);
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
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from optplan.probes.contract import (  # noqa: E402
    BATCH_FIX,
    DEFAULT_TOKEN_SEQ_LEN,
    ModelContract,
    check_batch_type,
    exc_text,
    load_contract,
)
from optplan.probes.device_lock import DeviceLock  # noqa: E402
from optplan.probes.device_lock import acquire as acquire_device  # noqa: E402
from optplan.probes.dropout import gpu_dropout  # noqa: E402
from optplan.probes.host_quiet import group_from_env, resume, stop_newcomers, stop_others  # noqa: E402
from optplan.probes.host_speed import host_op_s  # noqa: E402
from optplan.probes.model_errors import ModelFileError  # noqa: E402
from optplan.probes.probe_failures import (  # noqa: E402
    ProbeFailure,
    classify,
    peer_failure,
)
from optplan.probes.probe_tracker import ProbeTracker, tracked_call  # noqa: E402
from optplan.probes.trainloop import (  # noqa: E402
    Trainer,
    first_param_module,
    max_positions,
    to_device,
    write_json_atomic,
)

EXIT_OK = 0
EXIT_FAILED = 3
"""Exit code of a rank that wrote a failure result (error, oom, nan)."""

MAX_PREMADE_BATCHES = 4
"""Distinct micro-batches made before the steps (reused in turn)."""

DATA_PARALLEL_ONLY = "the probe runs data-parallel strategies only (tp/pp/cp = 1, engines torch and deepspeed)"
FP8_REFUSED = ("fp8 needs Transformer Engine / torchao fp8 layers, which the probe does not emulate: probe "
               "with precision bf16 (fp8 keeps bf16 weights and fp32 master states)")


# ---------------------------------------------------------------------------------------------------
# host helpers
# ---------------------------------------------------------------------------------------------------
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


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (torchrun, or optplan) dies: no orphans if the
    launcher is killed."""
    from optplan.probes._pdeathsig import die_with_launcher

    if not die_with_launcher():  # the launcher already died before prctl
        os._exit(EXIT_FAILED)


# ---------------------------------------------------------------------------------------------------
# the probe
# ---------------------------------------------------------------------------------------------------
class Probe(Trainer):
    """One rank's run of a ProbeSpec (a dict) through :class:`~optplan.probes.trainloop.Trainer` (the code
    of the generated train.py); fills ``self.result``."""

    def __init__(self, spec: dict[str, Any], result: dict[str, Any], *, marker_base: str | None = None) -> None:
        """``marker_base``: rank 0's result file, beside which the lock's marker files go (``.waiting``,
        ``.acquired``); None: none are written."""
        ds_config = spec.get("ds_config")
        super().__init__(spec["strategy"], device_type=spec.get("device", "cpu"),
                         ds_config=ds_config if isinstance(ds_config, dict) else None,
                         block_class=spec.get("block_class"), compile=bool(spec.get("compile")),
                         use_accelerate=bool(spec.get("accelerate_config")), notes=result["notes"])
        self.spec = spec
        self.result = result
        self.batches: list[Any] = []
        self.tracker: ProbeTracker | None = None
        self.device_lock: DeviceLock | None = None
        self.device = torch.device(self.device_type)
        self.quieted: list[int] | None = None  # the group's processes stopped for the timed steps (quiet_host)
        self.quiet_group: str | None = None
        self.marker_base = marker_base
        self.track_ddp_buckets = self.device_type == "cpu"  # DDP's flat gradient buckets, by index

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
        device = super().setup_device()
        if device.type == "cuda":
            self.result["device_name"] = torch.cuda.get_device_name(device)
            cap = self.spec.get("memory_cap_bytes")
            if cap:
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        else:
            self.result["device_name"] = cpu_name()
        return device

    # -- the model ----------------------------------------------------------------------------------
    def load(self) -> ModelContract:
        """Import the model file (its module-level code and imports: no model is built yet)."""
        self.phase = "loading the model file"
        path = self.spec["model_path"]
        sys.argv = [path]  # as if the user ran `python FILE`
        contract = load_contract(path, model_name=self.spec.get("model_name"), plain_defaults=True)
        self.notes.extend(n for n in contract.notes if self.rank == 0)
        return contract

    def wait_for_device(self) -> None:
        """With ``spec["device_lock"]`` (a file path), take an exclusive ``flock`` on it before the first use of the
        device (:mod:`optplan.probes.device_lock`), so that probes started together share one GPU in turn: their
        imports and model-file loading overlap, their device work (and so every timed step, the CUDA context and
        every memory figure) does not. Without it: nothing. The wait is recorded as ``device_wait_s``."""
        path = self.spec.get("device_lock")
        if not path:
            return
        self.phase = "waiting for the device (another probe holds its lock)"
        if self.device_type == "cuda":  # nothing before the lock may have touched the device (a context's bytes)
            self.result["cuda_initialized_before_lock"] = bool(torch.cuda.is_initialized())
        self.touch_marker("waiting")
        self.device_lock = acquire_device(str(path))
        self.touch_marker("acquired")
        self.result["device_wait_s"] = self.device_lock.wait_s
        self.result["device_acquired_at"] = self.device_lock.acquired_at
        self.mark("device_acquired")
        if not self.device_lock.previous_handed:  # it kept the device to its exit: its memory goes with it
            self.wait_for_previous_holder()

    def wait_for_previous_holder(self) -> None:
        """Wait for the previous holder of the device lock to be gone (``previous_exit_wait_s``, summed)."""
        if self.device_lock is not None:
            waited = self.device_lock.wait_for_previous_exit()
            self.result["previous_exit_wait_s"] = round(self.result.get("previous_exit_wait_s", 0.0) + waited, 3)

    def touch_marker(self, name: str) -> None:
        """Create ``<result file>.<name>`` (its time is when this process began waiting for, or took, the device
        lock): the parent leaves the lock wait out of the probe's timeout (probes/runtime.py)."""
        if self.marker_base:
            with contextlib.suppress(OSError):
                open(f"{self.marker_base}.{name}", "w").close()

    def mark(self, name: str) -> None:
        """Record ``name`` in the result's ``timeline_s``: seconds since this process started (where a probe's
        time goes: imports, the wait, the context, the build, the steps, the hand-over)."""
        self.result.setdefault("timeline_s", {})[name] = round(time.perf_counter() - _STARTED, 3)

    def preload(self) -> None:
        """With a device lock, import before the wait what the device work would import on first use, so that it
        overlaps with another probe's steps instead of holding the device: DeepSpeed; ``torch._dynamo``, which the
        first optimizer's construction imports (``torch._compile``'s lazy import: 1.0-2.6 s of the lock on this
        project's CPU, 815 modules); inductor under torch.compile; the profiler for traced steps; FSDP and
        checkpointing when the strategy uses them. No import here touches the device. A failing import is left to
        the code that needs it, which reports it."""
        if not self.spec.get("device_lock"):
            return
        import importlib

        wanted = ["torch._dynamo", "torch.utils.checkpoint"]
        if self.engine == "deepspeed":
            wanted.append("deepspeed")
        if self.compile:  # no compile-worker pool started at import (its workers would query the device)
            os.environ.setdefault("TORCH_WARM_POOL", "0")
            wanted.append("torch._inductor.compile_fx")
        if self.fsdp != "none":
            wanted.append("torch.distributed.fsdp")
        if int(self.spec.get("trace_steps") or 0):
            wanted += ["torch.profiler", "optplan.probes.step_trace"]
        for name in wanted:
            with contextlib.suppress(Exception):
                importlib.import_module(name)

    def build(self, device: torch.device, contract: ModelContract) -> None:
        """Build the model from ``contract`` on ``device`` (a module-level instance is moved there)."""
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
            self.batches.append(to_device(batch, device, self.input_dtype))

    def batch_for(self, i: int) -> Any:
        return self.batches[i % len(self.batches)]

    # -- strategy -----------------------------------------------------------------------------------
    def setup_training(self, model: nn.Module, device: torch.device) -> None:
        super().setup_training(model, device)
        self.result["checkpointing_applied"] = self.checkpointing_applied
        if self.compile and self.device_type == "cpu" and self.rank == 0:
            self.notes.append("torch.compile: the CPU memory figure is of the eager step (torch.compile skips "
                              "frames while the probe's tensor tracker, a TorchDispatchMode, is active); the "
                              "step times are of the compiled model")

    # -- steps --------------------------------------------------------------------------------------
    DISTRIBUTED_TRACKED_STEPS = 3
    """Extra tracked steps of a run with several ranks; the largest peak is kept (a GPU's max_memory_allocated is
    the whole run's). Their collectives settle (:class:`ProbeTracker`), so the steps measure the same; the extra
    steps stay as a guard. Every engine does as many, so that their runs stay step for step the same
    computation."""

    def tracked_step(self, after: int) -> None:
        """Extra steps under a ProbeTracker with everything alive registered (CPU memory figures): one, or
        :data:`DISTRIBUTED_TRACKED_STEPS` with several ranks; the largest peak is kept."""
        for _ in range(self.DISTRIBUTED_TRACKED_STEPS if self.world > 1 else 1):
            loss, tracker = tracked_call(self, lambda: self.one_step(self.batch_for),
                                         self.spec.get("memory_cap_bytes"), self.batches)
            if not math.isfinite(float(loss)):
                raise ProbeFailure("nan", f"loss is {float(loss)} at the memory-tracked step (after step {after + 1})")
            if int(tracker.peak_bytes) >= (self.result.get("peak_allocated_bytes") or 0):
                self.result["peak_allocated_bytes"] = int(tracker.peak_bytes)
                self.result["peak_by_category_bytes"] = {k: int(v) for k, v in tracker.peak_by_category.items()
                                                         if v > 0}

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
            if k == warmup:  # the previous holder's teardown overlaps the warm-up, never a timed step
                self.wait_for_previous_holder()
                self.quiet_host()
                self.result["host_op_s"] = host_op_s(self.device)
                self.quiet_newcomers()
            self.sync()
            t0 = time.perf_counter()
            loss = self.one_step(self.batch_for)
            self.sync()
            dt = time.perf_counter() - t0
            value = float(loss)
            bad = 0.0 if math.isfinite(value) else float(self.rank + 1)
            dt, bad = self.reduce_max([dt, bad])  # the highest rank with a non-finite loss, plus one
            losses.append(value)
            self.result["losses"] = losses
            if k == 0:
                self.mark("first_step")  # the first step's one-time work: kernels loaded, plans built, autotuning
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
        contract = self.load()
        self.preload()
        self.mark("imported")
        self.wait_for_device()
        device = self.setup_device()
        self.setup_distributed()
        self.mark("device_ready")
        self.build(device, contract)
        self.mark("built")
        assert self.model is not None
        self.setup_training(self.model, device)
        self.mark("set_up")
        self.phase = "making the batches"
        self.make_batches(contract, self.model, device)
        self.device = device
        # on the CPU, dropout runs as CUDA's fused kernel does (a bool mask, not a noise tensor of the input's dtype):
        # the memory a CPU probe measures is then the GPU's that the profile priced (probes/dropout.py)
        as_on_gpu = gpu_dropout() if self.device_type == "cpu" else contextlib.nullcontext()
        if self.device_type == "cpu" and any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
                                             for m in self.model.modules()):
            self.notes.append("dropout ran as CUDA's fused kernel does (1-byte masks), as the profile prices it; "
                              "torch's CPU dropout keeps masks of the input's dtype")
        try:
            with as_on_gpu:
                self.run_steps()
                self.mark("stepped")
                self.phase = "finishing"
                self.read_device_memory()
                if self.master is not None and self.master.skipped_steps:
                    self.notes.append(f"fp16 loss scaling skipped {self.master.skipped_steps} step(s) on overflow")
                self.run_traced_steps()
        finally:
            self.resume_host()

    def quiet_host(self) -> None:
        """Holding the device lock in a quiet group (``$OPTPLAN_QUIET_GROUP``): stop the group's other processes
        until :meth:`resume_host`, so that no import or profile shares the host with the timed and traced steps
        (probes/host_quiet.py); ``quieted_processes`` says how many."""
        group = group_from_env()
        if self.device_lock is None or not self.device_lock.held or group is None or self.quieted is not None:
            return
        self.quiet_group = group
        self.quieted = stop_others(group, spare=self.spared())
        self.result["quieted_processes"] = len(self.quieted)

    def spared(self) -> tuple[int, ...]:
        """The previous holder of the lock, if still tearing down (its CUDA context would stay, frozen, in the
        device-wide memory figure)."""
        lock = self.device_lock
        return (lock.previous_pid,) if lock is not None and lock.previous_pid is not None else ()

    def quiet_newcomers(self) -> None:
        """Stop the group's members started since :meth:`quiet_host` (a probe its owner was starting meanwhile)."""
        if self.quieted is not None and self.quiet_group is not None:
            self.quieted = stop_newcomers(self.quiet_group, self.quieted, spare=self.spared())
            self.result["quieted_processes"] = len(self.quieted)

    def resume_host(self) -> None:
        """Continue what :meth:`quiet_host` stopped (nothing when it stopped nothing)."""
        if self.quieted is not None and self.quiet_group is not None:
            resume(self.quiet_group, self.quieted)
            self.quieted = None
            self.mark("resumed")

    def read_device_memory(self) -> None:
        """CUDA: the run's allocator peaks and the non-torch bytes, read after the timed steps and before any
        traced step (the profiler's own device buffers are not the training's)."""
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            self.wait_for_previous_holder()  # its context is the device's until it exits
            self.result["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
            self.result["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
            free, total = torch.cuda.mem_get_info()
            self.result["non_torch_bytes"] = int(max(0, total - free - torch.cuda.memory_reserved()))
        self.mark("measured")

    def run_traced_steps(self) -> None:
        """``spec["trace_steps"]`` extra steps under torch.profiler, after the timed steps and the memory figures
        (its overhead stays out of both)."""
        traced = int(self.spec.get("trace_steps") or 0)
        if not traced:
            return
        from optplan.probes.step_trace import trace_steps

        self.phase = "traced steps"
        try:
            self.result["step_trace"] = trace_steps(lambda: self.one_step(self.batch_for), traced,
                                                    cuda=self.device_type == "cuda", sync=self.sync)
        except Exception as exc:  # noqa: BLE001 - the run is measured already: a failed trace is a note, not its status
            self.notes.append(f"the traced steps failed ({exc_text(exc)}): no step_trace; the step times and memory "
                              "figures are measured without them")
        self.mark("traced")

    def drop_device_state(self) -> None:
        """Let go of everything this probe holds on the device (before :meth:`DeviceLock.hand_over`): a DeepSpeed
        engine is destroyed first (``DeepSpeedEngine.destroy``: its optimizer's flat buffers and hooks; the seventh
        H200 visit's ZeRO-1 and ZeRO-2 probes kept 19.9 GB reserved without it)."""
        if getattr(self, "engine_obj", None) is not None and hasattr(self.engine_obj, "destroy"):
            with contextlib.suppress(Exception):
                self.engine_obj.destroy()
        for name in ("model", "optimizer", "master", "scaler", "engine_obj", "accelerator", "runner", "loss_fn",
                     "before_optimizer_step", "tracker"):
            if hasattr(self, name):
                setattr(self, name, None)
        self.batches.clear()
        self.ddp_buckets = {}
        if self.compile:  # compiled graphs and their guards hold the module
            with contextlib.suppress(Exception):
                torch._dynamo.reset()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # a one-process group's communicator (NCCL buffers)
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------------
def rank_out_path(out: str, rank: int) -> str:
    """Where rank ``rank`` writes its result: ``out`` for rank 0, ``out + ".rank{r}"`` otherwise."""
    return out if rank == 0 else f"{out}.rank{rank}"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m optplan.probes.runtime_child",
                                     description="Run a few training steps of a model file under one strategy.",
                                     epilog="Or measure an exported train.py on the CPU under the live-tensor "
                                            "tracker (its measurements.json then feeds optplan calibrate): "
                                            "python -m optplan.probes.runtime_child --train-script train.py "
                                            "[--memory-cap-bytes N] -- TRAIN_PY_ARGS")
    parser.add_argument("--spec", required=True, help="the ProbeSpec as a JSON file")
    parser.add_argument("--out", required=True, help="where rank 0 writes its result JSON")
    return parser.parse_args(argv)


def hand_over(probe: Probe, result: dict[str, Any]) -> None:
    """A finished probe holding the device lock releases it before exiting, when its device memory is back with
    the driver (:meth:`~optplan.probes.device_lock.DeviceLock.hand_over`): ``device_handed_over`` and, on CUDA,
    ``device_residue_bytes`` in the result; a failure here leaves the lock to the process's exit."""
    lock = probe.device_lock
    assert lock is not None
    try:
        residue = lock.hand_over(probe.device_type, probe.drop_device_state)
    except Exception as exc:  # noqa: BLE001 - the result is already measured: keep the lock to the exit
        result["notes"].append(f"the device lock was kept to the exit: freeing the device raised {exc_text(exc)}")
        return
    result["device_handed_over"] = not lock.held
    if residue is not None:
        result["device_residue_bytes"] = residue
    if not lock.held:  # when the lock was let go, not now: on the CPU a heap traversal follows the release
        released = lock.released_perf_s if lock.released_perf_s is not None else time.perf_counter()
        probe.result.setdefault("timeline_s", {})["released"] = round(released - _STARTED, 3)


def main(argv: list[str] | None = None) -> int:
    from optplan.probes.train_script_child import run_train_script, train_script_args

    script = train_script_args(list(sys.argv[1:] if argv is None else argv))
    if script is not None:  # a generated train.py, measured: the same Trainer, the user's own loop
        _die_with_parent()
        return run_train_script(*script)
    args = _parse_args(argv)
    _die_with_parent()
    sys.stdout.flush()
    os.dup2(2, 1)  # user prints (Python and C level) go to stderr; the result goes to a file
    sys.stdout = sys.stderr
    faulthandler.enable(file=sys.stderr, all_threads=True)
    rank = int(os.environ.get("RANK", "0"))
    result: dict[str, Any] = {"started_at": round(time.time() - (time.perf_counter() - _STARTED), 3),
        "status": "ok", "reason": "", "rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "device_name": "", "torch_version": torch.__version__, "step_times_s": [], "losses": [],
        "peak_allocated_bytes": None, "peak_reserved_bytes": None, "non_torch_bytes": None,
        "peak_by_category_bytes": {}, "notes": [], "failed_at": None, "peer_failure": False, "setup_s": None,
    }
    probe: Probe | None = None
    try:
        with open(args.spec, encoding="utf-8") as fh:
            spec = json.load(fh)
        probe = Probe(spec, result, marker_base=rank_out_path(args.out, rank))
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
        if probe is not None and probe.device_lock is not None and code == EXIT_OK:
            hand_over(probe, result)  # after the result is written: a hang here still leaves its figures to the parent
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
