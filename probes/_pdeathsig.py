"""Children that die with optplan: ``python -m optplan.probes._pdeathsig PARENT_PID CMD [ARGS...]``.

Sets Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) and then execs ``CMD``: the
command (torchrun, a probe child, a microbenchmark, the profiler) keeps it across ``exec`` and is
SIGKILLed by the kernel when the optplan thread that started it dies, even by SIGKILL or the OOM
killer, when no ``finally`` runs. torchrun's workers set it themselves (``runtime_child``), so a whole
probe tree goes. Elsewhere than Linux the command just runs. This module imports nothing but the
standard library (it runs before the command, in every child).
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1
EXIT_PARENT_GONE = 70
"""Exit code when optplan died before the signal was armed (the command is not started)."""
GUARD_VAR = "OPTPLAN_GUARD_PID"
"""Set for the guarded command (its own pid, which ``exec`` keeps) and inherited by its descendants."""


def die_with_parent(parent: int | None = None) -> bool:
    """Arm SIGKILL-on-parent-death for this process (Linux); False when the parent (``parent``, default
    the current one) is already gone, so the caller should exit."""
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no libc prctl: best effort
            return True
    return os.getppid() == parent


def die_with_launcher() -> bool:
    """For a worker of the guarded command (torchrun's, the DeepSpeed launcher's): arm the signal on the
    current parent, and return False when the guarded launcher is already gone. A worker that arms late
    (after importing torch) may find its launcher killed before that; its parent is then some reaper,
    so the launcher's own liveness is checked. The guarded process itself was armed by :func:`main`."""
    armed = die_with_parent()
    guard = os.environ.get(GUARD_VAR, "")
    if guard.isdigit() and int(guard) != os.getpid() and not alive(int(guard)):
        return False
    return armed


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie, killed but not yet reaped (Linux ``/proc``;
    elsewhere: ``kill(pid, 0)`` succeeds)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def guarded(cmd: list[str]) -> list[str]:
    """``cmd`` started through this module, so that it dies with the calling process (Linux only)."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-m", __name__, str(os.getpid()), *cmd]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.stderr.write("usage: python -m optplan.probes._pdeathsig PARENT_PID CMD [ARGS...]\n")
        return 2
    if not die_with_parent(int(argv[0])):
        return EXIT_PARENT_GONE
    os.environ[GUARD_VAR] = str(os.getpid())
    os.execvp(argv[1], argv[1:])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
