"""The probe's live-tensor tracker: optplan's MemTracker seeing DTensor shards, settling gloo collectives, with a cap.

:class:`ProbeTracker` is what the probe child (:mod:`optplan.probes.runtime_child`) and a generated train.py run
by it on the CPU count live bytes with; :func:`live_python_tensors` and :func:`optimizer_chain` find what a step
left alive (benchmarks/fidelity_tp_cpu.py uses them too); :func:`tracked_call` runs one optimizer step under it
with everything alive registered first. Standard library and torch only.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from optplan.probes.memtrack import MemTracker
from optplan.probes.probe_failures import ProbeOOM, human_bytes


def local_tensor(t: Any) -> Any:
    """The local tensor of a DTensor (FSDP2 shards), else ``t``."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


_SETTLED_COLLECTIVES = frozenset({
    "allreduce_", "allreduce_coalesced_", "allgather_", "_allgather_base_", "allgather_coalesced_",
    "allgather_into_tensor_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_", "broadcast_", "reduce_", "alltoall_", "alltoall_base_", "gather_",
    "scatter_"})
"""c10d operators whose work :class:`ProbeTracker` waits for and lets settle (not send/recv: a pipeline's
point-to-point pairs may need the peer's next operation posted first)."""

COLLECTIVE_SETTLE_S = 0.002
"""How long the main thread sleeps after a collective completed (seconds), so that gloo's worker thread
finishes its iteration and drops its reference to the work and its tensors (microseconds of work) before
the step goes on; see :class:`ProbeTracker`."""


class ProbeTracker(MemTracker):
    """MemTracker that sees DTensors' local shards, re-tags storages, and enforces a byte cap.

    On CPU with several ranks, gloo runs each collective on a worker thread that marks the work complete and
    only then drops its reference to the work, and with it the work's tensors. When the training code dropped
    its own reference in between (FSDP2 releasing a reduce-scatter input, DeepSpeed a reduced gradient), the
    buffer was freed on the worker thread microseconds to milliseconds later, and whether that was before or
    after the step's next peak decided the figure: the same FSDP-full run measured -0.54 %, +0.19 % or
    -4.85 % against the same prediction. On a GPU the caching allocator frees such a buffer when the last
    Python reference goes. So every collective (:data:`_SETTLED_COLLECTIVES`) seen in a tracked step is
    waited for at once and given :data:`COLLECTIVE_SETTLE_S` to settle: the buffers are then freed in program
    order, on the main thread (in practice: 2 ms is a margin, not a guarantee; two full fidelity_train runs gave
    identical figures). Only CPU steps under the tracker run so: the probe's memory-tracked steps (never its timed
    ones) and the steps of a generated train.py run by the probe on CPU (ScriptHooks). DTensor's functional
    collectives (``_c10d_functional``, transformers' tp_plan) are not settled."""

    def __init__(self, cap_bytes: int | None = None) -> None:
        super().__init__()
        self.cap_bytes = cap_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if getattr(func, "namespace", None) == "c10d" and func._opname in _SETTLED_COLLECTIVES:
            leaves = tree_leaves(out)
            if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in leaves):
                return out  # gloo on CPU only: NCCL's streams order their own frees
            works = [w for w in leaves if isinstance(w, torch.ScriptObject) and hasattr(w, "wait")]
            for work in works:
                work.wait()
            if works:
                time.sleep(COLLECTIVE_SETTLE_S)
        return out

    def _add(self, t: torch.Tensor, category: str = "activation") -> None:
        t = local_tensor(t)
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        super()._add(t, category)
        if self.cap_bytes is not None and self.live_bytes > self.cap_bytes:
            raise ProbeOOM(f"live tensor bytes {self.live_bytes:,} ({human_bytes(self.live_bytes)}) exceed the memory cap "
                           f"of {self.cap_bytes:,} bytes ({human_bytes(self.cap_bytes)})")

    def retag(self, t: Any, category: str) -> None:
        """Move a tracked storage's bytes to ``category`` (e.g. an activation that became ``p.grad``)."""
        key = self._storage_key(local_tensor(t))
        if key is None or key not in self._sizes:
            return
        old = self._category[key]
        if old == category:
            return
        size = self._sizes[key]
        self._category[key] = category
        self.live_by_category[old] -= size
        self.live_by_category[category] = self.live_by_category.get(category, 0) + size


def live_python_tensors(device_type: str) -> list[torch.Tensor]:
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
            local = local_tensor(obj)
            if isinstance(local, FakeTensor) or local.device.type != device_type:
                continue
            out.append(obj)
        except Exception:  # noqa: BLE001 - weak proxies, half-built objects
            continue
    return out


def optimizer_chain(opt: Any) -> list[torch.optim.Optimizer]:
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


def tracked_call(trainer: Any, step: Callable[[], torch.Tensor], cap_bytes: int | None,
                 inputs: list[Any]) -> tuple[torch.Tensor, ProbeTracker]:
    """Run ``step`` (one optimizer step of ``trainer``, a :class:`~optplan.probes.trainloop.Trainer` of this
    package or of a generated train.py) under a ProbeTracker with everything alive registered first: the
    CPU memory figures. ``trainer.tracker`` stays set when the step raises, so the reason names it.

    A full garbage collection comes first: tensors held only by reference cycles (FSDP2 leaves a unit's
    unsharded parameters in one after the first steps) are freed whenever Python's cyclic collector next
    runs, which depends on how many objects the process allocated so far, so without it the same run counted
    them on one machine and not on another (+4.9 % on FSDP-full, measured in CI). A long run's steady state,
    the figure a plan is for, has collected them."""
    gc.collect()
    model = trainer.model
    tracker = ProbeTracker(cap_bytes)
    params = list(model.parameters())
    param_keys = set()
    for p in params:
        key = MemTracker._storage_key(local_tensor(p))
        if key is not None:
            param_keys.add(key)
    tracker.track(params, category="param")
    tracker.track([p.grad for p in params], category="grad")
    for opt in optimizer_chain(trainer.master or trainer.optimizer):
        for group in opt.param_groups:
            masters = [t for t in group["params"] if MemTracker._storage_key(local_tensor(t)) not in param_keys]
            tracker.track(masters, category="master")
        tracker.track([v for st in opt.state.values() for v in (st.values() if isinstance(st, dict) else [st])
                       if isinstance(v, torch.Tensor)], category="optimizer")
    tracker.track(list(model.buffers()), category="buffer")
    tracker.track(list(trainer.ddp_buckets.values()), category="bucket")
    tracker.track(inputs, category="input")
    rest = live_python_tensors(trainer.device_type)
    if trainer.fsdp != "none":  # FSDP2's unsharded parameters (storage resized to 0 between uses)
        tracker.track([t for t in rest if isinstance(t, nn.Parameter)], category="unsharded_param")
    tracker.track(rest, category="other")
    hooks = []
    for p in params:
        if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
            hooks.append(p.register_post_accumulate_grad_hook(
                lambda q: tracker.retag(q.grad, "grad") if q.grad is not None else None))

    def retag_grads() -> None:  # gradients made by backward are "grad" from the optimizer step on
        for p in params:
            if p.grad is not None:
                tracker.retag(p.grad, "grad")

    previous = trainer.before_optimizer_step
    trainer.before_optimizer_step = retag_grads
    trainer.tracker = tracker
    try:
        with tracker, tracker.watch_resizes():  # FSDP2 frees/gathers parameters by storage resizes
            loss = step()
    finally:
        for h in hooks:
            h.remove()
        trainer.before_optimizer_step = previous
    trainer.tracker = None
    return loss, tracker


__all__ = ["COLLECTIVE_SETTLE_S", "ProbeTracker", "live_python_tensors", "local_tensor", "optimizer_chain",
           "tracked_call"]
