"""probes/host_quiet.py and probes/host_speed.py: the lock's holder stops its group's other processes while it
times its steps, and measures the host's speed there.

Real processes: sleepers started with the group's variable, and the MLP example probed on the CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from optplan.estimators.strategy import Strategy
from optplan.probes.host_quiet import (
    QUIET_ENV,
    group_from_env,
    members,
    others,
    owned_group,
    record_path,
    resume_stale,
    wait_while_quiet,
)
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


def not_stopped(pid: int, timeout_s: float = 5.0) -> bool:
    """Whether ``pid`` is (within ``timeout_s``) in any state but stopped (T)."""
    return wait_for_state(pid, {"S", "R", "D"}, timeout_s) != "T"


def wait_for_state(pid: int, wanted: set[str], timeout_s: float = 5.0) -> str:
    deadline = time.monotonic() + timeout_s
    while (now := state(pid)) not in wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return now


@pytest.fixture
def group(tmp_path: Path) -> Iterator[str]:
    """A quiet group owned by this test (its folder watched; everything continued at the end)."""
    with owned_group(tmp_path / "quiet") as name:
        yield name


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


def holder(group: str, *, spare: int | None = None, hang: bool = False) -> subprocess.Popen[str]:
    """A process (not the sleepers' parent, as a probe is not its neighbours') that stops the group's others, prints
    them, and continues them on a line from stdin (``hang``: never)."""
    code = textwrap.dedent(f"""
        import sys, time
        from optplan.probes.host_quiet import resume, stop_others
        stopped = stop_others({group!r}, spare={(spare,) if spare else ()!r})
        print(*stopped, flush=True)
        sys.stdin.readline()
        if {hang!r}:
            time.sleep(120)
        resume({group!r}, stopped)
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def stopped_by(proc: subprocess.Popen[str]) -> list[int]:
    assert proc.stdout is not None
    return [int(x) for x in proc.stdout.readline().split()]


def release(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()


def test_the_group_is_whoever_was_started_with_its_variable(group: str,
                                                            sleepers: list[subprocess.Popen[bytes]]) -> None:
    found = set(members(group))
    assert {sleepers[0].pid, sleepers[1].pid} <= found
    assert sleepers[2].pid not in found and os.getpid() not in found
    assert group_from_env({QUIET_ENV: f" {group} "}) == group
    assert group_from_env({QUIET_ENV: ""}) is None and group_from_env({}) is None
    assert others(group) == []  # this process started them: its descendants are spared


def test_a_holder_stops_the_group_and_continues_it_after(group: str, sleepers: list[subprocess.Popen[bytes]]) -> None:
    proc = holder(group)
    try:
        stopped = stopped_by(proc)
        assert sorted(stopped) == sorted(p.pid for p in sleepers[:2])
        assert [wait_for_state(p.pid, {"T"}) for p in sleepers[:2]] == ["T", "T"]
        assert state(sleepers[2].pid) != "T"  # not of the group
        record = record_path(group, proc.pid)
        assert sorted(int(x) for x in record.read_text().split()) == sorted(stopped)
        assert wait_while_quiet(group, max_wait_s=0.3) >= 0.3  # a live record: a spawner waits
        release(proc)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    assert all(not_stopped(p.pid) for p in sleepers[:2])
    assert not record.exists() and wait_while_quiet(group) == 0.0


def test_a_holder_spares_the_previous_holder(group: str, sleepers: list[subprocess.Popen[bytes]]) -> None:
    proc = holder(group, spare=sleepers[0].pid)
    try:
        assert stopped_by(proc) == [sleepers[1].pid]
        release(proc)
        assert proc.wait(30) == 0
    finally:
        proc.kill()


def test_a_holder_spares_its_ancestors_and_descendants(group: str, tmp_path: Path) -> None:
    """A parent of the group starts a sibling (stopped) and a holder, whose own child is spared; so is the parent."""
    holder_code = textwrap.dedent(f"""
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
        out = subprocess.run([sys.executable, "-c", {holder_code!r}], capture_output=True, text=True).stdout
        print("parent", os.getpid(), "sibling", sibling.pid, out, flush=True)
        sibling.kill()
    """)
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60,
                         env={**os.environ, QUIET_ENV: group}).stdout.split()
    sibling, child = int(out[out.index("sibling") + 1]), int(out[out.index("child") + 1])
    spared = [int(x) for x in out[out.index("others") + 1:]]
    assert spared == [sibling], (out, child)


def test_what_a_killed_holder_left_stopped_is_continued(group: str,
                                                       sleepers: list[subprocess.Popen[bytes]]) -> None:
    """The holder dies mid-way: its record stays; the parent (``resume_stale``, as run_probe does after its child)
    or the group's owner (watching every half second) continues them."""
    proc = holder(group)
    stopped = stopped_by(proc)
    assert [wait_for_state(p, {"T"}) for p in stopped] == ["T", "T"]
    proc.kill()
    proc.wait()
    assert resume_stale(group) == 2
    assert all(not_stopped(p) for p in stopped)
    assert resume_stale(group) == 0  # nothing left to do
    proc = holder(group)  # again, and this time the owner's watch finds it
    stopped = stopped_by(proc)
    proc.kill()
    proc.wait()
    assert all(not_stopped(p) for p in stopped)


def test_a_hung_holder_keeps_them_stopped_no_longer_than_the_cap(group: str,
                                                                 sleepers: list[subprocess.Popen[bytes]]) -> None:
    proc = holder(group, hang=True)
    try:
        stopped = stopped_by(proc)
        release(proc)  # it now hangs without continuing them
        assert resume_stale(group) == 0  # alive and recent: left to it
        assert resume_stale(group, max_age_s=-1.0) == 2  # older than the cap: continued
        assert all(not_stopped(p) for p in stopped)
    finally:
        proc.kill()


def test_the_owner_continues_every_member_at_its_end(tmp_path: Path) -> None:
    with owned_group(tmp_path / "g") as name:
        sleeper = subprocess.Popen(SLEEPER, env={**os.environ, QUIET_ENV: name})
        try:
            sleeper.send_signal(signal.SIGSTOP)
            assert wait_for_state(sleeper.pid, {"T"}) == "T"
        except BaseException:
            sleeper.kill()
            raise
    try:
        assert not_stopped(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_locked_probe_in_a_group_quiets_it_while_it_times(group: str, tmp_path: Path,
                                                           sleepers: list[subprocess.Popen[bytes]]) -> None:
    """The MLP probe holding a lock stops both sleepers for its timed steps (seen stopped from here meanwhile),
    records that and the host's speed, and leaves them running."""
    spec = ProbeSpec(model_path=str(MLP), strategy=Strategy(precision="fp32", optimizer="adamw", mbs=16, engine="torch"),
                     warmup_steps=1, timed_steps=2, device_lock=str(tmp_path / "device.lock"))
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.add(state(sleepers[0].pid))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run_probe(spec, timeout_s=120, env={QUIET_ENV: group})
    finally:
        done.set()
        watcher.join()
    assert result.ok, result.reason + "\n" + result.tail
    assert result.quieted_processes == 2 and "T" in seen
    assert result.host_op_s is not None and 0 < result.host_op_s < 1e-3
    t = result.timeline_s
    assert t["first_step"] < t["stepped"] <= t["resumed"] <= t["released"]
    assert all(state(p.pid) != "T" for p in sleepers) and not list(Path(group).glob("*.stopped"))
    # without a lock nobody is stopped
    alone = run_probe(spec.model_copy(update={"device_lock": None}), timeout_s=120, env={QUIET_ENV: group})
    assert alone.ok and alone.quieted_processes is None and alone.host_op_s is not None


def test_host_op_s_is_the_median_time_of_one_tiny_operator() -> None:
    per_op = host_op_s(torch.device("cpu"), ops=200, repeats=3)
    assert 1e-8 < per_op < 1e-3
    with pytest.raises(ValueError, match="ops and repeats"):
        host_op_s(torch.device("cpu"), ops=0)
