"""The host's speed at issuing eager operators, measured where a probe times its steps (``host_op_s``).

An eager step of a small model is paced by the host: the Python, the dispatcher and the kernel launch of each
operator (estimators/eager_host.py prices it as kernels x ``host_kernel_s``). That per-operator time is the host
CPU's, and the GPU visits' hosts differ: the same ResNet-50 fp32 micro-batch-16 step read 14.6, 33.6, 21.1 and
22.7 ms on four H200 visits whose device-bound steps agreed within 1 %. So each probe measures, just before its
first timed step, how long one tiny in-place operator takes to issue on its device (``x.add_(1)`` on one element:
no arithmetic to speak of, all host), the median of :data:`REPEATS` runs of :data:`OPS` operators. Rows from
different hosts (or one host under different load) can then be compared at equal host speed.

Reference: the "overhead-bound" regime, H. He, "Making Deep Learning Go Brrrr From First Principles" (2022), and
PyTorch's performance tuning guide (CPU-bound training). Units: seconds per operator.
"""

from __future__ import annotations

import time

import torch

OPS = 400
"""Operators per timed run (about 2-4 ms of host time on a recent server CPU)."""

REPEATS = 5
"""Timed runs; the median is kept."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_op_s(device: torch.device, *, ops: int = OPS, repeats: int = REPEATS) -> float:
    """Median host seconds to issue one one-element in-place add on ``device`` (after one untimed warm-up run)."""
    if ops < 1 or repeats < 1:
        raise ValueError(f"ops and repeats must be >= 1 (got {ops}, {repeats})")
    x = torch.zeros(1, device=device)
    times: list[float] = []
    with torch.no_grad():
        for run in range(repeats + 1):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(ops):
                x.add_(1.0)
            _sync(device)
            if run:  # the first run warms the kernel and the allocator
                times.append((time.perf_counter() - t0) / ops)
    times.sort()
    return times[len(times) // 2]


__all__ = ["OPS", "REPEATS", "host_op_s"]
