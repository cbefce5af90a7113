"""Launching probe children: torchrun commands, environments, and killing a whole process tree.

Standard library only (no torch, no pydantic): the parent side of the runtime probe uses it.

* :func:`probe_command` is ``sys.executable -m optplan.probes.runtime_child --spec S --out O`` for one
  process, or the same module under ``python -m torch.distributed.run --standalone --nproc-per-node N``
  (:func:`torchrun_command`) for several: gloo on CPU, nccl on CUDA (the child picks the backend).
* :func:`child_env` adds what the child needs to the caller's environment: a marker variable
  (:data:`TOKEN_VAR`) that every descendant inherits, ``OMP_NUM_THREADS=1`` per CPU rank when more
  than one runs (unless set), unbuffered Python output, and ``TORCH_EXTENSIONS_DIR`` (DeepSpeed
  JIT-builds its CPU ops there; a persistent cache turns a ~94 s cold build into a ~14 s load).
* :func:`launch` starts the command in a new session, its output in a log file.
* :func:`terminate_tree` ends the child's process group and every process that carries the marker,
  SIGTERM first and SIGKILL after a grace period. torchrun starts each worker in a session of its own,
  so the process group alone would miss them; the marker (read from ``/proc/PID/environ`` on Linux)
  finds them wherever they are. The child also asks Linux to kill it when its parent dies
  (``PR_SET_PDEATHSIG``), so a killed torchrun does not leave workers behind.
* :func:`parse_torchrun_root_cause` reads torchrun's failure summary ("Root Cause (first observed
  failure)": rank and exit code), and :func:`describe_exit` turns an exit code into words
  ("code -11 (SIGSEGV)").
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from optplan.probes._pdeathsig import alive, guarded

CHILD_MODULE = "optplan.probes.runtime_child"
TOKEN_VAR = "OPTPLAN_PROBE_TOKEN"
"""Environment variable carrying a per-probe random token; every descendant of the child inherits it."""
EXTENSIONS_VAR = "TORCH_EXTENSIONS_DIR"
MONITOR_INTERVAL_S = 0.1
"""How often torchrun checks its workers (seconds): a failed rank stops the others within about this."""


def default_extensions_dir(env: Mapping[str, str] | None = None) -> str:
    """The torch extensions cache optplan uses when the caller sets none:
    ``$XDG_CACHE_HOME/optplan/torch_extensions`` (``~/.cache/optplan/torch_extensions`` by default)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "optplan" / "torch_extensions")


def torchrun_command(nproc: int, module: str, args: Sequence[str], *, python: str | None = None,
                     monitor_interval_s: float = MONITOR_INTERVAL_S) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m MODULE ARGS...`` (one node;
    ``--standalone`` picks a free rendezvous port, so several probes may run at once)."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1 (got {nproc})")
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(int(nproc)), "--max-restarts", "0",
            "--monitor-interval", f"{monitor_interval_s:g}", "-m", module, *args]


def probe_command(spec_path: str | os.PathLike[str], out_path: str | os.PathLike[str], nproc: int = 1, *,
                  python: str | None = None, accelerate_config: str | None = None,
                  device: str = "cuda") -> list[str]:
    """The command that runs the probe child: directly for one process, under torchrun for more, or
    under ``accelerate launch --config_file F`` (accelerate's own launcher reads the exported config; the
    process count and a single machine are given on its command line, which overrides the file)."""
    args = ["--spec", str(spec_path), "--out", str(out_path)]
    if accelerate_config is not None:
        cmd = [python or sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_config,
               "--num_processes", str(nproc), "--num_machines", "1", "--machine_rank", "0",
               "--main_process_port", str(_free_port())]
        if device == "cpu":
            cmd.append("--cpu")
        return [*cmd, "-m", CHILD_MODULE, *args]
    if nproc == 1:
        return [python or sys.executable, "-m", CHILD_MODULE, *args]
    return torchrun_command(nproc, CHILD_MODULE, args, python=python)


def _free_port() -> int:
    """A TCP port free on this host now (for a rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(base: Mapping[str, str] | None, *, device: str, nproc: int, token: str,
              extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ``base`` (``os.environ`` when None) updated with ``extra``, plus the
    marker token, ``PYTHONSAFEPATH=1`` (Python >= 3.11: the working folder is not put on ``sys.path``, so
    no stray module or ``optplan/`` folder there is imported), ``PYTHONUNBUFFERED=1``, ``TORCH_EXTENSIONS_DIR`` (:func:`default_extensions_dir` unless
    set) and ``OMP_NUM_THREADS=1`` for several CPU ranks (unless set)."""
    env = dict(os.environ if base is None else base)
    if extra:
        env.update({str(k): str(v) for k, v in extra.items()})
    env[TOKEN_VAR] = token
    env["PYTHONSAFEPATH"] = "1"  # python -m must not put the working folder on sys.path (a stray numpy.py)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault(EXTENSIONS_VAR, default_extensions_dir(env))
    if device == "cpu" and nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch(cmd: Sequence[str], env: Mapping[str, str], log_path: str | os.PathLike[str],
           cwd: str | os.PathLike[str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new session (its own process group) with stdout and stderr in ``log_path``; it is
    SIGKILLed by the kernel if this process dies first (``_pdeathsig``: no orphan holds a GPU)."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(guarded(list(cmd)), env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd)


# ---------------------------------------------------------------------------------------------------
# finding and ending processes
# ---------------------------------------------------------------------------------------------------
def processes_with_env(assignment: str) -> list[int]:
    """Live processes (not zombies, not this one) whose environment holds ``assignment`` ("NAME=value"),
    e.g. the token every process of a probe inherits (Linux ``/proc``; [] elsewhere)."""
    needle = assignment.encode()
    found: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    me = os.getpid()
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            data = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in data.split(b"\0") and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def marked_processes(token: str) -> list[int]:
    """Live processes (not zombies) whose environment holds ``TOKEN_VAR=token`` (Linux ``/proc``; [] elsewhere)."""
    return processes_with_env(f"{TOKEN_VAR}={token}")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pids(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def terminate_tree(proc: subprocess.Popen[bytes], token: str, *, grace_s: float = 3.0) -> None:
    """End ``proc``'s process group and every process carrying ``token``: SIGTERM, then after
    ``grace_s`` seconds SIGKILL; reaps ``proc``. Safe to call when everything has already exited."""
    # the group is signalled only while its leader is not reaped (its id cannot be reused before that);
    # on Linux the marker finds every descendant anyway
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
    _signal_pids(marked_processes(token), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not marked_processes(token):
            break
        time.sleep(0.05)
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGKILL)
    for _ in range(50):  # SIGKILL until none is left (a dying torchrun may still be starting one)
        left = marked_processes(token)
        if not left:
            break
        _signal_pids(left, signal.SIGKILL)
        time.sleep(0.02)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process stuck in the kernel
        pass


# ---------------------------------------------------------------------------------------------------
# reading what happened
# ---------------------------------------------------------------------------------------------------
def signal_name(signum: int) -> str:
    """``"SIGSEGV"`` for 11, ``"signal 99"`` for unknown numbers."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(code: int) -> str:
    """``"code 3"``, or ``"code -11 (SIGSEGV)"`` for a process killed by a signal; SIGKILL, which no process sends
    itself and Linux's out-of-memory killer sends to the largest process when the host runs out of memory, says so."""
    if code == -signal.SIGKILL:
        return (f"code {code} ({signal_name(-code)}), killed from outside: on Linux most often by the out-of-memory "
                "killer when host memory runs out (dmesg names it)")
    return f"code {code} ({signal_name(-code)})" if code < 0 else f"code {code}"


_ROOT = re.compile(r"Root Cause \(first observed failure\):(?P<body>.*?)(?:={5,}|\Z)", re.S)
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.M)
_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.M)
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def parse_torchrun_failures(text: str) -> dict[int, int]:
    """Every failed worker's exit code by rank from torchrun's summary (``Failures`` and ``Root Cause``
    blocks), plus its ``failed (exitcode: C) local_rank: R`` log lines; {} when there are none."""
    found: dict[int, int] = {}
    for m in _FAILED.finditer(text):
        found[int(m.group(2))] = int(m.group(1))
    start = text.rfind("Failures:")
    if start >= 0:
        for block in re.split(r"^\s*\[\d+\]:\s*$", text[start:], flags=re.M)[1:]:
            rank, code = _RANK.search(block), _CODE.search(block)
            if rank and code:
                found[int(rank.group(1))] = int(code.group(1))
    return found


def parse_torchrun_root_cause(text: str) -> tuple[int, int] | None:
    """(rank, exit code) of the first failed worker from torchrun's output, or None when absent.

    Reads the ``Root Cause (first observed failure)`` block of torchrun's ChildFailedError summary,
    else its ``failed (exitcode: C) local_rank: R`` log line (single node: local rank = rank).
    """
    m = _ROOT.search(text)
    if m:
        rank, code = _RANK.search(m.group("body")), _CODE.search(m.group("body"))
        if rank and code:
            return int(rank.group(1)), int(code.group(1))
    m2 = _FAILED.search(text)
    if m2:
        return int(m2.group(2)), int(m2.group(1))
    return None


def read_tail(path: str | os.PathLike[str], *, lines: int = 20, max_chars: int = 4000) -> str:
    """The last ``lines`` lines of a log file, at most ``max_chars`` characters ("" when unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 65536))
            data = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    text = "\n".join(data.splitlines()[-lines:])
    return text[-max_chars:]


def last_meaningful_line(text: str) -> str:
    """The last non-blank line of ``text`` that is not part of a torchrun failure banner."""
    for line in reversed(text.splitlines()):
        s = line.strip()
        if (s and not set(s) <= set("=-*")
                and not s.startswith(("time ", "host ", "error_file", "traceback ", "Extension modules:"))):
            return s
    return ""


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)


def crash_location(text: str) -> str:
    """Where a fatal signal hit, from ``faulthandler``'s dump in ``text`` ("/path/model.py line 9 in
    forward"; the innermost frame of the crashing thread), or "" when there is no dump."""
    start = text.rfind("Current thread")
    if start < 0:
        start = text.rfind("Fatal Python error")
        if start < 0:
            return ""
    m = _FRAME.search(text, start)
    return f"{m.group('file')} line {m.group('line')} in {m.group('func')}" if m else ""
