"""probes/device_lock.py: probes share one device in turn, and a finished probe hands the device on before it exits.

The lock is a real ``flock``; the probes are real child processes (the MLP example on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from optplan.estimators.strategy import Strategy
from optplan.probes.device_lock import DEVICE_LOCK_ENV, acquire, lock_from_env, process_alive
from optplan.probes.device_lock import held as device_held
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
    handed: list[bool] = []

    def take_after_the_probe_has_it() -> None:
        deadline = time.monotonic() + 60
        while lock.stat().st_size == 0 if lock.exists() else True:  # until the child wrote "<pid> holding"
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        held = acquire(str(lock))
        taken_at.append(time.time())
        handed.append(held.previous_handed)
        held.release()

    watcher = threading.Thread(target=take_after_the_probe_has_it)
    watcher.start()
    result = run_probe(_spec(device_lock=str(lock)), timeout_s=120)
    watcher.join(60)
    assert result.ok, result.reason + "\n" + result.tail
    assert result.device_handed_over is True and result.device_residue_bytes == 0  # no tensor left alive
    t = result.timeline_s
    assert list(MARKS) == [m for m in t if m in MARKS]  # recorded in this order
    assert [t[m] for m in MARKS] == sorted(t[m] for m in MARKS)
    assert result.setup_s is not None and t["device_acquired"] <= result.setup_s <= t["first_step"]
    started_at = result.device_acquired_at - t["device_acquired"]  # type: ignore[operator]
    exited_at = started_at + t["exited"]
    assert taken_at and taken_at[0] < exited_at  # the lock was free before the child was gone
    assert handed == [True]  # the child wrote "<pid> handed": the next holder need not wait before its device work
    assert lock.read_text().split() == [str(os.getpid()), "holding"]  # the last holder: this test's thread


def test_the_next_holder_waits_for_the_previous_to_exit_before_its_memory_figure(tmp_path: Path) -> None:
    """The pid the hand-over wrote is read by the next holder, which waits for that process to be gone."""
    lock = tmp_path / "device.lock"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    lock.write_text(f"{sleeper.pid} holding\n")  # it kept the device to its exit
    held = acquire(str(lock))
    try:
        assert held.previous_pid == sleeper.pid and not held.previous_handed and process_alive(sleeper.pid)
        waiter = threading.Thread(target=sleeper.wait)  # reaps it, as the probe's parent would
        waiter.start()
        waited = held.wait_for_previous_exit(timeout_s=20)
        waiter.join(10)
        assert 0.5 < waited < 15 and not process_alive(sleeper.pid)
    finally:
        held.release()
    mine = acquire(str(lock))
    assert mine.previous_pid == os.getpid() and not mine.previous_handed  # each holder writes "<pid> holding"
    assert mine.wait_for_previous_exit() == 0.0  # not for itself
    mine.release()
    with device_held(lock) as parent:  # a parent holding it around its children records no pid of its own
        assert parent is not None and parent.previous_pid == os.getpid()
    assert lock.read_text() == ""


def test_a_zombie_counts_as_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process_alive(child.pid):  # exited, not yet reaped: a zombie
        time.sleep(0.05)
    assert not process_alive(child.pid)
    child.wait()
    assert process_alive(os.getpid())


def test_the_environment_variable_gives_one_process_probes_the_lock(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the probe's folder, for its .waiting marker
    lock = str(tmp_path / "env.lock")
    assert lock_from_env({DEVICE_LOCK_ENV: lock}) == lock
    assert lock_from_env({DEVICE_LOCK_ENV: "  "}) is None and lock_from_env({}) is None
    with ThreadPoolExecutor(max_workers=1) as ex:
        held = acquire(lock)
        future = ex.submit(run_probe, _spec(), timeout_s=120, env={DEVICE_LOCK_ENV: lock})
        deadline = time.monotonic() + 60  # until the child waits for the lock (its imports take 2-10 s)
        while not list(tmp_path.glob("optplan-probe-*/result.json.waiting")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert not future.done()  # waiting for the lock this test holds
        held.release()
        result = future.result()
    assert result.ok, result.reason + "\n" + result.tail
    assert result.spec.device_lock == lock and result.device_wait_s is not None and result.device_wait_s > 0.2
    own = run_probe(_spec(device_lock=str(tmp_path / "own.lock")), timeout_s=120, env={DEVICE_LOCK_ENV: lock})
    assert own.spec.device_lock == str(tmp_path / "own.lock")  # a spec's own lock wins


def test_a_probe_of_several_processes_waits_for_the_lock_in_the_parent(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """$OPTPLAN_DEVICE_LOCK and two ranks: the ranks cannot take the lock (they would wait on each other), so
    run_probe holds it around the whole child: the child starts only once this test lets the lock go."""
    import optplan.probes.runtime as runtime

    lock = str(tmp_path / "env.lock")
    started: list[float] = []

    def fake_child(spec: ProbeSpec, base: dict, *_: object) -> runtime.ProbeResult:
        started.append(time.monotonic())
        return runtime.ProbeResult(**base, status="ok")

    monkeypatch.setattr(runtime, "_run_child", fake_child)
    spec = ProbeSpec(model_path=str(MLP), strategy=Strategy(precision="fp32", mbs=4, engine="torch", dp=2), nproc=2)
    with ThreadPoolExecutor(max_workers=1) as ex:
        held = acquire(lock)
        future = ex.submit(run_probe, spec, timeout_s=60, env={DEVICE_LOCK_ENV: lock})
        time.sleep(1.0)
        assert not started  # waiting in the parent
        released = time.monotonic()
        held.release()
        result = future.result()
    assert result.ok and started and started[0] >= released
    assert result.spec.device_lock is None  # no rank takes it
    assert Path(lock).read_text() == ""  # the parent records no pid of its own


def test_the_lock_wait_does_not_count_against_the_timeout(tmp_path: Path) -> None:
    """The deadline moves out by the seconds ``paused`` reports (the child's lock wait, from its marker files)."""
    from optplan.probes.runtime import _lock_wait_s
    from optplan.probes.waiting import communicate_until

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2.0)"])
    with pytest.raises(subprocess.TimeoutExpired):
        communicate_until(proc, timeout_s=0.5, paused=lambda: 0.0)
    communicate_until(proc, timeout_s=0.5, paused=lambda: 10.0)  # the wait is not counted: it finishes
    assert proc.returncode == 0
    out = tmp_path / "result.json"
    assert _lock_wait_s(out) == 0.0  # not waiting yet
    now = time.time()
    waiting = Path(f"{out}.waiting")
    waiting.touch()
    os.utime(waiting, (now - 5.0, now - 5.0))
    assert 4.9 < _lock_wait_s(out) < 7.0  # still waiting: until now
    acquired = Path(f"{out}.acquired")
    acquired.touch()
    os.utime(acquired, (now - 2.0, now - 2.0))
    assert _lock_wait_s(out) == pytest.approx(3.0, abs=0.01)


def test_a_locked_probe_marks_its_wait_for_the_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child creates ``<result>.waiting`` before the lock and ``<result>.acquired`` once it holds it (in the
    probe's own temporary folder, under this test's)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    lock = str(tmp_path / "device.lock")
    seen: list[str] = []
    with ThreadPoolExecutor(max_workers=1) as ex:
        held = acquire(lock)
        future = ex.submit(run_probe, _spec(device_lock=lock), timeout_s=120)
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:
            seen = [p.name for p in tmp_path.glob("optplan-probe-*/result.json.*")]
            time.sleep(0.05)
        assert seen == ["result.json.waiting"]  # not acquired: this test holds the lock
        time.sleep(0.5)  # held well past the marker: a release right at it let the child wait only ~0.05 s (a CI flake)
        held.release()
        result = future.result()
    assert result.ok and result.device_wait_s is not None and result.device_wait_s > 0.05


def test_without_a_lock_nothing_is_waited_for_or_handed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEVICE_LOCK_ENV, raising=False)
    result = run_probe(_spec(), timeout_s=120)
    assert result.ok, result.reason
    assert result.device_wait_s is None and result.device_handed_over is None
    assert "device_acquired" not in result.timeline_s and "released" not in result.timeline_s
    assert result.timeline_s["first_step"] <= result.timeline_s["stepped"] < result.timeline_s["exited"]


@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
def test_the_drop_before_the_hand_over_leaves_no_tensor_alive(engine: str, tmp_path: Path) -> None:
    """What a probe drops before handing the device over frees every tensor: on the CPU the residue is the bytes
    still alive. DeepSpeed's ZeRO-1 engine needs ``destroy()`` for it (without it 34 MB of the MLP's flat buffers
    stayed; on the seventh H200 visit the Llama's ZeRO-1 and ZeRO-2 probes kept 19.9 GB reserved)."""
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    ds = {"ds_config": {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
                        "zero_optimization": {"stage": 1},
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}}
    spec = ProbeSpec(model_path=str(MLP), strategy=Strategy(precision="fp32", optimizer="adamw", mbs=16, engine=engine,
                                                            zero=1 if engine == "deepspeed" else 0),
                     warmup_steps=1, timed_steps=1, device_lock=str(tmp_path / "device.lock"),
                     **(ds if engine == "deepspeed" else {}))  # type: ignore[arg-type]
    result = run_probe(spec, timeout_s=300)
    assert result.ok, result.reason + "\n" + result.tail
    assert result.peak_allocated_bytes and result.peak_allocated_bytes > 30 * 2**20
    assert result.device_handed_over is True and result.device_residue_bytes == 0


def test_a_gpu_test_run_beside_probes_holds_the_device_lock(tmp_path: Path) -> None:
    """$OPTPLAN_DEVICE_LOCK set (the campaign's gpu_tests beside its fidelity section): a test marked gpu holds the
    lock for its body, with the variable removed; the lock is free again after."""
    lock = tmp_path / "device.lock"
    env = {**os.environ, DEVICE_LOCK_ENV: str(lock), "OPTPLAN_TEST_LOCK_FILE": str(lock)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           str(Path(__file__).with_name("lock_fixture_check.py"))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    # "." alone: one test, passed (pyproject's -q and this -q leave no summary line)
    assert proc.returncode == 0 and proc.stdout.split()[0] == ".", proc.stdout[-2000:] + proc.stderr[-2000:]
    free = acquire(str(lock))
    assert free.held
    free.release()
