"""Live tensor-storage accounting: a ``TorchDispatchMode`` that tracks bytes alive and their peak.

Every tensor an operator returns while the mode is active is looked up by its storage; a storage not
seen before is counted (``nbytes``) and gets a ``weakref.finalize`` callback that subtracts it again
when the storage is freed. Views and in-place results share their base's storage and are counted once;
a storage that changes size (``out=`` resizing) is re-counted. Tensors that existed before the mode was
entered (parameters, gradients, buffers, an input batch) are not seen by the mode: register them with
:meth:`MemTracker.track` so that in-place updates of them are not mistaken for new allocations and so
that they count towards ``live_bytes``.

It works the same on real CPU tensors and on ``FakeTensorMode`` tensors (enter the fake mode first,
then this mode), which is what makes the fake-tensor activation profile checkable against a real step.
Only public torch APIs are used (``TorchDispatchMode``, ``untyped_storage``), so it works on torch 2.4+.

Each storage has a category: registered tensors get the one passed to :meth:`MemTracker.track`
(default ``"state"``), a dtype cast (``aten._to_copy``) of a storage registered as ``"param"`` is a
``"param_copy"`` (autocast's low-precision weight copies), anything else an ``"activation"``.
``peak_by_category`` is the breakdown at the moment of the peak, and ``peak_without_copies`` the peak
of live bytes not counting ``"param_copy"`` storages (what a model holding 16-bit weights would need).

With ``record=True`` the tracker also keeps a timeline: after every allocation that raises the live
bytes it appends ``(live_bytes, live bytes not counting "param_copy" storages)`` to the list of the
current :attr:`MemTracker.phase` (a label the caller sets, e.g. from module hooks). Every local maximum
of live bytes directly follows such an allocation, so the largest entry of a phase is its peak; and two
runs of the same program on inputs of different sizes give timelines that line up entry by entry
(what ``optplan.probes.static`` fits over the micro-batch).

Byte counts are storage sizes without allocator rounding (the CUDA caching allocator rounds up to
512 B blocks and keeps freed blocks; that overhead belongs to the estimators' fragmentation margin).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_TO_COPY = torch.ops.aten._to_copy.default


class MemTracker(TorchDispatchMode):
    """Track live tensor storage bytes and their peak while active.

    Usage::

        tracker = MemTracker()
        tracker.track(model.parameters(), (p.grad for p in model.parameters()))
        with tracker:
            ...  # forward, loss, backward
        extra_peak = tracker.peak_bytes - tracker.baseline_bytes

    ``live_bytes`` keeps being updated after the mode exits (finalizers fire when storages die), so a
    tracker can be re-entered; call :meth:`reset_peak` to start a new peak from the current live bytes.
    """

    def __init__(self, record: bool = False) -> None:
        super().__init__()
        self.record = record
        self.phase = "step"
        self.events: dict[str, list[tuple[int, int]]] = {}
        self._sizes: dict[int, int] = {}
        self._category: dict[int, str] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.baseline_bytes = 0
        self.allocations = 0
        self.live_by_category: dict[str, int] = {}
        self.peak_by_category: dict[str, int] = {}
        self.peak_without_copies = 0

    # -- registration -------------------------------------------------------------------------------
    def track(self, *tensors: torch.Tensor | Iterable[Any] | None, category: str = "state") -> int:
        """Register existing tensors (or iterables / nested containers of them); returns bytes added.

        ``None`` entries (e.g. missing gradients) are ignored. Register parameters with
        ``category="param"`` so that casts of them count as ``"param_copy"``. After registering, the
        baseline is set to the live bytes (see :meth:`set_baseline`).
        """
        before, record = self.live_bytes, self.record
        self.record = False  # registering is not an allocation of the step
        try:
            for obj in tensors:
                if obj is None:
                    continue
                if isinstance(obj, torch.Tensor):
                    self._add(obj, category)
                    continue
                if not isinstance(obj, (list, tuple, dict)):
                    obj = list(obj)  # generators such as model.parameters()
                for leaf in tree_leaves(obj):
                    if isinstance(leaf, torch.Tensor):
                        self._add(leaf, category)
        finally:
            self.record = record
        self.set_baseline()
        return self.live_bytes - before

    def set_baseline(self) -> None:
        """Take the current live bytes as the baseline and restart the peak from it."""
        self.baseline_bytes = self.live_bytes
        self.reset_peak()

    def reset_peak(self) -> None:
        """Restart the peak from the current live bytes (the baseline is unchanged)."""
        self.peak_bytes = self.live_bytes
        self.peak_by_category = dict(self.live_by_category)
        self.peak_without_copies = self.live_bytes - self.live_by_category.get("param_copy", 0)

    @property
    def peak_above_baseline(self) -> int:
        """Peak live bytes minus the baseline (bytes)."""
        return self.peak_bytes - self.baseline_bytes

    @property
    def live_without_copies(self) -> int:
        """Live bytes not counting ``"param_copy"`` storages."""
        return self.live_bytes - self.live_by_category.get("param_copy", 0)

    def timeline(self) -> dict[str, list[tuple[int, int]]]:
        """The recorded events above the baseline, per phase in the order the phases started: lists of
        ``(live bytes, live bytes without param copies)`` after each allocation (bytes)."""
        base = self.baseline_bytes
        return {phase: [(live - base, bare - base) for live, bare in events]
                for phase, events in self.events.items()}

    # -- accounting ---------------------------------------------------------------------------------
    @staticmethod
    def _storage_key(t: Any) -> int | None:
        try:
            return t.untyped_storage()._cdata
        except (AttributeError, RuntimeError, NotImplementedError, TypeError):
            return None

    def _add(self, t: torch.Tensor, category: str = "activation") -> None:
        try:
            st = t.untyped_storage()
            nbytes = int(st.nbytes())
        except (RuntimeError, NotImplementedError, TypeError):
            return  # sparse, nested or otherwise storage-less tensors
        key = st._cdata
        old = self._sizes.get(key)
        before = self.live_bytes
        if old is None:
            self._sizes[key] = nbytes
            self._category[key] = category
            self.live_bytes += nbytes
            self.live_by_category[category] = self.live_by_category.get(category, 0) + nbytes
            self.allocations += 1
            weakref.finalize(st, self._free, key)
        elif old != nbytes:
            self._sizes[key] = nbytes
            cat = self._category[key]
            self.live_bytes += nbytes - old
            self.live_by_category[cat] += nbytes - old
        else:
            return
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_by_category = dict(self.live_by_category)
        without = self.live_without_copies
        if without > self.peak_without_copies:
            self.peak_without_copies = without
        if self.record and self.live_bytes > before:
            self.events.setdefault(self.phase, []).append((self.live_bytes, without))

    def note_resize(self, storage: Any) -> None:
        """Account a tracked storage whose size changed outside the dispatcher (bytes), e.g. FSDP2 freeing
        and re-gathering unsharded parameters with ``untyped_storage().resize_(n)``; unknown storages are
        ignored. Called by :meth:`watch_resizes`."""
        key = getattr(storage, "_cdata", None)
        old = self._sizes.get(key) if key is not None else None
        if old is None:
            return
        nbytes = int(storage.nbytes())
        if nbytes == old:
            return
        before = self.live_bytes
        cat = self._category[key]
        self._sizes[key] = nbytes
        self.live_bytes += nbytes - old
        self.live_by_category[cat] += nbytes - old
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_by_category = dict(self.live_by_category)
        without = self.live_without_copies
        if without > self.peak_without_copies:
            self.peak_without_copies = without
        if self.record and self.live_bytes > before:
            self.events.setdefault(self.phase, []).append((self.live_bytes, without))

    def watch_resizes(self) -> Any:
        """A context manager under which ``torch.UntypedStorage.resize_`` also calls :meth:`note_resize`
        (storage resizes do not pass through ``__torch_dispatch__``). The original method is restored on
        exit."""
        import contextlib

        tracker = self

        @contextlib.contextmanager
        def watching() -> Any:
            original = torch.UntypedStorage.resize_

            def resize_(storage: Any, size: int) -> Any:
                out = original(storage, size)
                tracker.note_resize(storage)
                return out

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
            try:
                yield tracker
            finally:
                torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]

        return watching()

    def _free(self, key: int) -> None:
        nbytes = self._sizes.pop(key, None)
        if nbytes is not None:
            self.live_bytes -= nbytes
            self.live_by_category[self._category.pop(key)] -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        category = "activation"
        if func is _TO_COPY and args and self._category.get(self._storage_key(args[0]) or -1) == "param":
            category = "param_copy"
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf, category)
        return out
