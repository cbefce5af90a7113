"""One GPU shared by probes run together: an exclusive ``flock`` taken before a probe's first use of the device.

``ProbeSpec.device_lock`` names a lock file. The probe child (:mod:`optplan.probes.runtime_child`) imports the model
file first, then :func:`acquire` blocks until it holds the lock; from then on it alone uses the device. Its
imports overlapped with another probe's steps; its own device work (the CUDA context, the model on the device, every
timed step and every memory figure) overlaps with none. The kernel releases a ``flock`` when the process ends,
however it ends.

A probe that finished cleanly hands the device on before it exits (:meth:`DeviceLock.hand_over`): it drops what it
holds on the device, returns the allocator's cache to the driver, and releases the lock when less than
:data:`HAND_OVER_RESIDUE_BYTES` stays reserved. The next probe then creates its context and builds its model while
this one is still tearing down (the interpreter's finalization and the driver's context teardown; on the sixth H200
visit a probe's wall time exceeded its setup and steps by 1.2-1.4 s, and the child's ``timeline_s`` now tells how
much of that is teardown). A probe whose references
could not all be dropped (a framework's global state) keeps the lock to its exit, so the next probe never meets more
than a context's worth of another process's memory. The releasing probe writes its pid into the lock file, and the
next one waits for that process to exit before it reads its device-wide memory figure (the non-torch bytes:
:meth:`DeviceLock.wait_for_previous_exit`), which is otherwise the same as when it runs alone.

``OPTPLAN_DEVICE_LOCK`` (:data:`DEVICE_LOCK_ENV`): a lock file that every one-process probe optplan starts takes
when its spec names none (:func:`lock_from_env`), so that several optplan commands (``optplan validate --jobs``, a
benchmark's threads) share one GPU in turn.

Standard library only, plus torch inside :meth:`DeviceLock.hand_over` (already imported by the child).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

DEVICE_LOCK_ENV = "OPTPLAN_DEVICE_LOCK"
"""The environment variable naming a lock file one-process probes take by default (see the module docstring)."""

HAND_OVER_RESIDUE_BYTES = 256 * 2**20
"""Bytes the caching allocator may still reserve after a finished probe dropped its references and emptied the
cache, for the lock to be released before the process exits (bytes). Above it something still holds device
memory and the lock is kept to the exit."""


PREVIOUS_EXIT_WAIT_S = 10.0
"""How long a probe waits, before reading its device-wide memory figure, for the probe that handed it the device to
exit (s). That one's context (under a GiB) is on the device until it does; it usually has long before."""


@dataclass
class DeviceLock:
    """An exclusive ``flock`` held on ``path`` (``fd`` open while held); ``wait_s`` is how long taking it took (s),
    ``acquired_at`` when it was taken (Unix time, s), ``previous_pid`` the process that handed it over (its pid
    written into the file), if any."""

    path: str
    fd: int | None
    wait_s: float
    acquired_at: float
    previous_pid: int | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        """Release the lock now (closing the descriptor releases the ``flock``); nothing when already released."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def hand_over(self, device_type: str, drop: Callable[[], None]) -> int | None:
        """Release the lock before the process exits, when the device is clear: ``drop()`` lets go of every
        reference the probe holds (model, optimizer, batches), then a full collection, and on CUDA a synchronize
        and ``empty_cache``. Returns the bytes still reserved on CUDA (None on the CPU); the lock is released when
        they are at most :data:`HAND_OVER_RESIDUE_BYTES`, else kept until the process ends."""
        if self.fd is None:
            return None
        drop()
        gc.collect()
        residue: int | None = None
        if device_type == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            residue = int(torch.cuda.memory_reserved())
            if residue > HAND_OVER_RESIDUE_BYTES:
                return residue
        with contextlib.suppress(OSError):  # who still holds a context, for the next holder's memory figure
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        self.release()
        return residue

    def wait_for_previous_exit(self, timeout_s: float = PREVIOUS_EXIT_WAIT_S) -> float:
        """Wait (at most ``timeout_s``) until the process that handed this lock over has exited; the seconds
        waited (0.0 when it had, or when the lock was not handed over)."""
        if self.previous_pid is None or self.previous_pid == os.getpid():
            return 0.0
        t0 = time.perf_counter()
        while process_alive(self.previous_pid) and time.perf_counter() - t0 < timeout_s:
            time.sleep(0.02)
        return round(time.perf_counter() - t0, 3)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a zombie has released its memory and devices); from
    ``/proc`` on Linux, else from ``kill(pid, 0)``."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
                return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
        except FileNotFoundError:
            return False
        except (OSError, IndexError):
            pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


def acquire(path: str) -> DeviceLock:
    """Block until this process holds an exclusive ``flock`` on ``path`` (created when missing, mode 0600)."""
    t0 = time.perf_counter()
    fd = os.open(str(path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        previous = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except BaseException:
        os.close(fd)
        raise
    return DeviceLock(path=str(path), fd=fd, wait_s=round(time.perf_counter() - t0, 3), acquired_at=time.time(),
                      previous_pid=int(previous) if previous.isdigit() else None)


def lock_from_env(nproc: int, environ: Mapping[str, str] | None = None) -> str | None:
    """The lock file a probe of ``nproc`` processes takes when its spec names none: ``$OPTPLAN_DEVICE_LOCK`` for
    one process (ranks of one probe would wait on each other), else None."""
    value = (os.environ if environ is None else environ).get(DEVICE_LOCK_ENV, "").strip()
    return value if value and nproc == 1 else None


__all__ = ["DEVICE_LOCK_ENV", "HAND_OVER_RESIDUE_BYTES", "PREVIOUS_EXIT_WAIT_S", "DeviceLock", "acquire", "lock_from_env",
           "process_alive"]
