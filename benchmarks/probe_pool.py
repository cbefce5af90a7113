"""Probes run several at a time on one device, taking it in turn (the campaign's ``--jobs``).

A probe on a GPU visit spends most of its wall time before its first step: a fresh Python importing torch,
optplan's child, the model file (timm, transformers) and DeepSpeed. The visits' logs show 6-15 s of setup
for 0.5-3 s of steps (``ProbeResult.setup_s`` against ``wall_s``). So ``jobs`` probes start together and
each takes an exclusive ``flock`` on one lock file after its imports and before its first use of the device
(``ProbeSpec.device_lock``, probes/device_lock.py), holding it until its device memory is back with the driver
(handed over just before the exit): the imports overlap, and the next probe's context creation and build overlap
this one's teardown. No CUDA context is created outside the lock, and a holder waits for the previous one's process
to be gone before its first timed step and its memory figures, so every timed step, every
``max_memory_allocated`` and the non-torch bytes (driver total - free - reserved) are as when run alone.

A probe of several processes (torchrun) cannot take the lock in its ranks (they would wait on each other):
the pool holds the same lock around the whole probe instead. Profiles (fake-tensor child processes, CPU
only) run in a pool of their own ahead of the probes that need them.

``jobs=1`` runs everything in the caller's thread, in order, as before this module.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from optplan.estimators.profile import ModelProfile
from optplan.probes.device_lock import DEVICE_LOCK_ENV, lock_from_env
from optplan.probes.loader import profile_model_file
from optplan.probes.runtime import ProbeResult, ProbeSpec, run_probe

T = TypeVar("T")
U = TypeVar("U")

PROFILE_JOBS = 4
"""Profiles made at once when ``jobs`` > 1 (each a single-threaded fake-tensor child)."""


@dataclass(frozen=True)
class Profiled:
    """A model file's profile (None when profiling failed: ``error`` says why) and how long it took (s)."""

    profile: ModelProfile | None
    seconds: float
    error: str


ProfileKey = tuple[str, int | None, tuple[tuple[str, str], ...]]


def _profile_key(path: Path, seq_len: int | None, env: Mapping[str, str] | None) -> ProfileKey:
    return str(path), seq_len, tuple(sorted((env or {}).items()))


def _done(fn: Callable[[], T]) -> Future[T]:
    future: Future[T] = Future()
    try:
        future.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for the result
        future.set_exception(exc)
    return future


class ProbePool:
    """Runs probes ``jobs`` at a time sharing one device through ``folder/device.lock``.

    Use as a context manager; :meth:`submit` runs a callable on a worker (at once, in this thread, with
    ``jobs=1``), :meth:`run_probe` is what a worker calls to probe, :meth:`profile` makes (or returns the
    future of) a model file's profile."""

    def __init__(self, jobs: int, folder: Path) -> None:
        if jobs < 1:
            raise ValueError(f"jobs must be >= 1 (got {jobs})")
        self.jobs = jobs
        # the campaign's lock when its sections run at once (their probes share the device), else one of its own
        self.lock = Path(lock_from_env() or folder / "device.lock") if jobs > 1 else None
        self._probes = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="probe") if jobs > 1 else None
        self._profilers = (ThreadPoolExecutor(max_workers=PROFILE_JOBS, thread_name_prefix="profile")
                           if jobs > 1 else None)
        self._profiles: dict[ProfileKey, Future[Profiled]] = {}
        self._guard = threading.Lock()

    def __enter__(self) -> ProbePool:
        return self

    def __exit__(self, *exc: object) -> None:
        for pool in (self._probes, self._profilers):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` on a probe worker (``jobs=1``: now, in this thread)."""
        if self._probes is None:
            return _done(lambda: fn(*args))
        return self._probes.submit(fn, *args)

    def ordered(self, fn: Callable[[U], T], items: Sequence[U]) -> Iterator[T]:
        """``fn(item)`` for each item, yielded in the items' order: with ``jobs=1`` each computed when asked for
        (a caller that stops early starts no more), else all submitted to the probe workers now, by this call."""
        if self._probes is None:
            return (fn(item) for item in items)
        futures = [self._probes.submit(fn, item) for item in items]
        return (future.result() for future in futures)

    def profile(self, path: Path, seq_len: int | None, env: Mapping[str, str] | None = None) -> Future[Profiled]:
        """The future :class:`Profiled` of ``path``, started once per (path, seq_len, env) (``jobs=1``: made now)."""
        key = _profile_key(path, seq_len, env)

        def make() -> Profiled:
            t0 = time.perf_counter()
            try:
                return Profiled(profile_model_file(path, seq_len=seq_len, env=env), time.perf_counter() - t0, "")
            except Exception as exc:  # noqa: BLE001 - a model file that cannot be profiled is a result
                return Profiled(None, time.perf_counter() - t0, str(exc))

        with self._guard:
            if key not in self._profiles:
                self._profiles[key] = (_done(make) if self._profilers is None else self._profilers.submit(make))
            return self._profiles[key]

    def started_profile(self, path: Path, seq_len: int | None,
                        env: Mapping[str, str] | None = None) -> Future[Profiled] | None:
        """The future of ``path``'s profile if :meth:`profile` started it, else None."""
        with self._guard:
            return self._profiles.get(_profile_key(path, seq_len, env))

    def run_probe(self, spec: ProbeSpec, *, timeout_s: float, env: Mapping[str, str] | None = None) -> ProbeResult:
        """``run_probe(spec)`` taking the device in turn: a one-process probe waits in its child
        (``device_lock``), a multi-process one here around the whole run."""
        if self.lock is not None:  # run_probe takes it as the variable's: in the child, or here around torchrun
            env = {**(env or {}), DEVICE_LOCK_ENV: str(self.lock)}
        return run_probe(spec, timeout_s=timeout_s, env=env)
