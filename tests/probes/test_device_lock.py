"""probes/device_lock.py: probes share one device in turn, and a finished probe hands the device on before it exits.

The lock is a real ``flock``; the probes are real child processes (the MLP example on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from optplan.estimators.strategy import Strategy
from optplan.probes.device_lock import DEVICE_LOCK_ENV, acquire, lock_from_env, process_alive
from optplan.probes.runtime import ProbeSpec, run_probe

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mlp.py"
MARKS = ("imported", "device_acquired", "device_ready", "built", "set_up", "first_step", "stepped", "measured",
         "released", "exited")


def _spec(**kw: object) -> ProbeSpec:
    return ProbeSpec(model_path=str(MLP), strategy=Strategy(precision="fp32", optimizer="adamw", mbs=16, engine="torch"),
                     warmup_steps=1, timed_steps=1, **kw)  # type: ignore[arg-type]


def test_a_finished_probe_releases_the_lock_before_it_exits(tmp_path: Path) -> None:
    """The probe's timeline runs in order, and this thread takes the lock while the child is still alive: the
    hand-over happened before the exit, which is what lets the next probe start its device work early."""
    lock = tmp_path / "device.lock"
    taken_at: list[float] = []

    def take_after_the_probe_has_it() -> None:
        deadline = time.monotonic() + 60
        while lock.stat().st_size == 0 if lock.exists() else True:  # until the child wrote its pid on release
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        held = acquire(str(lock))
        taken_at.append(time.time())
        held.release()

    watcher = threading.Thread(target=take_after_the_probe_has_it)
    watcher.start()
    result = run_probe(_spec(device_lock=str(lock)), timeout_s=120)
    watcher.join(60)
    assert result.ok, result.reason + "\n" + result.tail
    assert result.device_handed_over is True and result.device_residue_bytes is None  # no allocator on the CPU
    t = result.timeline_s
    assert list(MARKS) == [m for m in t if m in MARKS]  # recorded in this order
    assert [t[m] for m in MARKS] == sorted(t[m] for m in MARKS)
    assert result.setup_s is not None and t["device_acquired"] <= result.setup_s <= t["first_step"]
    started_at = result.device_acquired_at - t["device_acquired"]  # type: ignore[operator]
    exited_at = started_at + t["exited"]
    assert taken_at and taken_at[0] < exited_at  # the lock was free before the child was gone
    assert lock.read_text().strip().isdigit()  # the releasing pid, for the next holder to wait on


def test_the_next_holder_waits_for_the_previous_to_exit_before_its_memory_figure(tmp_path: Path) -> None:
    """The pid the hand-over wrote is read by the next holder, which waits for that process to be gone."""
    lock = tmp_path / "device.lock"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    lock.write_text(f"{sleeper.pid}\n")
    held = acquire(str(lock))
    try:
        assert held.previous_pid == sleeper.pid and process_alive(sleeper.pid)
        waiter = threading.Thread(target=sleeper.wait)  # reaps it, as the probe's parent would
        waiter.start()
        waited = held.wait_for_previous_exit(timeout_s=20)
        waiter.join(10)
        assert 0.5 < waited < 15 and not process_alive(sleeper.pid)
    finally:
        held.release()
    mine = acquire(str(lock))
    assert mine.previous_pid == sleeper.pid  # nothing rewrote it: a plain release leaves the file as it was
    mine.release()


def test_a_zombie_counts_as_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process_alive(child.pid):  # exited, not yet reaped: a zombie
        time.sleep(0.05)
    assert not process_alive(child.pid)
    child.wait()
    assert process_alive(os.getpid())


def test_the_environment_variable_gives_one_process_probes_the_lock(tmp_path: Path) -> None:
    lock = str(tmp_path / "env.lock")
    assert lock_from_env(1, {DEVICE_LOCK_ENV: lock}) == lock
    assert lock_from_env(2, {DEVICE_LOCK_ENV: lock}) is None  # ranks of one probe would wait on each other
    assert lock_from_env(1, {DEVICE_LOCK_ENV: "  "}) is None and lock_from_env(1, {}) is None
    with ThreadPoolExecutor(max_workers=1) as ex:
        held = acquire(lock)
        future = ex.submit(run_probe, _spec(), timeout_s=120, env={DEVICE_LOCK_ENV: lock})
        time.sleep(4.0)
        assert not future.done()  # waiting for the lock this test holds
        held.release()
        result = future.result()
    assert result.ok, result.reason + "\n" + result.tail
    assert result.spec.device_lock == lock and result.device_wait_s is not None and result.device_wait_s > 0.2
    own = run_probe(_spec(device_lock=str(tmp_path / "own.lock")), timeout_s=120, env={DEVICE_LOCK_ENV: lock})
    assert own.spec.device_lock == str(tmp_path / "own.lock")  # a spec's own lock wins


def test_without_a_lock_nothing_is_waited_for_or_handed_over() -> None:
    result = run_probe(_spec(), timeout_s=120)
    assert result.ok, result.reason
    assert result.device_wait_s is None and result.device_handed_over is None
    assert "device_acquired" not in result.timeline_s and "released" not in result.timeline_s
    assert result.timeline_s["first_step"] <= result.timeline_s["stepped"] < result.timeline_s["exited"]
