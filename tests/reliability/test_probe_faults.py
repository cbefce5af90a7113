"""Probe children that fail inside a real ``recommend --probe``: each outcome is recorded, every process is
cleaned up, and the search goes on to a plan.

One run probes the five best candidates, each a 2-rank torchrun on the CPU. The model file makes the
n-th probe fail its own way (probes are told apart by the token optplan gives each one's processes):
a segfault, a hang past ``--probe-timeout``, an allocation the allocator refuses (out of memory), a
rank killed by SIGKILL, and a healthy run. GPU memory being freed needs a GPU: the CPU run checks the
processes that would hold it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from optplan.planner.search import resolve_storage
from optplan.probes.distributed import alive, processes_with_env

PROBE_TIMEOUT_S = 40
FAULTS = ("segv", "hang", "oom", "kill-rank", "ok")

MODEL = """
import fcntl, os, signal, time
import torch
import torch.nn as nn
import torch.nn.functional as F

FAULT_DIR = os.environ.get("TEST_FAULT_DIR", "")
FAULTS = __FAULTS__
OPTPLAN = {"seq_len": 16, "global_batch": 8}


def _fault():
    token = os.environ.get("OPTPLAN_PROBE_TOKEN")
    if not token or not FAULT_DIR:
        return "ok"  # profiling, not a probe
    with open(os.path.join(FAULT_DIR, "tokens"), "a+") as fh:  # the n-th probe to get here: FAULTS[n]
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        seen = fh.read().split()
        if token not in seen:
            fh.write(token + "\\n")
            seen.append(token)
    with open(os.path.join(FAULT_DIR, "pids"), "a") as fh:
        fh.write(f"{os.getpid()}\\n")
    return FAULTS[seen.index(token)] if seen.index(token) < len(FAULTS) else "ok"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.fc = nn.Linear(32, 64)
        self.fault = None

    def forward(self, idx):
        if self.fault is None:
            self.fault = _fault()
        rank = int(os.environ.get("RANK", "0"))
        if self.fault == "segv" and rank == 0:
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.fault == "hang":
            time.sleep(3600)
        if self.fault == "oom" and rank == 0:
            torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the allocator refuses it
        if self.fault == "kill-rank" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.fc(self.emb(idx))


def build_model():
    return Net()


def example_batch(batch_size, seq_len):
    return torch.randint(0, 64, (batch_size, seq_len))


def loss_fn(logits, batch):
    return F.cross_entropy(logits.reshape(-1, 64), batch.reshape(-1))
""".replace("__FAULTS__", repr(FAULTS))

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="process checks read /proc (Linux)")








def _recommend(model: Path, out: Path, fault_dir: Path) -> subprocess.CompletedProcess[str]:
    args = ["recommend", str(model), "--gpu", "H100-SXM", "--gpus", "2", "--no-calibration", "--probe",
            "--probe-nproc", "2", "--probe-top-k", str(len(FAULTS)), "--probe-steps", "1",
            "--probe-timeout", str(PROBE_TIMEOUT_S), "--probe-budget", "900", "--out", str(out), "--force", "--json"]
    env = {**os.environ, "TEST_FAULT_DIR": str(fault_dir)}
    return subprocess.run([sys.executable, "-m", "optplan.tui.cli", *args], env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, float]:  # type: ignore[type-arg]
    root = tmp_path_factory.mktemp("faults")
    model, out, fault_dir = root / "net.py", root / "out", root / "faults"
    model.write_text(MODEL)
    fault_dir.mkdir()
    started = time.monotonic()
    proc = _recommend(model, out, fault_dir)
    took_s = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return root, json.loads(proc.stdout), took_s


def test_every_fault_is_recorded_with_its_cause(faulty_run) -> None:  # type: ignore[no-untyped-def]
    _root, rec, _ = faulty_run
    probed = rec["probes"]["probed"]
    statuses = [p["result"]["status"] for p in probed]
    reasons = [p["result"]["reason"] for p in probed]
    assert statuses == ["error", "timeout", "oom", "error", "ok"], reasons
    assert "SIGSEGV" in reasons[0] and "rank 0" in reasons[0]
    assert reasons[1] == f"killed after {PROBE_TIMEOUT_S} s"
    assert "can't allocate memory" in reasons[2] or "out of" in reasons[2]
    assert reasons[3].startswith("rank 1 exited with code -9 (SIGKILL)")
    assert rec["plan"] is not None  # the search went on to a plan


def test_no_process_of_any_probe_is_left(faulty_run) -> None:  # type: ignore[no-untyped-def]
    root, _rec, _ = faulty_run
    pids = [int(p) for p in (root / "faults" / "pids").read_text().split()]
    assert len(set(pids)) >= 2 * len(FAULTS) - 1  # both ranks of every probe reached forward (one segfaulted first)
    assert not [p for p in pids if alive(p)]
    assert processes_with_env(f"TEST_FAULT_DIR={root / 'faults'}") == []


def test_outcomes_are_in_the_study_and_a_rerun_reuses_them(faulty_run) -> None:  # type: ignore[no-untyped-def]
    root, rec, _ = faulty_run
    storage = resolve_storage(str(root / "out" / "optplan-study.log"))
    study = optuna.load_study(study_name=f"{rec['search']['study_name']}-probes", storage=storage)  # type: ignore[arg-type]
    trials = study.get_trials(deepcopy=False)
    assert [t.user_attrs["status"] for t in trials] == ["error", "timeout", "oom", "error", "ok"]
    assert [t.state.name for t in trials] == ["FAIL", "FAIL", "FAIL", "FAIL", "COMPLETE"]
    again = _recommend(root / "net.py", root / "out", root / "faults")
    assert again.returncode == 0, again.stderr[-3000:]
    redo = json.loads(again.stdout)
    assert redo["probes"]["reused"] == len(FAULTS)  # nothing probed twice: no new token reached forward
    assert len((root / "faults" / "tokens").read_text().split()) == len(FAULTS)
    assert [p["result"]["status"] for p in redo["probes"]["probed"]] == ["error", "timeout", "oom", "error", "ok"]
