"""Ctrl-C in the CLI and in the dashboard: out within 2 s, no child process left, the study consistent,
no partial exports.

Each test runs the real ``optplan`` in a process of its own session and interrupts it as a terminal
does: SIGINT to the whole foreground process group (the CLI), or the Ctrl-C byte typed into the
dashboard's pseudo-terminal. The model file hangs where the test wants the interrupt to land: in the
profiling child (``build_model``) or in a probe's forward (only probes carry ``OPTPLAN_PROBE_TOKEN``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from optplan.probes.distributed import alive, processes_with_env

EXIT_WITHIN_S = 2.0
"""The issue's bound on Ctrl-C to exit (s)."""
READY_TIMEOUT_S = 120.0

MODEL = """
import os, time
import torch
import torch.nn as nn
import torch.nn.functional as F

HANG = os.environ.get("TEST_HANG", "")        # "profile": build_model hangs; "probe": a probe's forward hangs
OPTPLAN = {"seq_len": 16, "global_batch": 8}


def _hang():
    with open(os.environ["TEST_PID_FILE"], "a") as fh:  # read here: each test's own file, not a profile input
        fh.write(f"{os.getpid()}\\n")
    time.sleep(3600)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.fc = nn.Linear(32, 64)

    def forward(self, idx):
        if HANG == "probe" and "OPTPLAN_PROBE_TOKEN" in os.environ:
            _hang()
        return self.fc(self.emb(idx))


def build_model():
    if HANG == "profile":
        _hang()
    return Net()


def example_batch(batch_size, seq_len):
    return torch.randint(0, 64, (batch_size, seq_len))


def loss_fn(logits, batch):
    return F.cross_entropy(logits.reshape(-1, 64), batch.reshape(-1))
"""

BASE = ["--gpu", "H100-SXM", "--gpus", "2", "--no-calibration"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """net.py, written once: the tests that profile it to the end (hangs in a probe) share one profile (the cache
    keys by the file's path) instead of one per test's folder."""
    path = tmp_path_factory.mktemp("ctrl_c") / "net.py"
    path.write_text(MODEL)
    return path


def _env(hang: str, pid_file: Path) -> dict[str, str]:
    return {**os.environ, "TEST_HANG": hang, "TEST_PID_FILE": str(pid_file), "PYTHONUNBUFFERED": "1"}


def _pids(pid_file: Path) -> list[int]:
    try:
        return [int(line) for line in pid_file.read_text().split()]
    except FileNotFoundError:
        return []


def _wait_for_hang(pid_file: Path, proc: subprocess.Popen) -> list[int]:  # type: ignore[type-arg]
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not _pids(pid_file):
        assert proc.poll() is None, f"optplan ended before the hang (code {proc.returncode})"
        assert time.monotonic() < deadline, "the model file never reached its hang"
        time.sleep(0.1)
    time.sleep(0.3)  # the hanging process is inside time.sleep now
    return _pids(pid_file)








def _optplan(args: list[str], env: dict[str, str], **kwargs: object) -> subprocess.Popen:  # type: ignore[type-arg]
    return subprocess.Popen([sys.executable, "-m", "optplan.tui.cli", *args], env=env, start_new_session=True,
                            **kwargs)  # type: ignore[call-overload]


def _interrupt_group(proc: subprocess.Popen) -> float:  # type: ignore[type-arg]
    """SIGINT to the process group, as a terminal's Ctrl-C does; seconds until the CLI exited."""
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return time.monotonic() - started


def _assert_nothing_left(pid_file: Path, hung: list[int]) -> None:
    assert not [p for p in hung if alive(p)], "the hanging child outlived optplan"
    assert processes_with_env(f"TEST_PID_FILE={pid_file}") == [], "a child of optplan is still running"


pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="process checks read /proc (Linux)")


@pytest.fixture(autouse=True)
def _kill_leftovers(tmp_path: Path) -> Iterator[None]:
    """A failing test must not leave its hung children (3600 s sleepers) to the rest of the run."""
    yield
    for pid in processes_with_env(f"TEST_PID_FILE={tmp_path / 'pids'}"):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("where", ["profile", "probe"])
def test_ctrl_c_in_recommend(tmp_path: Path, model: Path, where: str) -> None:
    """Interrupted while the model file is profiled or while a probe runs: exit 130 within 2 s with one
    line, the profiling child / the probe's processes gone, nothing exported, and the same command run
    again finishes from the study and picks what an uninterrupted run picks."""
    pid_file, out = tmp_path / "pids", tmp_path / "out"
    args = ["recommend", str(model), *BASE, "--out", str(out)]
    proc = _optplan([*args, "--probe", "--probe-top-k", "1", "--probe-timeout", "300"], _env(where, pid_file),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hung = _wait_for_hang(pid_file, proc)
    took_s = _interrupt_group(proc)
    stdout, stderr = proc.communicate()
    assert took_s < EXIT_WITHIN_S, f"exit took {took_s:.2f} s"
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and stdout == ""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted"), stderr
    _assert_nothing_left(pid_file, hung)
    written = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert not [n for n in written if not n.startswith((".optplan-study.log", "optplan-study.log"))], written
    if where == "probe":
        assert "resumes" in lines[0] and "optplan-study.log" in lines[0]

    again = subprocess.run([sys.executable, "-m", "optplan.tui.cli", *args, "--no-probe", "--json"],
                           env=_env("", pid_file), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    resumed = json.loads(again.stdout)
    fresh = subprocess.run([sys.executable, "-m", "optplan.tui.cli", "recommend", str(model), *BASE, "--no-probe",
                            "--json"], env=_env("", pid_file), capture_output=True, text=True, timeout=300)
    reference = json.loads(fresh.stdout)
    assert resumed["plan"] == reference["plan"]
    if where == "probe":  # the search had finished: the rerun prices nothing again
        assert resumed["search"]["resumed"] > 0 and resumed["search"]["evaluated"] == 0
    assert (out / "plan.json").is_file()


def test_sigterm_cleans_up_like_ctrl_c(tmp_path: Path, model: Path) -> None:
    """``kill PID`` (SIGTERM: scancel, a container stop) while a probe runs: the same clean-up as Ctrl-C,
    exit 143 within 2 s with one line, no child left."""
    pid_file, out = tmp_path / "pids", tmp_path / "out"
    proc = _optplan(["recommend", str(model), *BASE, "--out", str(out), "--probe", "--probe-top-k", "1",
                     "--probe-timeout", "300"], _env("probe", pid_file),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hung = _wait_for_hang(pid_file, proc)
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    took_s = time.monotonic() - started
    assert took_s < EXIT_WITHIN_S, f"exit took {took_s:.2f} s"
    assert proc.returncode == 143, stderr
    assert stderr.strip().splitlines() == [f"error: terminated: the study in {out / 'optplan-study.log'} resumes "
                                           "when you run the same command again"]
    _assert_nothing_left(pid_file, hung)


@pytest.mark.parametrize("where", ["profile", "probe"])
def test_sigkill_of_optplan_takes_its_children_along(tmp_path: Path, model: Path, where: str) -> None:
    """``kill -9`` (or the OOM killer) of optplan itself, when no cleanup code can run, while the profiler
    child or a 2-rank torchrun probe hangs: the kernel kills them too (parent-death signal), so no orphan
    keeps running (on a GPU: keeps holding memory)."""
    pid_file = tmp_path / "pids"
    proc = _optplan(["recommend", str(model), *BASE, "--probe", "--probe-top-k", "1", "--probe-nproc", "2",
                     "--probe-timeout", "300"], _env(where, pid_file),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    hung = _wait_for_hang(pid_file, proc)
    os.kill(proc.pid, signal.SIGKILL)  # optplan only, not its process group
    proc.wait()
    deadline = time.monotonic() + 10
    while (processes_with_env(f"TEST_PID_FILE={pid_file}") or [p for p in hung if alive(p)]) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    left = processes_with_env(f"TEST_PID_FILE={pid_file}")
    for pid in left:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert left == [], "children outlived optplan"


def test_ctrl_c_while_the_search_records_trials(tmp_path: Path) -> None:
    """SIGINT lands while the search writes its journal (a 12-layer GPT on 16 GPUs: a few seconds of
    recording): exit 130 within 2 s, and the same command then completes from the study (what was recorded
    is kept, nothing is repeated) with the plan a fresh run picks."""
    out = tmp_path / "out"
    args = ["recommend", "--arch", "layers=12,hidden=768,heads=12,vocab=50257,seq=1024", "--gpus", "16",
            "--global-batch", "64", "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = _optplan(args, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    journal = out / "optplan-study.log"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (journal.exists() and journal.stat().st_size > 20_000):  # trials are being recorded
        assert proc.poll() is None, "the search ended before it could be interrupted"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    took_s = _interrupt_group(proc)
    _, stderr = proc.communicate()
    assert took_s < EXIT_WITHIN_S, f"exit took {took_s:.2f} s"
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines() == [f"error: interrupted: the study in {journal} resumes when you run the "
                                           "same command again"]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["optplan-study.log"]
    again = subprocess.run([sys.executable, "-m", "optplan.tui.cli", *args, "--json"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    resumed = json.loads(again.stdout)
    fresh = subprocess.run([sys.executable, "-m", "optplan.tui.cli", *args[:-1], str(tmp_path / "fresh"), "--json"],
                           env=env, capture_output=True, text=True, timeout=300)
    reference = json.loads(fresh.stdout)
    assert resumed["plan"] == reference["plan"]
    recorded, expected = _trials(journal), _trials(tmp_path / "fresh" / "optplan-study.log")
    assert len(recorded) == len(set(recorded))  # no candidate recorded twice
    assert sorted(recorded) == sorted(expected)  # and none missing


def _trials(journal: Path) -> list[str]:
    """The strategies of every finished trial in the journal's one search study (JSON text, sorted keys)."""
    import optuna

    from optplan.planner.search import resolve_storage

    storage = resolve_storage(str(journal))
    (summary,) = [s for s in optuna.get_all_study_summaries(storage) if not s.study_name.endswith("-probes")]  # type: ignore[arg-type]
    study = optuna.load_study(study_name=summary.study_name, storage=storage)  # type: ignore[arg-type]
    return [json.dumps(t.user_attrs["strategy"], sort_keys=True) for t in study.get_trials(deepcopy=False)
            if t.state.is_finished()]


class _Terminal:
    """A pseudo-terminal running the dashboard; what it draws is drained (and kept) by a thread."""

    def __init__(self, args: list[str], env: dict[str, str], *, rows: int = 40, cols: int = 120) -> None:
        import fcntl
        import pty
        import struct
        import termios
        import threading

        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.proc = _optplan(args, {**env, "TERM": "xterm-256color", "COLUMNS": str(cols), "LINES": str(rows)},
                             stdin=slave, stdout=slave, stderr=slave)
        os.close(slave)
        self.chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: the other side closed
                return
            if not data:
                return
            self.chunks.append(data)

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(timeout=5)
        os.close(self.master)


@pytest.mark.parametrize(("where", "key"), [("profile", b"\x03"), ("probe", b"\x03"), ("probe", b"q"),
                                            ("probe", None)],
                         ids=["ctrl-c-profiling", "ctrl-c-probing", "q-probing", "sigterm-probing"])
def test_quitting_the_dashboard(tmp_path: Path, model: Path, where: str, key: bytes | None) -> None:
    """Ctrl-C (or q, or a SIGTERM) in the dashboard while the profiling child or a probe hangs: the
    dashboard is gone within 2 s with the hanging child stopped, says the study resumes, and wrote no
    export."""
    pid_file, out = tmp_path / "pids", tmp_path / "out"
    term = _Terminal(["dashboard", str(model), *BASE, "--probe", "--probe-top-k", "1", "--probe-timeout", "300",
                      "--out", str(out)], _env(where, pid_file))
    try:
        hung = _wait_for_hang(pid_file, term.proc)
        time.sleep(0.5)  # the app is drawn and reading keys
        started = time.monotonic()
        if key is None:
            os.kill(term.proc.pid, signal.SIGTERM)
        else:
            term.type(key)
        term.proc.wait(timeout=30)
        took_s = time.monotonic() - started
    finally:
        term.close()
    assert took_s < EXIT_WITHIN_S, f"exit took {took_s:.2f} s"
    assert term.proc.returncode == (0 if key is not None else 143), term.text()[-2000:]
    assert "Traceback" not in term.text()
    _assert_nothing_left(pid_file, hung)
    written = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert not [n for n in written if not n.startswith((".optplan-study.log", "optplan-study.log"))], written
    if key is None:
        assert "error: terminated" in term.text()
    elif where == "probe":
        assert "search stopped" in term.text() and "resumes" in term.text()
