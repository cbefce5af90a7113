"""Where a training step's time goes: a few optimizer steps under ``torch.profiler``, their kernel time (CUDA)
or ATen operator time (CPU) summed by category, per step (seconds).

The step-time model prices a step as GEMMs (compute.py), attention, memory-bound elementwise work, the optimizer
step and the host's launch time (timing.py). A measured step only says the total; these sums say which part was
off (issue 16: "fix what they show"). Categories come from kernel and operator names (stated heuristics):

* ``gemm``: cuBLAS/cuBLASLt/CUTLASS kernels (``gemm``, ``xmma``, ``cutlass``, ``nvjet``, ``sm90_``, ``sm80_``
  and ``ampere_``/``hopper_`` prefixed kernels) and, on the CPU, ``aten::mm``/``addmm``/``bmm``/``baddbmm``/
  ``linear``/``convolution`` operators;
* ``attention``: flash / memory-efficient / cuDNN attention kernels (``flash``, ``fmha``, ``attention``,
  ``attn``), ``aten::_scaled_dot_product*`` on the CPU;
* ``optimizer``: ``multi_tensor_apply`` kernels and fused/foreach Adam (``adam``, ``_foreach_``); on the CPU the
  time inside torch's ``Optimizer.step#...`` annotation (its operators are plain elementwise ones), taken from
  ``other``;
* ``communication``: NCCL kernels (``nccl``);
* ``other``: everything else (elementwise, reductions, copies, normalisation, the loss).

``busy_s`` is the sum over categories; ``step_wall_s`` the traced steps' wall time each (the profiler adds
overhead: the timed steps, not these, are the probe's step time); ``kernels`` the kernels (CUDA) or operators
(CPU) per step. CUDA kernel events are read from ``profile().events()`` (Kineto's device events, device type
CUDA); the CPU's from the operators' self time (exclusive, so nothing counts twice). Device-side copies of
``record_function`` ranges (``gpu_user_annotation``: ``Optimizer.step#AdamW.step`` spans every AdamW kernel)
are left out and counted in ``annotations_skipped``: the first H200 visit's trace.json (2026-11-26-H200-visit2)
counted them, which doubled its ``optimizer`` figures. ``host_per_step`` (:func:`host_time`) is the CPU side:
operators' self time, CUDA runtime calls and synchronisation, per step. ``top_kernels`` (:func:`top_kernels`)
names the kernels (or operators) that took the most time, per step: which attention backend SDPA chose (flash,
cuDNN, memory-efficient), which GEMM library, what the ``other`` time is made of.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

CATEGORIES = ("gemm", "attention", "optimizer", "communication", "other")

_GEMM_KERNEL = ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "sm80_", "sm100_", "ampere_", "hopper_", "cublas")
_GEMM_OP = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_convolution", "aten::convolution",
            "aten::mkldnn_convolution", "aten::_mm", "aten::_addmm_activation", "aten::_scaled_mm")
_ATTENTION = ("flash", "fmha", "attention", "attn", "scaled_dot_product")
_OPTIMIZER = ("multi_tensor", "adam", "_foreach_", "sgd")


def category(name: str) -> str:
    """The category of a kernel or ATen operator name (module docstring)."""
    low = name.lower()
    if "nccl" in low:
        return "communication"
    if any(k in low for k in _ATTENTION):
        return "attention"
    if any(k in low for k in _OPTIMIZER):
        return "optimizer"
    if low.startswith("aten::"):
        return "gemm" if low.split(".")[0] in _GEMM_OP else "other"
    if any(k in low for k in _GEMM_KERNEL):
        return "gemm"
    return "other"


def trace_steps(step: Callable[[], Any], steps: int, *, cuda: bool, sync: Callable[[], None]) -> dict[str, Any]:
    """Run ``step`` ``steps`` times under the profiler; per-step seconds by category (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    wall = (time.perf_counter() - t0) / steps
    events = prof.events()
    sums, count, skipped = sum_events(events, cuda=cuda)
    per_step = {k: v / steps for k, v in sums.items()}
    host = {k: v / steps for k, v in host_time(events).items()}
    return {"time_by_category_s": per_step, "busy_s": sum(per_step.values()), "step_wall_s": wall,
            "kernels": count / steps, "annotations_skipped": skipped / steps, "host_per_step": host,
            "top_kernels": top_kernels(events, cuda=cuda, steps=steps),
            "what": "CUDA kernels" if cuda else "ATen operators (self CPU time)"}


_RUNTIME = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemsetAsync",
            "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def host_time(events: Any) -> dict[str, float]:
    """The CPU side of the traced steps (seconds, or counts): ATen operators' self time on the host (dispatch,
    Python-visible op overhead), CUDA runtime calls (launches, async copies) and the time blocked in
    synchronising calls, and the operators run. Beside the kernels' time this says whether a step waited on
    the host (the step-time model's host term, timing.py) or on the GPU."""
    from torch.autograd import DeviceType

    out = {"aten_self_s": 0.0, "cuda_runtime_s": 0.0, "sync_s": 0.0, "ops": 0.0}
    for evt in events:
        if evt.device_type != DeviceType.CPU:
            continue
        if evt.name.startswith("aten::"):
            out["aten_self_s"] += evt.self_cpu_time_total * 1e-6
            out["ops"] += 1
        elif evt.name in _RUNTIME:
            key = "sync_s" if "Synchronize" in evt.name else "cuda_runtime_s"
            out[key] += evt.self_cpu_time_total * 1e-6
    return out


def _is_annotation(evt: Any) -> bool:
    """A device-side copy of a ``record_function`` range (Kineto's ``gpu_user_annotation``, e.g.
    ``Optimizer.step#AdamW.step``): a span over kernels already counted, not a kernel. torch's own tables
    leave them out (torch/autograd/profiler_util.py ``_build_table``: ``not evt.is_user_annotation``); torch
    builds without the flag name them after their CPU range, which holds a ``#`` or starts ``ProfilerStep``."""
    flag = getattr(evt, "is_user_annotation", None)
    if flag is not None:
        return bool(flag)
    return "#" in evt.name or evt.name.startswith("ProfilerStep")


TOP_KERNELS = 40
"""Kernels (or operators) named in ``top_kernels`` (15 until the fourth H200 visit, too few to find a model's
logits GEMMs and its loss kernels beside the layers' own)."""
NAME_CHARS = 160
"""A kernel name is cut to this many characters (C++ template names run to thousands)."""


def _timed(events: Any, *, cuda: bool) -> Iterator[tuple[str, float | None]]:
    """(name, microseconds) of each CUDA kernel (its time range) or CPU ATen operator (its self time); a
    device-side annotation (:func:`_is_annotation`) comes as (name, None): a span over kernels already counted."""
    from torch.autograd import DeviceType

    for evt in events:
        if cuda:
            if evt.device_type != DeviceType.CUDA:
                continue
            # the first H200 trace counted AdamW's step twice: its kernels and this span
            yield evt.name, None if _is_annotation(evt) else evt.time_range.end - evt.time_range.start
        elif evt.device_type == DeviceType.CPU and evt.name.startswith("aten::"):
            yield evt.name, evt.self_cpu_time_total


def top_kernels(events: Any, *, cuda: bool, steps: int = 1, n: int = TOP_KERNELS) -> list[dict[str, Any]]:
    """The ``n`` kernel names (CUDA) or ATen operators (CPU, self time) with the most time, per step, longest
    first: name (cut to ``NAME_CHARS``), category, seconds and calls per step. Annotations are left out as in
    :func:`sum_events`."""
    totals: dict[str, list[float]] = {}
    for name, duration_us in _timed(events, cuda=cuda):
        if duration_us is None:
            continue
        entry = totals.setdefault(name, [0.0, 0.0])
        entry[0] += duration_us
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: kv[1][0], reverse=True)[:n]
    return [{"name": name[:NAME_CHARS], "category": category(name), "s": us * 1e-6 / steps, "calls": calls / steps}
            for name, (us, calls) in ranked]


def sum_events(events: Any, *, cuda: bool) -> tuple[dict[str, float], int, int]:
    """Seconds by category over profiler events, the kernels (or operators) counted, and the device-side
    annotations left out (module docstring; CUDA kernels by their time range, CPU operators by self time)."""
    sums = dict.fromkeys(CATEGORIES, 0.0)
    count = skipped = 0
    for name, duration_us in _timed(events, cuda=cuda):
        if duration_us is None:
            skipped += 1
            continue
        sums[category(name)] += duration_us * 1e-6
        count += 1
    if not cuda:  # CPU optimizers run plain operators: their step is the optimizer's own annotation, inclusive
        opt_us = sum(evt.cpu_time_total for evt in events if evt.name.startswith("Optimizer.step#"))
        moved = min(opt_us * 1e-6, sums["other"])
        sums["optimizer"] += moved
        sums["other"] -= moved
    return sums, count, skipped


__all__ = ["CATEGORIES", "category", "host_time", "sum_events", "top_kernels", "trace_steps"]
