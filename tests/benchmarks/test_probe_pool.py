"""benchmarks/probe_pool.py: probes run several at a time, taking the device in turn (the campaign's ``--jobs``).

The lock is real (``flock`` on a file, taken by the probe child after its imports and before its first use of the
device, held to its end), so the tests hold it from here and watch a probe wait for it; and the fidelity suite run
with ``jobs=2`` gives the rows, in the suite's order, that the memory figures make exact."""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fidelity  # noqa: E402
from probe_pool import ProbePool  # noqa: E402

from optplan.estimators.strategy import Strategy  # noqa: E402
from optplan.probes.device_lock import held  # noqa: E402
from optplan.probes.runtime import ProbeSpec, run_probe  # noqa: E402

MLP = ROOT / "examples" / "mlp.py"


def _spec(**kw: object) -> ProbeSpec:
    return ProbeSpec(model_path=str(MLP), strategy=Strategy(precision="fp32", optimizer="adamw", mbs=16, engine="torch"),
                     warmup_steps=0, timed_steps=1, **kw)  # type: ignore[arg-type]


def test_a_probe_waits_for_the_device_lock_after_its_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock is held until the probe child marks its wait (``<result>.waiting``, in the probe's own temporary
    folder, under this test's), then for ``hold_s`` more: its start, torch and the model file took 2-5 s on an idle
    2-core VM and over 6 s on a loaded one, so a fixed hold raced it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    lock = tmp_path / "device.lock"
    hold_s = 2.0
    with ThreadPoolExecutor(max_workers=1) as ex, held(lock):
        t0 = time.perf_counter()
        future = ex.submit(run_probe, _spec(device_lock=str(lock)), timeout_s=120)
        waiting: list[Path] = []
        while not waiting and not future.done() and time.perf_counter() - t0 < 120:
            waiting = list(tmp_path.glob("optplan-probe-*/result.json.waiting"))
            time.sleep(0.05)
        assert waiting and not future.done()  # imported, built nothing: waiting for the lock held here
        time.sleep(hold_s)
        released_s = time.perf_counter() - t0
    result = future.result()
    assert result.ok, result.reason + "\n" + result.tail
    assert result.device_wait_s is not None and result.device_acquired_at is not None
    # it waited about the hold after it marked its wait, and never longer than the lock was held
    assert 0.9 * hold_s <= result.device_wait_s < released_s
    assert result.setup_s is not None and result.setup_s >= result.device_wait_s
    alone = run_probe(_spec(), timeout_s=120)  # without a lock: no wait recorded, the same memory
    assert alone.device_wait_s is None and alone.peak_allocated_bytes == result.peak_allocated_bytes


def test_the_lock_is_one_process_only() -> None:
    with pytest.raises(ValidationError, match="one-process"):
        ProbeSpec(model_path=str(MLP), strategy=Strategy(precision="fp32", mbs=4, engine="torch", dp=2), nproc=2,
                  device_lock="/tmp/x.lock")


def test_held_excludes_other_holders_in_the_same_process(tmp_path: Path) -> None:
    lock = tmp_path / "l"
    order: list[str] = []
    def second() -> None:
        with held(lock):
            order.append("second")

    with held(lock):
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.5)
        order.append("first done")
    t.join(10)
    assert order == ["first done", "second"]


def test_ordered_keeps_order_and_one_job_runs_lazily(tmp_path: Path) -> None:
    calls: list[int] = []

    def slow_first(i: int) -> int:
        calls.append(i)
        time.sleep(0.3 if i == 0 else 0.0)
        return i * 10

    with ProbePool(3, tmp_path) as pool:
        assert list(pool.ordered(slow_first, [0, 1, 2, 3])) == [0, 10, 20, 30]
    calls.clear()
    with ProbePool(1, tmp_path) as pool:
        it = pool.ordered(slow_first, [0, 1, 2])
        assert next(it) == 0 and calls == [0]  # the rest not started until asked for
    with pytest.raises(ValueError, match="jobs"):
        ProbePool(0, tmp_path)


def test_the_fidelity_suite_with_two_jobs_gives_every_row_in_order() -> None:
    """The MLP's quick cases (3 probes; the Llama's are the GPU campaign's CPU run's, tests/benchmarks/
    test_gpu_campaign.py, which runs the suite with 3 jobs over both models)."""
    serial_order = [c for c in fidelity.select_cases("cpu", True, {"mlp"})]
    suite = fidelity.run_suite("cpu", quick=True, wanted={"mlp"}, jobs=2)
    assert len(serial_order) >= 3
    assert [(r.model, r.nproc, r.label.split(" ")[0]) for r in suite.rows] == [(c.model, c.nproc, c.precision)
                                                                              for c in serial_order]
    assert set(suite.model_hashes) == {"mlp"}
    for row in suite.rows:
        assert row.ok, (row.label, row.result.reason if row.result else row.skipped)
        assert row.mem_err is not None and row.mem_err < fidelity.CPU_MEMORY_TARGET, row.label
        assert row.result is not None and row.result.device_wait_s is not None
    acquired = sorted(r.result.device_acquired_at for r in suite.rows if r.result and r.result.device_acquired_at)
    assert len(acquired) == len(suite.rows)
