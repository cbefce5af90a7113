"""Waiting for a child process in short slices, so that a caller can cancel it (the dashboard's quit).

A thread cannot be interrupted while it blocks in ``Popen.wait``/``communicate``; waiting in slices of
``POLL_S`` seconds and asking ``cancelled()`` between them bounds how long a cancel takes to be seen.
Units: seconds.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any

from optplan.estimators.errors import Cancelled

POLL_S = 0.1
"""Longest wait between two ``cancelled()`` checks (s)."""


def communicate_until(proc: subprocess.Popen[Any], *, timeout_s: float,
                      cancelled: Callable[[], bool] | None = None,
                      paused: Callable[[], float] | None = None) -> tuple[Any, Any]:
    """``proc.communicate(timeout=timeout_s)``, checking ``cancelled()`` every ``POLL_S`` s.

    ``paused()``: seconds so far that do not count against ``timeout_s`` (a probe waiting for its device lock:
    probes/runtime.py); the deadline moves out by them, asked every ``POLL_S`` s.

    Raises ``subprocess.TimeoutExpired`` past ``timeout_s`` and :class:`Cancelled` when ``cancelled()``
    turns true; in both cases the process is left running for the caller to stop (its own way: one
    process, or a whole tree). Retrying ``communicate`` after a timeout loses no output (Python docs).
    """
    if cancelled is None and paused is None:
        return proc.communicate(timeout=timeout_s)
    start = time.monotonic()
    while True:
        if cancelled is not None and cancelled():
            raise Cancelled("cancelled while a child process ran")
        left = start + timeout_s + (paused() if paused is not None else 0.0) - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        try:
            return proc.communicate(timeout=min(POLL_S, left))
        except subprocess.TimeoutExpired:
            continue
