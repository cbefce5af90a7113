"""A journal-file lock that a killed process cannot leave behind.

Optuna's default journal lock (``JournalFileSymlinkLock``) is a link file: a process killed while holding
it (SIGKILL, OOM killer, a lost node) leaves the link, and the next run waits its 30 s grace period before
breaking it. ``fcntl.flock`` locks belong to the open file description, so the kernel drops them when the
holder dies: a rerun after ``kill -9`` starts at once. Where ``fcntl`` does not exist (Windows) Optuna's
own lock is used.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from optuna.storages.journal import JournalFileSymlinkLock

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


def _hidden_beside(path: str, suffix: str) -> str:
    """``dir/.name<suffix>``: a lock file on the same filesystem as ``path`` (so it works on a shared one),
    hidden from listings of the output folder."""
    p = Path(path)
    return str(p.with_name(f".{p.name}{suffix}"))


class FlockJournalLock:
    """An exclusive ``flock`` on ``.<journal>.flock`` beside the journal (created on first use, never
    removed; flock works across the clients of an NFSv4 share, as Optuna's link lock does). It has the
    ``acquire``/``release`` interface ``JournalFileBackend(lock_obj=...)`` calls (Optuna's lock base class is
    not public)."""

    def __init__(self, journal_path: str, suffix: str = ".flock") -> None:
        self._path = _hidden_beside(journal_path, suffix)
        self._fd: int | None = None

    def acquire(self) -> bool:
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until free; freed by the kernel if the holder dies
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def journal_lock(journal_path: str) -> Any:
    """The lock optplan's journal files use: :class:`FlockJournalLock`, else Optuna's symlink lock."""
    return FlockJournalLock(journal_path) if fcntl is not None else JournalFileSymlinkLock(journal_path)


@contextlib.contextmanager
def storage_file_lock(storage: str | os.PathLike[str] | None, purpose: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``.<storage file>.<purpose>.flock`` for a block of several storage
    operations that must not interleave with another process's (e.g. "check what is recorded, then record").
    A no-op for in-memory studies, database URLs (no shared file) and where ``fcntl`` does not exist."""
    if storage is None or fcntl is None or "://" in str(storage):
        yield
        return
    lock = FlockJournalLock(str(Path(storage).resolve()), f".{purpose}.flock")
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def drop_torn_tail(journal_path: str) -> int:
    """Cut an incomplete last record off a journal file, under its lock; returns the bytes dropped.

    A process killed while appending leaves a line without its newline. Optuna skips such a line only
    while it is the last one: the next append would bury it mid-file and every later read would fail on
    it. The record was never complete, so nothing committed is lost."""
    path = Path(journal_path)
    if not path.is_file():
        return 0
    lock = journal_lock(journal_path)
    lock.acquire()
    try:
        with path.open("rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return 0
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return 0
            keep, pos, block = 0, size, 1 << 16
            while pos > 0:
                start = max(0, pos - block)
                f.seek(start)
                chunk = f.read(pos - start)
                cut = chunk.rfind(b"\n")
                if cut >= 0:
                    keep = start + cut + 1
                    break
                pos = start
            f.truncate(keep)
            return size - keep
    finally:
        lock.release()
