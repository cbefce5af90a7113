"""probes/host_quiet.py and probes/host_speed.py: the lock's holder stops its group's other processes while it
times its steps, and measures the host's speed there.

Real processes: sleepers started with the group's variable, and the MLP example probed on the CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from optplan.estimators.strategy import Strategy
from optplan.probes.host_quiet import QUIET_ENV, group_from_env, members, quieted, resume_recorded
from optplan.probes.host_speed import host_op_s
from optplan.probes.runtime import ProbeSpec, run_probe

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and SIGSTOP: Linux")

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mlp.py"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        return fh.read().rsplit(")", 1)[-1].split()[0]


def wait_for_state(pid: int, wanted: set[str], timeout_s: float = 5.0) -> str:
    deadline = time.monotonic() + timeout_s
    while (now := state(pid)) not in wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return now


@pytest.fixture
def group() -> str:
    return f"test-{os.getpid()}-{time.monotonic_ns()}"


@pytest.fixture
def sleepers(group: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two processes of ``group`` and one outside it."""
    env = {**os.environ, QUIET_ENV: group}
    procs = [subprocess.Popen(SLEEPER, env=env), subprocess.Popen(SLEEPER, env=env),
             subprocess.Popen(SLEEPER, env={k: v for k, v in os.environ.items() if k != QUIET_ENV})]
    try:
        yield procs
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def test_the_group_is_whoever_was_started_with_its_variable(group: str,
                                                            sleepers: list[subprocess.Popen[bytes]]) -> None:
    found = set(members(group))
    assert {sleepers[0].pid, sleepers[1].pid} <= found
    assert sleepers[2].pid not in found and os.getpid() not in found
    assert group_from_env({QUIET_ENV: f" {group} "}) == group
    assert group_from_env({QUIET_ENV: ""}) is None and group_from_env({}) is None


def test_the_block_stops_the_group_and_continues_it_after(group: str, tmp_path: Path,
                                                         sleepers: list[subprocess.Popen[bytes]]) -> None:
    """A holder (not the sleepers' parent, as a probe is not its neighbours') stops the group's two for its block."""
    record = tmp_path / "quieted"
    code = (f"import sys; from optplan.probes.host_quiet import quieted\n"
            f"with quieted({group!r}, {str(record)!r}) as stopped:\n"
            f"    print(*stopped, flush=True); sys.stdin.readline()\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        stopped = [int(x) for x in holder.stdout.readline().split()]
        assert sorted(stopped) == sorted(p.pid for p in sleepers[:2])
        assert [wait_for_state(p.pid, {"T"}) for p in sleepers[:2]] == ["T", "T"]
        assert state(sleepers[2].pid) != "T"  # not of the group
        assert sorted(int(x) for x in record.read_text().split()) == sorted(stopped)
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0
    finally:
        holder.kill()
    assert [wait_for_state(p.pid, {"S", "R"}) for p in sleepers[:2]] == ["S", "S"]
    assert not record.exists()
    with quieted(None, record) as none:  # no group: nothing
        assert none == [] and state(sleepers[0].pid) == "S"
    with quieted(group) as mine:  # this process started them: its descendants are spared
        assert mine == []


def test_a_holder_spares_its_ancestors_and_descendants(group: str, tmp_path: Path) -> None:
    """A parent of the group starts a sibling (stopped) and a holder, whose own child is spared; so is the parent."""
    holder = textwrap.dedent(f"""
        import subprocess, sys, time
        from optplan.probes.host_quiet import others
        child = subprocess.Popen({SLEEPER!r})
        time.sleep(0.5)
        print("child", child.pid, "others", *others({group!r}), flush=True)
        child.kill()
    """)
    parent = textwrap.dedent(f"""
        import os, subprocess, sys
        sibling = subprocess.Popen({SLEEPER!r})
        out = subprocess.run([sys.executable, "-c", {holder!r}], capture_output=True, text=True).stdout
        print("parent", os.getpid(), "sibling", sibling.pid, out, flush=True)
        sibling.kill()
    """)
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60,
                         env={**os.environ, QUIET_ENV: group}).stdout.split()
    sibling, child = int(out[out.index("sibling") + 1]), int(out[out.index("child") + 1])
    spared = [int(x) for x in out[out.index("others") + 1:]]
    assert spared == [sibling], (out, child)


def test_the_parent_continues_what_a_killed_holder_left_stopped(group: str, tmp_path: Path,
                                                               sleepers: list[subprocess.Popen[bytes]]) -> None:
    record = tmp_path / "quieted"
    holder = (f"from optplan.probes.host_quiet import stop_others; stop_others({group!r}, {str(record)!r}); "
              "import time; time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", holder])
    try:
        deadline = time.monotonic() + 30
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert wait_for_state(sleepers[0].pid, {"T"}) == "T"
    finally:
        proc.kill()
        proc.wait()
    assert state(sleepers[0].pid) == "T"  # the holder died: nobody continued them
    assert resume_recorded(record) == 2
    assert wait_for_state(sleepers[0].pid, {"S", "R"}) in ("S", "R") and not record.exists()
    assert resume_recorded(record) == 0  # nothing left to do


def test_a_locked_probe_in_a_group_quiets_it_while_it_times(group: str, tmp_path: Path,
                                                           sleepers: list[subprocess.Popen[bytes]]) -> None:
    """The MLP probe holding a lock stops both sleepers for its timed steps, records that and the host's speed,
    and leaves them running."""
    spec = ProbeSpec(model_path=str(MLP), strategy=Strategy(precision="fp32", optimizer="adamw", mbs=16, engine="torch"),
                     warmup_steps=1, timed_steps=2, device_lock=str(tmp_path / "device.lock"))
    result = run_probe(spec, timeout_s=120, env={QUIET_ENV: group})
    assert result.ok, result.reason + "\n" + result.tail
    assert result.quieted_processes == 2
    assert result.host_op_s is not None and 0 < result.host_op_s < 1e-3
    t = result.timeline_s
    assert t["first_step"] < t["stepped"] <= t["resumed"] <= t["released"]
    assert [state(p.pid) for p in sleepers] == ["S", "S", "S"]
    # without a group, or without a lock, nobody is stopped
    alone = run_probe(spec.model_copy(update={"device_lock": None}), timeout_s=120, env={QUIET_ENV: group})
    assert alone.ok and alone.quieted_processes is None and alone.host_op_s is not None


def test_host_op_s_is_the_median_time_of_one_tiny_operator() -> None:
    per_op = host_op_s(torch.device("cpu"), ops=200, repeats=3)
    assert 1e-8 < per_op < 1e-3
    with pytest.raises(ValueError, match="ops and repeats"):
        host_op_s(torch.device("cpu"), ops=0)
