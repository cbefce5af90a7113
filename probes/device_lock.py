"""One GPU shared by probes run together: an exclusive ``flock`` taken before a probe's first use of the device.

``ProbeSpec.device_lock`` names a lock file. The probe child (:mod:`optplan.probes.runtime_child`) imports the model
file first, then :func:`acquire` blocks until it holds the lock; from then on it alone uses the device. Its
imports overlapped with another probe's steps; its own device work (the CUDA context, the model on the device, every
timed step and every memory figure) overlaps with none. The kernel releases a ``flock`` when the process ends,
however it ends.

Whoever holds the lock writes its pid and state into the file (``"<pid> holding"``). A probe that finished cleanly
hands the device on before it exits (:meth:`DeviceLock.hand_over`): it drops what it holds on the device (model,
optimizer, a one-process group's NCCL communicator, compiled graphs), returns the allocator's cache to the driver,
writes ``"<pid> handed"`` and releases the lock when less than :data:`HAND_OVER_RESIDUE_BYTES` stays reserved. The
next probe then creates its context and builds its model while this one is still tearing down (the interpreter's
finalization and the driver's context teardown; on the sixth H200 visit a probe's wall time exceeded its setup and
steps by 1.2-1.4 s, and the child's ``timeline_s`` now tells how much of that is teardown). It waits for that process
to be gone before its first timed step and before its device-wide memory figure (:meth:`DeviceLock.
wait_for_previous_exit`), so both read as when it runs alone. A holder that kept the lock to its exit (a failed
probe, or one whose references could not all be dropped) still holds its memory while the kernel releases the lock
(the lock's descriptor is closed before the driver's), so the next probe waits for it to be gone before it first
touches the device.

``OPTPLAN_DEVICE_LOCK`` (:data:`DEVICE_LOCK_ENV`): a lock file that every probe optplan starts takes when its spec
names none (:func:`lock_from_env`): a one-process probe in its child, a probe of several processes in the parent
around the whole run. Several optplan commands (``optplan validate --jobs``, a benchmark's threads) then share one GPU
in turn.

Standard library only, plus torch inside :meth:`DeviceLock.hand_over` (already imported by the child).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from optplan.probes._pdeathsig import alive as process_alive

DEVICE_LOCK_ENV = "OPTPLAN_DEVICE_LOCK"
"""The environment variable naming a lock file probes take by default (see the module docstring)."""

HAND_OVER_RESIDUE_BYTES = 256 * 2**20
"""Bytes the caching allocator may still reserve after a finished probe dropped its references and emptied the
cache, for the lock to be released before the process exits (bytes). Above it something still holds device
memory and the lock is kept to the exit."""

PREVIOUS_EXIT_WAIT_S = 10.0
"""How long a holder waits for the previous holder's process to be gone (s). A handed-over one holds only its
context (under a GiB) and usually has exited long before; one that kept the lock to its exit is exiting already."""

HOLDING, HANDED = "holding", "handed"
"""The states a holder writes after its pid: holding the device, or handed it over (its memory back)."""


@dataclass
class DeviceLock:
    """An exclusive ``flock`` held on ``path`` (``fd`` open while held); ``wait_s`` is how long taking it took (s),
    ``acquired_at`` when it was taken (Unix time, s); ``previous_pid`` the last holder that wrote its pid, and
    ``previous_handed`` whether it handed the device over (else it held it to its exit); ``released_perf_s``
    when it let go (``time.perf_counter()``), which the probe's timeline records as ``released``."""

    path: str
    fd: int | None
    wait_s: float
    acquired_at: float
    previous_pid: int | None = None
    previous_handed: bool = False
    released_perf_s: float | None = None  # time.perf_counter() when release() let go (None: still held)

    @property
    def held(self) -> bool:
        return self.fd is not None

    def _write_state(self, state: str | None) -> None:
        """Write ``"<pid> <state>"`` into the lock file (None: empty it)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
            if state is not None:
                os.pwrite(self.fd, f"{os.getpid()} {state}\n".encode(), 0)

    def release(self) -> None:
        """Release the lock now (``LOCK_UN``, then close: a forked child sharing the descriptor keeps no lock);
        nothing when already released."""
        if self.fd is not None:
            self.released_perf_s = time.perf_counter()  # before the unlock: the next holder starts after this
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def hand_over(self, device_type: str, drop: Callable[[], None]) -> int | None:
        """Release the lock before the process exits, when the device is clear: ``drop()`` lets go of every
        reference the probe holds (model, optimizer, batches, process group), then a full collection, and on CUDA
        a synchronize, cuBLAS's workspaces freed and ``empty_cache`` (as torch's own leak check does,
        ``torch.testing._internal.common_utils.CudaMemoryLeakCheck``). The workspaces matter: one per thread and
        stream (the backward runs on autograd's thread), each split from a cached block, keeps that block's whole
        segment reserved; the seventh H200 visit's residues matched the size of the logits' segment (GPT-2 fp32
        micro-batch 16: 3.45 GB, its logits 3.3 GB).

        Returns the bytes still reserved on CUDA; on the CPU, the bytes of the tensors still alive
        (:func:`live_tensor_bytes`: after a complete drop, only the model file's own module-level tensors); None
        elsewhere. The lock is released (the file saying ``handed``) when the CUDA bytes are at most
        :data:`HAND_OVER_RESIDUE_BYTES`, else kept until the process ends."""
        if self.fd is None:
            return None
        drop()
        gc.collect()
        residue: int | None = None
        if device_type == "cuda":
            import torch

            torch.cuda.synchronize()
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:  # cuBLAS's workspaces come from the allocator and pin the segment they split
                clear()
            torch.cuda.empty_cache()
            residue = int(torch.cuda.memory_reserved())
            if residue > HAND_OVER_RESIDUE_BYTES:
                return residue
        self._write_state(HANDED)
        self.release()
        if device_type == "cpu":  # nothing held back; what stayed alive says whether the drop was complete (after
            with contextlib.suppress(Exception):  # the release: a full traversal of the heap, about a second)
                residue = live_tensor_bytes("cpu")
        return residue

    def wait_for_previous_exit(self, timeout_s: float = PREVIOUS_EXIT_WAIT_S) -> float:
        """Wait (at most ``timeout_s``) until the previous holder's process is gone; the seconds waited (0.0 when it
        was, or when there is none)."""
        if self.previous_pid is None or self.previous_pid == os.getpid():
            return 0.0
        t0 = time.perf_counter()
        while process_alive(self.previous_pid) and time.perf_counter() - t0 < timeout_s:
            time.sleep(0.02)
        return round(time.perf_counter() - t0, 3)


def live_tensor_bytes(device_type: str) -> int:
    """Bytes of the distinct storages on ``device_type`` of every tensor the garbage collector tracks (a full
    traversal of ``gc.get_objects()``: about a second with torch and DeepSpeed imported)."""
    import torch

    sizes: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        try:
            if obj.device.type == device_type:
                storage = obj.untyped_storage()
                sizes[storage.data_ptr()] = storage.nbytes()
        except Exception:  # noqa: BLE001 - no storage (sparse, nested, a wrapper subclass): not counted
            continue
    return sum(sizes.values())


def _parse(text: str) -> tuple[int | None, bool]:
    """The previous holder's pid and whether it handed over, from the lock file's ``"<pid> <state>"``."""
    words = text.split()
    if not words or not words[0].isdigit():
        return None, False
    return int(words[0]), len(words) > 1 and words[1] == HANDED


def acquire(path: str, *, record: bool = True) -> DeviceLock:
    """Block until this process holds an exclusive ``flock`` on ``path`` (created when missing, mode 0600); read
    the previous holder's pid and state, then write this process's (``record``) or empty the file (``record=False``:
    a parent holding the lock around child processes that are gone when it releases it)."""
    t0 = time.perf_counter()
    fd = os.open(str(path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        previous = os.pread(fd, 64, 0).decode(errors="replace")
    except BaseException:
        os.close(fd)
        raise
    pid, handed = _parse(previous)
    lock = DeviceLock(path=str(path), fd=fd, wait_s=round(time.perf_counter() - t0, 3), acquired_at=time.time(),
                      previous_pid=pid, previous_handed=handed)
    lock._write_state(HOLDING if record else None)
    return lock


@contextlib.contextmanager
def held(path: str | os.PathLike[str] | None) -> Iterator[DeviceLock | None]:
    """The lock on ``path`` for the block, taken by this (parent) process around child processes: it waits for the
    previous holder to be gone first, and records no pid of its own (None: nothing)."""
    if path is None:
        yield None
        return
    lock = acquire(str(path), record=False)
    try:
        lock.wait_for_previous_exit()
        yield lock
    finally:
        lock.release()


def lock_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The lock file ``$OPTPLAN_DEVICE_LOCK`` names, else None."""
    value = (os.environ if environ is None else environ).get(DEVICE_LOCK_ENV, "").strip()
    return value or None


__all__ = ["DEVICE_LOCK_ENV", "HANDED", "HAND_OVER_RESIDUE_BYTES", "HOLDING", "PREVIOUS_EXIT_WAIT_S", "DeviceLock",
           "acquire", "held", "live_tensor_bytes", "lock_from_env", "process_alive"]
