"""A quiet host for a probe's timed steps: the other processes of its group are stopped while it times.

Probes that share one GPU in turn (probes/device_lock.py) still share the host's CPUs: while one probe times its
steps, the next ones import torch, timm and DeepSpeed, and the campaign's profiles trace their models. A step paced
by the host (a small model's many kernel launches, DeepSpeed's Python around each step) is slowed by them: on the
seventh H200 visit host-paced steps were 12 % slower in median than on the sixth, up to 1.79x (ResNet-50 bf16
micro-batch 32: 29.5 against 18.7 ms), while device-bound steps read the same (ratio 1.000-1.009). The lock keeps
the *device* to one process; this module keeps the *host* to it for the few seconds that are timed.

A group is a folder, named by ``$OPTPLAN_QUIET_GROUP`` (:data:`QUIET_ENV`), that its owner creates and watches
(:func:`owned_group`: a benchmark running probes together, ``optplan validate --jobs``). Every process the owner
starts inherits the variable (probe children, profiles, pytest, torchrun and their workers) and is a member
(Linux ``/proc/<pid>/environ``, the environment it was started with). The lock's holder, before its first timed
step:

1. writes the pids it is about to stop into ``<group>/<its pid>.stopped`` (the record);
2. sends ``SIGSTOP`` to every other member except its own ancestors (the owner that waits on it), its own
   descendants and the previous holder of the lock (still tearing down its CUDA context: frozen, it would stay in
   the device-wide memory figures) (:func:`stop_others`);
3. looks once more a few milliseconds later, for a member that was being started meanwhile (:func:`stop_newcomers`);
4. sends ``SIGCONT`` to all of them after its last timed or traced step and removes its record (:func:`resume`).

Whoever starts members waits while a live record exists (:func:`wait_while_quiet`: no import begins during
another's timed steps), and the owner continues what a record holds once its holder is gone or the record is older
than :data:`QUIET_MAX_S` (a holder killed mid-way, or hung in a step) (:func:`resume_stale`), and every member at the
end. Nothing happens without the variable, off Linux, or for a process that may not signal the others.

What it cannot quiet: the owner's own threads, other users' processes, and a host whose speed differs from visit to
visit (each probe records ``host_op_s``, probes/host_speed.py).

Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

QUIET_ENV = "OPTPLAN_QUIET_GROUP"
"""The environment variable naming a quiet group: the group's folder (see the module docstring)."""

QUIET_MAX_S = 30.0
"""Longest a holder keeps its group stopped (s): after it the owner continues them whatever the holder does. The
campaign's longest timed window (five Llama-3 1B fp32 steps with full checkpointing, 0.83 s each, and two traced
steps) is under 10 s."""

WATCH_S = 0.5
"""How often the owner looks for stale records (s)."""

RECORD = ".stopped"
"""A record's file name ending: ``<holder pid>.stopped``."""


def group_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The group ``$OPTPLAN_QUIET_GROUP`` names, else None."""
    value = (os.environ if environ is None else environ).get(QUIET_ENV, "").strip()
    return value or None


def _linux() -> bool:
    return sys.platform.startswith("linux")


def _parent(pid: int) -> int | None:
    """``pid``'s parent (from ``/proc/<pid>/stat``), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return int(fh.read().rsplit(")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def members(group: str) -> list[int]:
    """The processes started with ``OPTPLAN_QUIET_GROUP=group`` in their environment, zombies aside."""
    wanted = f"{QUIET_ENV}={group}".encode()
    found: list[int] = []
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:  # gone, or another user's
            continue
        if wanted in environ.split(b"\0"):
            found.append(pid)
    return found


def _ancestors(pid: int) -> set[int]:
    seen: set[int] = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        parent = _parent(pid)
        if parent is None:
            break
        pid = parent
    return seen


def others(group: str, spare: Collection[int] = ()) -> list[int]:
    """The group's processes this one may stop: not itself, its ancestors, its descendants, nor ``spare``."""
    me = os.getpid()
    found = members(group)
    mine = _ancestors(me) | {p for p in found if me in _ancestors(p)}
    return [p for p in found if p not in mine and p not in spare]


def _signal(pids: Collection[int], sig: signal.Signals) -> list[int]:
    """Send ``sig`` to each pid; the ones it reached."""
    reached: list[int] = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        reached.append(pid)
    return reached


def record_path(group: str, pid: int | None = None) -> Path:
    """Where holder ``pid`` (default: this process) records the pids it stopped."""
    return Path(group) / f"{os.getpid() if pid is None else pid}{RECORD}"


def _write_record(group: str, pids: Collection[int]) -> None:
    with contextlib.suppress(OSError):
        path = record_path(group)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(f"{p}\n" for p in sorted(pids)))
        os.replace(tmp, path)


def stop_others(group: str, spare: Collection[int] = ()) -> list[int]:
    """``SIGSTOP`` the group's other processes (:func:`others`), recorded first (module docstring); the pids
    stopped. Nothing (``[]``) off Linux."""
    if not _linux():
        return []
    pids = others(group, spare)
    _write_record(group, pids)
    return _signal(pids, signal.SIGSTOP)


def stop_newcomers(group: str, stopped: list[int], spare: Collection[int] = ()) -> list[int]:
    """Stop the members :func:`stop_others` did not see (started meanwhile); ``stopped`` with them."""
    if not _linux():
        return list(stopped)
    new = [p for p in others(group, spare) if p not in stopped]
    if not new:
        return list(stopped)
    _write_record(group, [*stopped, *new])
    return [*stopped, *_signal(new, signal.SIGSTOP)]


def resume(group: str, pids: Collection[int]) -> None:
    """``SIGCONT`` each pid, then remove this holder's record."""
    _signal(pids, signal.SIGCONT)
    with contextlib.suppress(OSError):
        record_path(group).unlink()


def _records(group: str) -> list[tuple[Path, int, float]]:
    """(record, holder pid, age in s) of every record in the group's folder."""
    found = []
    now = time.time()
    with contextlib.suppress(OSError):
        for path in Path(group).glob(f"*{RECORD}"):
            holder = path.name[: -len(RECORD)]
            with contextlib.suppress(OSError, ValueError):
                found.append((path, int(holder), now - path.stat().st_mtime))
    return found


def resume_stale(group: str, max_age_s: float = QUIET_MAX_S) -> int:
    """Continue the processes of every record whose holder is gone or that is older than ``max_age_s``, and remove
    the record; how many processes were signalled."""
    signalled = 0
    for path, holder, age in _records(group):
        if _alive(holder) and age <= max_age_s:
            continue
        try:
            pids = [int(word) for word in path.read_text().split() if word.isdigit()]
        except OSError:
            continue
        signalled += len(_signal(pids, signal.SIGCONT))
        with contextlib.suppress(OSError):
            path.unlink()
    return signalled


def wait_while_quiet(group: str | None, max_wait_s: float = QUIET_MAX_S) -> float:
    """Before starting a member: wait while a live holder keeps the group stopped (at most ``max_wait_s``); the
    seconds waited."""
    if not group or not _linux():
        return 0.0
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_wait_s and any(
            _alive(holder) and age <= QUIET_MAX_S for _, holder, age in _records(group)):
        time.sleep(0.02)
    return round(time.monotonic() - t0, 3)


@contextlib.contextmanager
def owned_group(folder: str | os.PathLike[str]) -> Iterator[str]:
    """A new quiet group in ``folder`` (created) for the block, watched: every :data:`WATCH_S` the stale records are
    continued (:func:`resume_stale`); at the end every record and every member. Yields the group (the value for
    ``$OPTPLAN_QUIET_GROUP``)."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    group = str(path.resolve())
    done = threading.Event()

    def watch() -> None:
        while not done.wait(WATCH_S):
            resume_stale(group)

    watcher = threading.Thread(target=watch, name="quiet-group-watch", daemon=True)
    watcher.start()
    try:
        yield group
    finally:
        done.set()
        watcher.join()
        resume_stale(group, max_age_s=-1.0)
        _signal(members(group), signal.SIGCONT)


__all__ = ["QUIET_ENV", "QUIET_MAX_S", "group_from_env", "members", "others", "owned_group", "record_path", "resume",
           "resume_stale", "stop_newcomers", "stop_others", "wait_while_quiet"]
