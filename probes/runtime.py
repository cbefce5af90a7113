"""Runtime probe, parent side: short real training runs of a user's model under one Strategy.

:func:`run_probe` writes the :class:`ProbeSpec` as JSON into a temporary directory and runs
``python -m optplan.probes.runtime_child`` (one process) or the same under torchrun (``nproc`` > 1; gloo
on CPU, nccl on CUDA) in a new session, then reads the per-rank result files and merges them into one
:class:`ProbeResult` (step times and memory peaks: the maximum over ranks; status: the first failure).
It never raises for what the child does: a crash, a hang (killed after ``timeout_s`` with its whole
process tree), an out-of-memory, a NaN loss or a broken model file all come back as a result with a
status and a one-line reason. What the child measures, and how, is described in
:mod:`optplan.probes.runtime_child`.

The child imports only torch (and deepspeed / bitsandbytes when the strategy needs them), so the probe
runs in a bare training environment: ``env`` and the Python executable are the caller's.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from optplan.estimators.strategy import Strategy
from optplan.probes.device_lock import held, lock_from_env
from optplan.probes.distributed import (
    child_env,
    crash_location,
    describe_exit,
    last_meaningful_line,
    launch,
    parse_torchrun_failures,
    parse_torchrun_root_cause,
    probe_command,
    read_tail,
    terminate_tree,
)
from optplan.probes.host_quiet import group_from_env, resume_stale, wait_while_quiet
from optplan.probes.model_errors import one_line
from optplan.probes.waiting import communicate_until

ProbeStatus = Literal["ok", "oom", "nan", "timeout", "error", "pruned"]

DATA_PARALLEL_ONLY = "the probe runs data-parallel strategies only (tp/pp/cp = 1, engines torch and deepspeed)"
FP8_REFUSED = ("fp8 needs Transformer Engine / torchao fp8 layers, which the probe does not emulate: probe "
               "with precision bf16 (fp8 keeps bf16 weights and fp32 master states)")
_FAILURES = ("error", "oom", "nan")


class ProbeSpec(BaseModel):
    """What to run: the model file, one Strategy, the device, the number of processes and steps.

    Serialised to JSON for the child (the strategy as ``model_dump(mode="json")``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    model_name: str | None = None
    seq_len: int | None = Field(default=None, ge=1, description="tokens per sample for example_batch / the token batch")
    strategy: Strategy
    block_class: str | None = Field(
        default=None, description="class name of the repeated block (profile.repeated_block.class_name): "
                                  "the checkpointing and FSDP wrapping units")
    ds_config: dict[str, Any] | None = Field(
        default=None, description="required when strategy.engine == 'deepspeed'; passed as-is to deepspeed.initialize")
    device: Literal["cpu", "cuda"] = "cpu"
    nproc: int = Field(default=1, ge=1, description="processes; > 1 launches torchrun (gloo on cpu, nccl on cuda)")
    warmup_steps: int = Field(default=2, ge=0, description="untimed optimizer steps before the timed ones")
    timed_steps: int = Field(default=5, ge=1, description="timed optimizer steps")
    memory_cap_bytes: int | None = Field(
        default=None, gt=0, description="cpu: live tensor bytes above which the step counts as 'oom' (bytes); "
                                        "cuda: per-process memory fraction cap/total")
    stop_if_step_slower_than_s: float | None = Field(
        default=None, gt=0, description="pruning: stop with status 'pruned' when the first timed step takes longer (s)")
    compile: bool = Field(default=False, description="torch.compile the model (engine.compile() under DeepSpeed)")
    trace_steps: int = Field(default=0, ge=0, description="extra optimizer steps after the timed ones under "
                                                          "torch.profiler (probes/step_trace.py); 0: none")
    seed: int = 0
    accelerate_config: str | None = Field(
        default=None, description="an accelerate.yaml: start the child with `accelerate launch --config_file` and "
                                  "prepare model and optimizer with accelerate.Accelerator (optplan validate)")
    device_lock: str | None = Field(
        default=None, description="a lock file (POSIX flock) the child takes exclusively after importing the model "
                                  "file and before its first use of the device, held to its end: probes run "
                                  "concurrently share one GPU in turn (one process only; the campaign's --jobs)")

    @model_validator(mode="after")
    def _check(self) -> ProbeSpec:
        if self.strategy.engine == "deepspeed" and self.ds_config is None:
            raise ValueError("strategy.engine is deepspeed: pass ds_config (the dict for deepspeed.initialize)")
        if self.device_lock is not None and self.nproc != 1:
            raise ValueError("device_lock is for one-process probes (the ranks of one probe would wait on each "
                             "other): hold the lock around the whole probe instead")
        return self


class ProbeResult(BaseModel):
    """What one probe measured; times in seconds, memory in bytes. Never partial in meaning: a field
    the probe could not measure is None / empty."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: ProbeSpec
    status: ProbeStatus
    reason: str = Field(default="", description="one readable line; empty when ok")
    device_name: str = ""
    torch_version: str = ""
    world_size: int = 1
    step_times_s: tuple[float, ...] = Field(
        default=(), description="timed steps (one optimizer step = grad_accum micro-batches each), max over ranks (s)")
    step_s: float | None = Field(default=None, gt=0, description="median of step_times_s (s)")
    step_spread_s: float | None = Field(default=None, ge=0, description="max - min of step_times_s (s)")
    peak_allocated_bytes: int | None = Field(
        default=None, ge=0, description="cuda: torch.cuda.max_memory_allocated over the run (max over ranks); cpu: peak "
                                  "live tensor bytes of one tracked step incl. params/grads/optimizer states (bytes)")
    peak_reserved_bytes: int | None = Field(default=None, ge=0, description="cuda: max_memory_reserved (bytes); cpu: None")
    non_torch_bytes: int | None = Field(
        default=None, description="cuda: (total - free) - memory_reserved at the end: CUDA context, NCCL, cuBLAS "
                                  "workspace outside the allocator (bytes); cpu: None")
    peak_by_category_bytes: dict[str, int] = Field(
        default_factory=dict, description="cpu: live bytes per category at the peak (param, grad, master, optimizer, "
                                          "activation, buffer, input, other) of the rank with the highest peak")
    losses: tuple[float, ...] = Field(default=(), description="loss of every warm-up and timed step (rank 0)")
    samples_per_step: int = Field(default=0, description="mbs * grad_accum * world_size (data-parallel)")
    wall_s: float = Field(default=0.0, description="wall time of the whole probe, launch to merge (s)")
    tail: str = Field(default="", description="last ~20 lines of the child's output, for --debug")
    # additions
    notes: tuple[str, ...] = Field(default=(), description="what the probe did differently from the plan, and why")
    failed_rank: int | None = Field(default=None, description="the rank whose failure decided the status")
    exit_code: int | None = Field(default=None, description="the child's (torchrun's) exit code; negative: a signal")
    step_trace: dict[str, Any] | None = Field(
        default=None, description="rank 0's traced steps (spec.trace_steps): seconds per step by category "
                                  "(time_by_category_s), busy_s, step_wall_s, kernels per step (probes/step_trace.py)")
    setup_s: float | None = Field(default=None, description="child start to the first step: imports, model build, "
                                                            "wrapping, deepspeed.initialize (s, max over ranks)")
    device_wait_s: float | None = Field(default=None, description="spec.device_lock: time spent waiting for the "
                                                                  "lock, inside setup_s (s)")
    device_acquired_at: float | None = Field(default=None, description="spec.device_lock: when the child took the "
                                                                       "lock (Unix time, s)")
    checkpointing_applied: str | None = Field(default=None, description="checkpointing the child applied "
                                                                        "(none/selective/full)")
    timeline_s: dict[str, float] = Field(
        default_factory=dict, description="rank 0's marks, seconds since its process started: imported (model file "
                                          "and engine), device_acquired (spec.device_lock), device_ready, built, "
                                          "set_up, first_step, stepped, measured, traced, resumed (the quiet group "
                                          "continued), released (the device lock "
                                          "handed over before the exit), exited (seen by the parent) (s)")
    device_handed_over: bool | None = Field(
        default=None, description="spec.device_lock: whether the child released the lock before exiting, its device "
                                  "memory returned (probes/device_lock.py); False: it kept the lock to its exit "
                                  "(memory left reserved); None: no hand-over was tried (no lock, or a failed run)")
    previous_exit_wait_s: float | None = Field(
        default=None, description="spec.device_lock: time spent waiting for the previous holder's process to be gone "
                                  "(before first touching the device when it kept the lock to its exit, before the "
                                  "first timed step and before the memory figures) (s)")
    cuda_initialized_before_lock: bool | None = Field(
        default=None, description="cuda, spec.device_lock: whether torch had initialised CUDA before the lock was "
                                  "taken (it must not: another probe's figures would count this context)")
    device_residue_bytes: int | None = Field(
        default=None, description="spec.device_lock: on CUDA, bytes the allocator still reserved when the child let go "
                                  "of its model and emptied the cache, before the hand-over; on the CPU, bytes of "
                                  "the tensors still alive then (a complete drop leaves next to none) (bytes)")
    host_op_s: float | None = Field(
        default=None, description="host seconds to issue one tiny eager operator on the probe's device, measured just "
                                  "before the first timed step (probes/host_speed.py): the host's speed for these "
                                  "step times (s per operator)")
    quieted_processes: int | None = Field(
        default=None, description="spec.device_lock with $OPTPLAN_QUIET_GROUP: other processes of the group stopped "
                                  "while this probe timed its steps (probes/host_quiet.py); None: none were asked to")

    @property
    def ok(self) -> bool:
        """True when the probe ran all its steps (status "ok")."""
        return self.status == "ok"


# ---------------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------------
def _preflight(spec: ProbeSpec) -> str | None:
    """A reason to refuse the spec without starting a child, else None."""
    s = spec.strategy
    if s.model_parallel or s.engine == "megatron":
        return DATA_PARALLEL_ONLY
    if s.precision == "fp8":
        return FP8_REFUSED
    return None


def run_probe(spec: ProbeSpec, *, timeout_s: float = 300.0, env: Mapping[str, str] | None = None,
              cancelled: Callable[[], bool] | None = None) -> ProbeResult:
    """Run ``spec`` in a child process (torchrun for ``nproc`` > 1) and return what it measured.

    ``timeout_s``: wall-clock limit of the whole child (s), less the time it waits for a device lock; past it
    every process of the probe is killed and the status is "timeout". ``env``: extra environment variables for
    the child, on top of ``os.environ`` (``TORCH_EXTENSIONS_DIR`` defaults to
    ``~/.cache/optplan/torch_extensions``).

    ``$OPTPLAN_DEVICE_LOCK`` (in ``os.environ`` or ``env``), when ``spec`` names no ``device_lock``: a one-process
    probe's child takes that lock; for a probe of several processes this process holds it around the whole run
    (probes/device_lock.py).

    ``cancelled``: asked every ``POLL_S`` s while the child runs; when it turns true every process of
    the probe is stopped (within about a second) and :class:`~optplan.estimators.errors.Cancelled` is raised.

    Never raises for anything the child does (crash, hang, OOM, NaN, bad model file): returns a
    ProbeResult with the status and a one-line reason.
    """
    started = time.perf_counter()
    lock = lock_from_env({**os.environ, **(env or {})}) if spec.device_lock is None else None
    if lock is not None and spec.nproc == 1:  # $OPTPLAN_DEVICE_LOCK: the child takes it after its imports
        spec = spec.model_copy(update={"device_lock": lock})
        lock = None
    base = {"spec": spec, "world_size": spec.nproc,
            "samples_per_step": spec.strategy.mbs * spec.strategy.grad_accum * spec.nproc}
    refused = _preflight(spec)
    if refused:
        return ProbeResult(**base, status="error", reason=refused, wall_s=round(time.perf_counter() - started, 3))
    with held(lock):  # several processes: the whole run holds the device
        return _run_child(spec, base, started, timeout_s, env, cancelled)


def _lock_wait_s(out_path: Path) -> float:
    """Seconds the child has waited for its device lock so far (from its ``.waiting`` marker to its ``.acquired``
    marker, or to now), 0.0 before it began waiting or without a lock."""
    try:
        waiting = Path(f"{out_path}.waiting").stat().st_mtime
    except OSError:
        return 0.0
    try:
        acquired = Path(f"{out_path}.acquired").stat().st_mtime
    except OSError:
        acquired = time.time()
    return max(0.0, acquired - waiting)


def _run_child(spec: ProbeSpec, base: dict[str, Any], started: float, timeout_s: float,
               env: Mapping[str, str] | None, cancelled: Callable[[], bool] | None) -> ProbeResult:
    token = secrets.token_hex(12)
    tmp = Path(tempfile.mkdtemp(prefix="optplan-probe-"))
    try:
        spec_path, out_path, log_path = tmp / "spec.json", tmp / "result.json", tmp / "child.log"
        spec_path.write_text(json.dumps(spec.model_dump(mode="json")))
        cmd = probe_command(spec_path, out_path, spec.nproc, accelerate_config=spec.accelerate_config,
                            device=spec.device)
        child = child_env(None, device=spec.device, nproc=spec.nproc, token=token, extra=env)
        if not (env and "TMPDIR" in env):  # torchrun's and torch's temp folders go with the probe's own
            child["TMPDIR"] = str(tmp)
        quiet = group_from_env(child)
        wait_while_quiet(quiet)  # no import starts during another probe's timed steps (probes/host_quiet.py)
        try:
            proc = launch(cmd, child, log_path)
        except OSError as exc:
            return ProbeResult(**base, status="error", reason=one_line(f"could not start the probe child ({exc})"),
                               wall_s=round(time.perf_counter() - started, 3))
        timed_out = False
        try:
            communicate_until(proc, timeout_s=timeout_s, cancelled=cancelled,
                              paused=(lambda: _lock_wait_s(out_path)) if spec.device_lock else None)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:  # Ctrl-C, a signal or a cancel in the parent: leave no probe process behind
            terminate_tree(proc, token, grace_s=0.5)
            if quiet is not None:
                resume_stale(quiet)
            raise
        ended_at = time.time()
        terminate_tree(proc, token, grace_s=3.0 if timed_out else 0.5)  # also any process left behind
        if quiet is not None:  # a child killed while others of its group were stopped: continue them now
            resume_stale(quiet)
        code = proc.returncode
        tail = read_tail(log_path)
        log_end = read_tail(log_path, lines=400, max_chars=60000)
        docs = _read_rank_files(out_path, spec.nproc)
        merged = _merge(spec, docs, code, log_end, timed_out, timeout_s, ended_at)
        return ProbeResult(**base, **merged, tail=tail, exit_code=code,
                           wall_s=round(time.perf_counter() - started, 3))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_rank_files(out_path: Path, nproc: int) -> dict[int, dict[str, Any]]:
    docs: dict[int, dict[str, Any]] = {}
    for rank in range(nproc):
        path = out_path if rank == 0 else Path(f"{out_path}.rank{rank}")
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            docs[rank] = doc
    return docs


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _max_opt(values: list[Any]) -> int | None:
    numbers = [int(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return max(numbers) if numbers else None


def _merge(spec: ProbeSpec, docs: dict[int, dict[str, Any]], code: int | None, log: str, timed_out: bool,
           timeout_s: float, ended_at: float | None = None) -> dict[str, Any]:
    """Fields of the ProbeResult from the rank results, the exit code and the log's end."""
    out: dict[str, Any] = {}
    first = docs.get(0) or (docs[min(docs)] if docs else {})
    out["device_name"] = str(first.get("device_name") or "")
    out["torch_version"] = str(first.get("torch_version") or "")
    out["losses"] = tuple(float(x) for x in first.get("losses") or ())
    out["checkpointing_applied"] = first.get("checkpointing_applied")
    notes: list[str] = []
    for rank in sorted(docs):
        for note in docs[rank].get("notes") or ():
            if note not in notes:
                notes.append(str(note))
    out["notes"] = tuple(notes)
    # step times: every rank holds the max over ranks already; take the elementwise max anyway
    lists = [list(d.get("step_times_s") or ()) for d in docs.values()]
    if lists:
        n = min(len(x) for x in lists)
        times = [max(x[i] for x in lists) for i in range(n)]
        if times:
            out["step_times_s"] = tuple(times)
            out["step_s"] = _median(times)
            out["step_spread_s"] = max(times) - min(times)
    out["peak_allocated_bytes"] = _max_opt([d.get("peak_allocated_bytes") for d in docs.values()])
    out["peak_reserved_bytes"] = _max_opt([d.get("peak_reserved_bytes") for d in docs.values()])
    out["non_torch_bytes"] = _max_opt([d.get("non_torch_bytes") for d in docs.values()])
    with_peak = [d for d in docs.values() if isinstance(d.get("peak_allocated_bytes"), int)]
    if with_peak:
        top = max(with_peak, key=lambda d: d["peak_allocated_bytes"])
        out["peak_by_category_bytes"] = {str(k): int(v) for k, v in (top.get("peak_by_category_bytes") or {}).items()}
    if isinstance(first.get("step_trace"), dict):
        out["step_trace"] = first["step_trace"]
    setups = [d.get("setup_s") for d in docs.values() if isinstance(d.get("setup_s"), (int, float))]
    out["setup_s"] = max(setups) if setups else None
    for key in ("device_wait_s", "device_acquired_at"):
        if isinstance(first.get(key), (int, float)):
            out[key] = float(first[key])
    if isinstance(first.get("device_handed_over"), bool):
        out["device_handed_over"] = first["device_handed_over"]
    if isinstance(first.get("device_residue_bytes"), int):
        out["device_residue_bytes"] = first["device_residue_bytes"]
    if isinstance(first.get("previous_exit_wait_s"), (int, float)):
        out["previous_exit_wait_s"] = float(first["previous_exit_wait_s"])
    if isinstance(first.get("cuda_initialized_before_lock"), bool):
        out["cuda_initialized_before_lock"] = first["cuda_initialized_before_lock"]
    if isinstance(first.get("host_op_s"), (int, float)):
        out["host_op_s"] = float(first["host_op_s"])
    if isinstance(first.get("quieted_processes"), int):
        out["quieted_processes"] = first["quieted_processes"]
    timeline = {str(k): float(v) for k, v in (first.get("timeline_s") or {}).items() if isinstance(v, (int, float))}
    if isinstance(first.get("started_at"), (int, float)) and ended_at is not None:
        timeline["exited"] = round(ended_at - float(first["started_at"]), 3)
    out["timeline_s"] = timeline

    status, reason, rank = _decide(spec, docs, code, log, timed_out, timeout_s)
    out.update(status=status, reason=reason, failed_rank=rank)
    return out


FAULT_SIGNALS = (-4, -6, -7, -8, -11)
"""Exit codes of signals faulthandler dumps a traceback for (SIGILL, SIGABRT, SIGBUS, SIGFPE, SIGSEGV)."""


def _decide(spec: ProbeSpec, docs: dict[int, dict[str, Any]], code: int | None, log: str, timed_out: bool,
            timeout_s: float) -> tuple[str, str, int | None]:
    """(status, reason, failed rank) from the rank results and how the child ended.

    The first cause wins over its consequences: a rank's own failure (error, oom, nan) first, then a
    rank that died without a result (torchrun's exit code; not SIGTERM, which torchrun sends to the
    others), then a rank that failed only because a peer went away, then ranks killed by torchrun.
    """
    if timed_out:
        return "timeout", f"killed after {timeout_s:g} s", None
    multi = spec.nproc > 1

    def prefixed(rank: int, doc: dict[str, Any]) -> str:
        reason = str(doc.get("reason") or doc.get("status"))
        return one_line(f"rank {rank}: {reason}" if multi and "rank " not in reason else reason, 500)

    def earliest(group: dict[int, dict[str, Any]]) -> int:
        return min(group, key=lambda r: (group[r].get("failed_at") or float("inf"), r))

    failed = {r: d for r, d in docs.items() if d.get("status") in _FAILURES}
    own = {r: d for r, d in failed.items() if not d.get("peer_failure")}
    if own:
        rank = earliest(own)
        return str(own[rank]["status"]), prefixed(rank, own[rank]), rank

    exits = parse_torchrun_failures(log) if multi and code not in (0, None) else {}
    root = parse_torchrun_root_cause(log) if exits else None
    dead = {r: c for r, c in exits.items() if r not in failed and r not in docs}
    first_dead = [r for r, c in dead.items() if c != -15]
    if first_dead:
        rank = root[0] if root and root[0] in first_dead else min(first_dead)
        crash = crash_location(log) if dead[rank] in FAULT_SIGNALS else ""
        where = f" at {crash}" if crash else ""
        return "error", f"rank {rank} exited with {describe_exit(dead[rank])}{where}", rank
    if failed:
        rank = earliest(failed)
        return str(failed[rank]["status"]), prefixed(rank, failed[rank]), rank
    if dead:
        rank = min(dead)
        return "error", f"rank {rank} exited with {describe_exit(dead[rank])}", rank

    missing = [r for r in range(spec.nproc) if r not in docs]
    if missing:
        how = describe_exit(code) if code is not None else "an unknown exit"
        if not multi:
            crash = crash_location(log) if code in FAULT_SIGNALS else ""
            last = one_line(last_meaningful_line(log), 200)
            said = f" at {crash}" if crash else f"; last output: {last}" if last else ""
            return "error", f"the probe process exited with {how} without a result{said}", 0
        ranks = ", ".join(str(r) for r in missing)
        return "error", f"rank {ranks} wrote no result (torchrun exited with {how})", missing[0]
    if any(d.get("status") == "pruned" for d in docs.values()):
        doc = next(d for d in docs.values() if d.get("status") == "pruned")
        return "pruned", str(doc.get("reason") or "pruned"), None
    if code not in (0, None):
        return "error", f"the probe exited with {describe_exit(code)} after every rank wrote a result", None
    return "ok", "", None
