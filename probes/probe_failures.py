"""How a probe ends when it fails: the status ("error", "oom", "nan", "pruned") and one readable line.

Used by the probe child (:mod:`optplan.probes.runtime_child`; standard library and torch only, like it): an
exception raised while a phase ran (building the model, DeepSpeed's initialize, a step) is classified by
:func:`classify`: the probe's own byte cap (:class:`ProbeOOM`, raised by
:class:`optplan.probes.probe_tracker.ProbeTracker`), a CUDA or host out-of-memory error (torch's message cut to
what matters: :func:`cuda_oom_summary`), a DeepSpeed op that could not be JIT-built, a model-file problem, or
anything else as "error" with the exception's one-line text. :func:`peer_failure` tells a rank that only lost
its peer (another rank died first) from the one that failed.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Iterator

import torch

from optplan.probes.contract import exc_text
from optplan.probes.model_errors import ModelFileError, one_line
from optplan.probes.trainloop import TrainFailure

OOM_MARK = "optplan-probe-oom"
"""Marks a :class:`ProbeOOM` in the text of an exception that wrapped it (autograd, a collective)."""

ProbeFailure = TrainFailure
"""A readable end of the probe with a status ("error", "oom", "nan" or "pruned"): trainloop's TrainFailure."""


class ProbeOOM(ProbeFailure):
    """Live tensor bytes went over ``memory_cap_bytes`` (raised by :class:`ProbeTracker`)."""

    def __init__(self, reason: str) -> None:
        super().__init__("oom", reason)

    def __str__(self) -> str:  # recognisable after being wrapped by autograd or a collective
        return f"{OOM_MARK}: {self.reason}"


def human_bytes(n: float) -> str:
    """Bytes as "812 B", "3.4 KiB", "1.2 MiB", "2.50 GiB"."""
    if n < 1024:
        return f"{n:.0f} B"
    if n < 2**20:
        return f"{n / 1024:.1f} KiB"
    if n < 2**30:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**30:.2f} GiB"


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


_PEER_FAILURE = re.compile(
    r"connection (closed|reset) by peer|broken pipe|remote worker|communicator was aborted|"
    r"connection refused|socket timeout|ncclremoteerror|rendezvous.*(closed|shut)", re.I)


def peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` says another rank went away (a collective lost its peer): this rank is a victim."""
    return any(_PEER_FAILURE.search(str(e)) for e in exception_chain(exc))


def classify(exc: BaseException, phase: str) -> tuple[str, str]:
    """(status, one-line reason) for an exception raised while ``phase`` ran."""
    for e in exception_chain(exc):
        if isinstance(e, ProbeOOM):
            return "oom", f"{e.reason} during {phase}"
        if isinstance(e, TrainFailure) or (type(e).__name__ == "TrainFailure" and hasattr(e, "status")):
            return e.status, e.reason  # this package's, or a generated train.py's (--train-script)
        if isinstance(e, ModelFileError):
            return "error", str(e)
    text = str(exc)
    if OOM_MARK in text:
        return "oom", one_line(text.split(OOM_MARK + ":", 1)[-1], 400) + f" during {phase}"
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    lowered = text.lower()
    if (oom_type is not None and isinstance(exc, oom_type)) or "cuda out of memory" in lowered:
        return "oom", one_line(f"CUDA out of memory in {phase}: {cuda_oom_summary(text)}", 400)
    if isinstance(exc, MemoryError):
        return "oom", one_line(f"out of host memory in {phase} (MemoryError{': ' + text if text else ''})", 400)
    if isinstance(exc, RuntimeError) and ("out of memory" in lowered or "can't allocate memory" in lowered):
        return "oom", one_line(f"out of memory in {phase}: {text}", 400)
    if phase.startswith(("deepspeed", "importing deepspeed")) and (_OP_BUILD.search(text) or _in_op_build(exc)):
        return "error", one_line(
            f"DeepSpeed could not JIT-build an op during {phase} ({exc_text(exc)}): check that g++/ninja (and nvcc "
            f"with CUDA_HOME on GPU) work and {EXTENSIONS_VAR} is writable, or give a ds_config without an "
            "'optimizer' section (the probe then passes a torch optimizer)", 500)
    return "error", one_line(f"{phase} raised {exc_text(exc)}", 400)


def _in_op_build(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it chains) was raised inside DeepSpeed's op builder or torch's
    C++ extension loader (a compiler that fails even its version check says nothing of "build")."""
    for e in exception_chain(exc):
        for frame in traceback.extract_tb(e.__traceback__):
            name = frame.filename.replace("\\", "/")
            if "/op_builder/" in name or name.endswith("cpp_extension.py"):
                return True
    return False


_OP_BUILD = re.compile(r"error building extension|ninja|cuda_home|nvcc|op_builder|\.so: cannot open|"
                       r"compiled with|jit|cpp_extension", re.I)
EXTENSIONS_VAR = "TORCH_EXTENSIONS_DIR"


def cuda_oom_summary(text: str) -> str:
    """The useful part of torch's CUDA OOM message: "tried to allocate 20.00 MiB; GPU 0 has a total
    capacity of 79.19 GiB of which 3.19 MiB is free" (without the allocator advice)."""
    body = re.sub(r"^\s*CUDA out of memory\.?\s*", "", text.strip())
    for stop in ("Including non-PyTorch memory", "Of the allocated memory", "If reserved but unallocated"):
        body = body.split(stop)[0]
    body = re.sub(r"\s*(Process \d+|This process) has .*? memory in use\.", "", body)
    parts = [p.strip().rstrip(".") for p in re.split(r"\.\s+", body) if p.strip()]
    return "; ".join(p[0].lower() + p[1:] if len(p) > 1 and p[1].islower() else p for p in parts)


__all__ = ["EXTENSIONS_VAR", "OOM_MARK", "ProbeFailure", "ProbeOOM", "classify", "cuda_oom_summary",
           "exception_chain", "human_bytes", "peer_failure"]
