"""A probe of conftest's tiny model in ``PROBE_TEST_MODE=sleep`` (its forward sleeps), killed by its timeout: the
shared part of the probes' timeout tests (tests/probes/test_runtime_probe.py, test_distributed_probe.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from optplan.probes.runtime import ProbeResult


def pids_in(path: Path) -> list[int]:
    """The pids the test model wrote (PROBE_TEST_PID_FILE), once each."""
    return sorted({int(x) for x in path.read_text().split()}) if path.exists() else []


def killed_while_sleeping(run: Callable[..., ProbeResult], folder: Path, timeouts: tuple[int, ...],
                          ranks: int) -> tuple[ProbeResult, Path]:
    """``run(timeout_s=..., env=...)`` with the first of ``timeouts`` (s), and with the next where fewer than
    ``ranks`` processes had reached forward (written their pid) before the kill: on a loaded 2-core machine
    importing torch takes from 8 s to over 20 s, and the test is of the kill, not of the wait. Each run must end
    as a timeout at its limit. Returns the last run and its pid file."""
    for attempt, timeout in enumerate(timeouts):
        pid_file = folder / f"pids{attempt}"
        started = time.monotonic()
        r = run(timeout_s=timeout, env={"PROBE_TEST_MODE": "sleep", "PROBE_TEST_PID_FILE": str(pid_file)})
        assert r.status == "timeout" and r.reason == f"killed after {timeout} s"
        assert time.monotonic() - started < timeout + 20
        if len(pids_in(pid_file)) >= ranks:
            break
    return r, pid_file
