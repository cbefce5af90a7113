"""A quiet host for a probe's timed steps: the other processes of its group are stopped while it times.

Probes that share one GPU in turn (probes/device_lock.py) still share the host's CPUs: while one probe times its
steps, the next ones import torch, timm and DeepSpeed, and the campaign's profiles trace their models. A step paced
by the host (a small model's many kernel launches, DeepSpeed's Python around each step) is slowed by them: on the
seventh H200 visit host-paced steps were 12 % slower in median than on the sixth, up to 1.79x (ResNet-50 bf16
micro-batch 32: 29.5 against 18.7 ms), while device-bound steps read the same (ratio 1.000-1.009). The lock keeps
the *device* to one process; this module keeps the *host* to it for the few seconds that are timed.

A group is named by ``$OPTPLAN_QUIET_GROUP`` (:data:`QUIET_ENV`): a benchmark running probes together sets it once,
and every process it starts inherits it (probe children, profiles, pytest, torchrun and their workers). The lock's
holder, before its first timed step, sends ``SIGSTOP`` to every other process whose environment carries the same
group (Linux ``/proc/<pid>/environ``), except its own ancestors (the benchmark that waits on it) and its own
descendants, and ``SIGCONT`` to the same processes after its last timed or traced step (:func:`quieted`). The
stopped pids are written to a file first, so that the parent that kills a holder mid-way (a timeout) can continue
them (:func:`resume_recorded`). Nothing happens without the variable, off Linux, or for a process that may not
signal the others.

What it cannot quiet: the holder's ancestors (the benchmark's own threads), other users' processes, and a host
whose speed differs from visit to visit (the step records ``host_op_s``, :mod:`optplan.probes.host_speed`).

Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

QUIET_ENV = "OPTPLAN_QUIET_GROUP"
"""The environment variable naming a quiet group (any non-empty token; see the module docstring)."""


def group_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The group ``$OPTPLAN_QUIET_GROUP`` names, else None."""
    value = (os.environ if environ is None else environ).get(QUIET_ENV, "").strip()
    return value or None


def _parent(pid: int) -> int | None:
    """``pid``'s parent (from ``/proc/<pid>/stat``), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return int(fh.read().rsplit(")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def members(group: str) -> list[int]:
    """The processes whose environment (as they were started) has ``OPTPLAN_QUIET_GROUP=group``, zombies aside."""
    wanted = f"{QUIET_ENV}={group}".encode()
    found: list[int] = []
    for pid in _pids():
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


def _descendants(pid: int, candidates: list[int]) -> set[int]:
    """Those of ``candidates`` whose parent chain reaches ``pid``."""
    return {p for p in candidates if pid in _ancestors(p) and p != pid}


def others(group: str) -> list[int]:
    """The group's processes this one may stop: not itself, its ancestors or its descendants."""
    me = os.getpid()
    found = members(group)
    mine = _ancestors(me) | _descendants(me, found)
    return [p for p in found if p not in mine]


def _signal(pids: list[int], sig: signal.Signals) -> list[int]:
    """Send ``sig`` to each pid; the ones it reached."""
    reached: list[int] = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        reached.append(pid)
    return reached


def stop_others(group: str, record: str | os.PathLike[str] | None = None) -> list[int]:
    """``SIGSTOP`` the group's other processes (see :func:`others`); their pids, written first to ``record`` (one
    per line) so that whoever outlives this process can continue them. Nothing (``[]``) off Linux."""
    if not sys.platform.startswith("linux"):
        return []
    pids = others(group)
    if record is not None:
        with contextlib.suppress(OSError):
            Path(record).write_text("".join(f"{p}\n" for p in pids))
    return _signal(pids, signal.SIGSTOP)


def resume(pids: list[int], record: str | os.PathLike[str] | None = None) -> None:
    """``SIGCONT`` each pid, then remove ``record``."""
    _signal(pids, signal.SIGCONT)
    if record is not None:
        with contextlib.suppress(OSError):
            os.unlink(record)


def resume_recorded(record: str | os.PathLike[str]) -> int:
    """Continue the processes a holder recorded in ``record`` and did not continue itself (it was killed while
    they were stopped); how many were signalled. Nothing when the file is gone."""
    try:
        text = Path(record).read_text()
    except OSError:
        return 0
    pids = [int(word) for word in text.split() if word.isdigit()]
    reached = _signal(pids, signal.SIGCONT)
    with contextlib.suppress(OSError):
        os.unlink(record)
    return len(reached)


@contextlib.contextmanager
def quieted(group: str | None, record: str | os.PathLike[str] | None = None) -> Iterator[list[int]]:
    """The group's other processes stopped for the block (the stopped pids; ``[]`` without a group)."""
    pids = stop_others(group, record) if group else []
    try:
        yield pids
    finally:
        if group:
            resume(pids, record)


__all__ = ["QUIET_ENV", "group_from_env", "members", "others", "quieted", "resume", "resume_recorded",
           "stop_others"]
