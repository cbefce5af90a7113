"""Microbenchmarks of this machine: achieved matmul FLOP/s per dtype, device copy bandwidth and
all-reduce bus bandwidth across local devices, as a :class:`MicrobenchResult`.

The measuring happens in child processes (``probes/microbench_child.py``, stdlib + torch only; its
docstring states what is measured, the sizes, the byte-counting conventions and the timing): one plain
child for matmul and copy, then, for the all-reduce, ``python -m torch.distributed.run --standalone
--nproc-per-node N`` running the same module with ``--allreduce`` (gloo on CPU, NCCL on CUDA). Children
run with ``sys.executable`` in a new session; on timeout the whole process tree is killed (torchrun's
workers run in sessions of their own, so they are found by parentage and killed by id). Every failure
is a :class:`MicrobenchError` with a one-line message naming the problem and the fix.

:meth:`MicrobenchResult.ceilings` turns the result into the estimators' ``MeasuredCeilings``;
``optplan.estimators.ceilings.gpu_with_measured_ceilings`` replaces the datasheet ceilings with them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from optplan.estimators.ceilings import DTYPE_ORDER, MeasuredCeilings
from optplan.estimators.errors import OptplanError
from optplan.probes._pdeathsig import guarded
from optplan.probes.waiting import communicate_until

CHILD_MODULE = "optplan.probes.microbench_child"
ERROR_PREFIX = "microbench_child: error:"  # the child's last stderr line on failure (microbench_child.py)
_KILL_WAIT_S = 10.0
_MAX_TEXT = 300

Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def _one_line(text: object, limit: int = _MAX_TEXT) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class MicrobenchError(OptplanError):
    """A microbenchmark could not run or finish; ``str()`` is one line: the problem, then the fix.
    ``detail`` holds the child's stderr (tracebacks) for ``--debug``."""

    def __init__(self, problem: str, fix: str, *, detail: str = "") -> None:
        self.problem = _one_line(problem)
        self.fix = _one_line(fix)
        self.detail = detail
        super().__init__(f"{self.problem}: {self.fix}")


class MicrobenchResult(BaseModel):
    """What the microbenchmarks measured here (FLOP/s, bytes/s, seconds; microbench_child.py docstring).

    ``matmul_flops_per_s`` per dtype name (``fp32`` with TF32 off, ``tf32``, ``bf16``, ``fp16``,
    ``fp8``); a dtype the device cannot run is absent. ``copy_bytes_per_s`` counts read + write.
    ``allreduce_bus_bytes_per_s`` is nccl-tests' busbw at the largest size, None when not measured.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: Literal["cpu", "cuda"]
    device_name: str
    torch_version: str
    matmul_flops_per_s: dict[str, Positive]
    copy_bytes_per_s: Positive
    allreduce_bus_bytes_per_s: Positive | None = None
    allreduce_ranks: int = Field(default=0, ge=0)
    wall_s: float = Field(default=0.0, ge=0, description="wall time of all children, seconds")
    quick: bool = False
    matmul_size: dict[str, int] = Field(default_factory=dict, description="n of the n × n GEMMs per dtype")
    matmul_skipped: dict[str, str] = Field(default_factory=dict, description="dtype -> why it was left out")
    matmul_fast_accum_flops_per_s: dict[str, Positive] = Field(
        default_factory=dict, description="fp8's GEMM again with fast accumulation, as Transformer Engine runs its "
                                          "forward GEMMs (microbench_child.py); empty where fp8 did not run")
    copy_size_bytes: int = Field(default=0, ge=0, description="copied buffer, bytes (2× moved per copy)")
    allreduce_size_bytes: int = Field(default=0, ge=0, description="the size whose busbw is reported")
    allreduce_bus_bytes_per_s_by_size: dict[int, Positive] = Field(default_factory=dict,
                                                                   description="busbw per all-reduce size")
    unaligned_gemm_slowdown: dict[str, Positive] = Field(
        default_factory=dict, description="per dtype, a head's training GEMMs' time per FLOP with an odd vocabulary "
                                          "over a padded one (microbench_child.py)")
    unaligned_gemm_shape: dict[str, int] = Field(default_factory=dict, description="m, k, n (odd) and padded_n")
    unaligned_gemm_skipped: dict[str, str] = Field(default_factory=dict,
                                                   description="dtype -> why its unaligned GEMMs were not measured")
    attention_flops_per_s: dict[str, dict[int, dict[Literal["forward", "backward"], Positive]]] = Field(
        default_factory=dict, description="causal SDPA FLOP/s by backend (default, flash, cudnn), sequence "
                                          "length and pass, FlashAttention's counting (microbench_child.py)")
    attention_shape: dict[str, int | str] = Field(default_factory=dict,
                                                  description="heads, head_dim, tokens per call and dtype")
    attention_skipped: dict[str, str] = Field(default_factory=dict,
                                              description="backend -> why its attention was not measured")

    def attention_fractions(self, peak_flops: float) -> dict[str, dict[int, tuple[float, float]]]:
        """(forward, backward) fractions of ``peak_flops`` (the dense 16-bit peak, FLOP/s) by backend and sequence
        length: what estimators/data/attention_kernels.yaml tabulates."""
        return {name: {seq: (r["forward"] / peak_flops, r["backward"] / peak_flops) for seq, r in by_seq.items()}
                for name, by_seq in self.attention_flops_per_s.items()}

    def ceilings(self) -> MeasuredCeilings:
        """The figures as the estimators' :class:`MeasuredCeilings` (dtype names outside
        ``hardware.Dtype`` are dropped; ``source`` names the device and the run)."""
        matmul = {d: v for d, v in self.matmul_flops_per_s.items() if d in DTYPE_ORDER}
        unaligned = {d: v for d, v in self.unaligned_gemm_slowdown.items() if d in DTYPE_ORDER}
        where = f"optplan microbench on {self.device_name} ({self.device}, torch {self.torch_version}"
        where += ", quick" if self.quick else ""
        if self.allreduce_bus_bytes_per_s is not None:
            where += f", all-reduce over {self.allreduce_ranks} ranks"
        return MeasuredCeilings.model_validate({
            "matmul_flops_per_s": matmul, "copy_bytes_per_s": self.copy_bytes_per_s,
            "allreduce_bus_bytes_per_s": self.allreduce_bus_bytes_per_s, "unaligned_gemm_slowdown": unaligned,
            "source": where + ")"})


def child_command(out: str | os.PathLike[str], *, device: str, quick: bool, allreduce_nproc: int = 0) -> list[str]:
    """The command line of one microbenchmark child (``allreduce_nproc`` >= 2: under torchrun)."""
    tail = ["--out", str(out), "--device", device] + (["--quick"] if quick else [])
    if allreduce_nproc >= 2:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={allreduce_nproc}", "-m", CHILD_MODULE, "--allreduce", *tail]
    return [sys.executable, "-m", CHILD_MODULE, *tail]


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Linux /proc; empty elsewhere), children before grandchildren."""
    parents: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)": state ppid ...
        if len(fields) >= 2 and fields[1].isdigit():
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = parents.get(todo.pop(0), [])
        found.extend(kids)
        todo.extend(kids)
    return found


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the child's process group (it leads a new session) and every descendant by id; a
    descendant that leads a session of its own (torchrun's workers) is killed with its group."""
    below = _descendants(proc.pid)
    for pid in [proc.pid, *below]:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _failure_line(stderr: str) -> str:
    """The child's own error line when it printed one, else the last informative stderr line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        if ERROR_PREFIX in line:
            return line.split(ERROR_PREFIX, 1)[1].strip()
    for line in reversed(lines):
        if any(ch.isalnum() for ch in line):  # skip torchrun's ===== and ***** rules
            return line
    return ""


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def run_child(cmd: list[str], out: Path, *, what: str, timeout_s: float,
              env: Mapping[str, str] | None = None, limit_s: float | None = None,
              cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Run one child (new session, stdin closed) and return the JSON object it wrote to ``out``.

    ``timeout_s`` is the time this child may take; ``limit_s`` the user's whole limit, named in the
    timeout message (default ``timeout_s``).

    Raises :class:`MicrobenchError` on a timeout (after killing the process tree), a non-zero exit
    (with the child's last error line) or a missing/unreadable result.
    """
    shown = " ".join(cmd[1:])
    if timeout_s <= 0:
        raise MicrobenchError(f"no time left for the {what} within the {timeout_s if limit_s is None else limit_s:g} s limit",
                              "pass a larger timeout, or quick=True (--quick) for smaller sizes")
    try:
        proc = subprocess.Popen(guarded(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, errors="replace", start_new_session=True,
                                env=None if env is None else dict(env))
    except OSError as exc:
        raise MicrobenchError(f"could not start the {what} ({exc})", f"check that {cmd[0]} runs") from exc
    try:
        stdout, stderr = communicate_until(proc, timeout_s=timeout_s, cancelled=cancelled)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        try:
            stdout, stderr = proc.communicate(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", ""
        limit = timeout_s if limit_s is None else limit_s
        raise MicrobenchError(f"the {what} did not finish within the {limit:g} s limit and was killed",
                              "pass a larger timeout, or quick=True (--quick) for smaller sizes",
                              detail=stderr or "") from None
    except BaseException:  # KeyboardInterrupt or a cancel (Cancelled): leave nothing running
        _kill_tree(proc)
        proc.wait()
        raise
    if proc.returncode != 0:
        said = _failure_line(stderr)
        raise MicrobenchError(f"the {what} failed ({_exit_text(proc.returncode)})" + (f": {said}" if said else ""),
                              f"run `python {shown}` to see its full output", detail=stderr)
    try:
        doc = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MicrobenchError(f"the {what} exited cleanly but wrote no readable result to {out} ({exc})",
                              f"run `python {shown}` to see its output", detail=stderr + stdout) from None
    if not isinstance(doc, dict):
        raise MicrobenchError(f"the {what} wrote {type(doc).__name__}, not a JSON object",
                              "this is an optplan bug; please report it", detail=stderr)
    return doc


def _allreduce_ranks(requested: int | None, device: str, cuda_devices: int) -> int:
    """Processes for the all-reduce: None = every local GPU when there are several (else none)."""
    if requested is None:
        return cuda_devices if device == "cuda" and cuda_devices > 1 else 0
    if requested < 0:
        raise MicrobenchError(f"allreduce_nproc must be >= 0 (got {requested})",
                              "pass the number of local processes, or None for every local GPU")
    if requested < 2:
        return 0
    if device == "cuda" and requested > cuda_devices:
        raise MicrobenchError(f"allreduce_nproc={requested} but only {cuda_devices} CUDA device(s) are visible",
                              f"pass allreduce_nproc <= {cuda_devices}")
    return requested


RESULT_KEYS = ("device", "device_name", "torch_version", "matmul_flops_per_s", "copy_bytes_per_s", "quick",
               "matmul_size", "matmul_skipped", "matmul_fast_accum_flops_per_s", "copy_size_bytes", "unaligned_gemm_slowdown", "unaligned_gemm_shape",
               "unaligned_gemm_skipped", "attention_flops_per_s", "attention_shape", "attention_skipped")
ALLREDUCE_KEYS = ("allreduce_bus_bytes_per_s", "allreduce_ranks", "allreduce_size_bytes",
                  "allreduce_bus_bytes_per_s_by_size")


def run_microbench(*, device: Literal["auto", "cpu", "cuda"] = "auto", quick: bool = False,
                   allreduce_nproc: int | None = None, timeout_s: float = 300.0,
                   env: Mapping[str, str] | None = None,
                   cancelled: Callable[[], bool] | None = None) -> MicrobenchResult:
    """Measure this machine's ceilings in child processes (module docstring).

    ``device`` "auto" picks CUDA when torch sees a GPU. ``allreduce_nproc``: processes for the
    all-reduce; None = the number of local CUDA GPUs when there are more than one (else no all-reduce);
    0 or 1 = no all-reduce; on CPU pass 2 or more explicitly (gloo). ``timeout_s`` bounds all children
    together (seconds). ``env`` adds to (overrides) this process's environment for the children.
    ``cancelled`` is asked every ``POLL_S`` s: when it turns true the running child's tree is killed and
    :class:`~optplan.estimators.errors.Cancelled` raised.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise MicrobenchError(f"unknown device {device!r}", "use auto, cpu or cuda")
    if allreduce_nproc is not None:
        _allreduce_ranks(allreduce_nproc, "cpu", 0)  # reject a negative count before running anything
    started = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    child_env = {**os.environ, **(env or {}), "PYTHONSAFEPATH": "1"}  # no stray module from the working folder
    with tempfile.TemporaryDirectory(prefix="optplan-microbench-") as tmp:
        single_out = Path(tmp) / "matmul_copy.json"
        single = run_child(child_command(single_out, device=device, quick=quick), single_out,
                           what="matmul/copy microbenchmark", timeout_s=deadline - time.monotonic(),
                           env=child_env, limit_s=timeout_s, cancelled=cancelled)
        resolved = single.get("device")
        nproc = _allreduce_ranks(allreduce_nproc, str(resolved), int(single.get("cuda_device_count") or 0))
        merged = {k: single[k] for k in RESULT_KEYS if k in single}
        if nproc >= 2:
            ar_out = Path(tmp) / "allreduce.json"
            ar = run_child(child_command(ar_out, device=str(resolved), quick=quick, allreduce_nproc=nproc), ar_out,
                           what=f"all-reduce microbenchmark ({nproc} processes)",
                           timeout_s=deadline - time.monotonic(), env=child_env, limit_s=timeout_s,
                           cancelled=cancelled)
            merged.update({k: ar[k] for k in ALLREDUCE_KEYS if k in ar})
    merged["wall_s"] = time.perf_counter() - started
    try:
        return MicrobenchResult.model_validate(merged)
    except ValidationError as exc:
        raise MicrobenchError(f"the microbenchmark returned an invalid result: {_one_line(exc, 200)}",
                              "this is an optplan bug; please report it with the message above") from exc


__all__ = ["MicrobenchError", "MicrobenchResult", "child_command", "run_child", "run_microbench"]
