"""communicate_until: a child is waited for in slices so that a cancel is seen promptly."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from optplan.estimators.errors import Cancelled
from optplan.probes.waiting import POLL_S, communicate_until


def _child(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_output_of_a_child_that_finishes() -> None:
    proc = _child("import sys, time; time.sleep(0.3); print('out'); print('err', file=sys.stderr)")
    out, err = communicate_until(proc, timeout_s=30, cancelled=lambda: False)
    assert (out, err, proc.returncode) == ("out\n", "err\n", 0)


def test_cancel_is_seen_while_the_child_runs() -> None:
    proc = _child("import time; time.sleep(60)")
    asked = []

    def cancelled() -> bool:
        asked.append(time.monotonic())
        return len(asked) > 3

    try:
        with pytest.raises(Cancelled):
            communicate_until(proc, timeout_s=60, cancelled=cancelled)
        assert len(asked) == 4 and proc.poll() is None  # asked once per slice; the caller stops the child
        assert asked[-1] - asked[0] >= 3 * POLL_S * 0.9
    finally:
        proc.kill()
        proc.communicate()


def test_timeout_then_the_output_so_far() -> None:
    proc = _child("import sys; print('partial', flush=True); import time; time.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired):
        communicate_until(proc, timeout_s=3, cancelled=lambda: False)
    proc.kill()
    out, _ = proc.communicate()
    assert out == "partial\n"  # retrying communicate after a timeout loses nothing
