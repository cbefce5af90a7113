"""The probe's live-tensor tracker: optplan's MemTracker seeing DTensor shards, settling gloo collectives, with a cap.

:class:`ProbeTracker` is what the probe child (:mod:`optplan.probes.runtime_child`) and a generated train.py run
by it on the CPU count live bytes with; :func:`live_python_tensors` and :func:`optimizer_chain` find what a step
left alive (benchmarks/fidelity_tp_cpu.py uses them too). Standard library and torch only.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
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


__all__ = ["COLLECTIVE_SETTLE_S", "ProbeTracker", "live_python_tensors", "local_tensor", "optimizer_chain"]
