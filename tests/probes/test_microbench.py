"""Microbenchmarks (probes/microbench.py + microbench_child.py) on this machine's CPU: positive, sane
matmul FLOP/s, copy bandwidth and 2-process gloo all-reduce bus bandwidth; the child runs without
pydantic or optuna; timeouts and crashes become one-line MicrobenchErrors. CUDA runs only with a GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from optplan.estimators.ceilings import MeasuredCeilings
from optplan.probes.distributed import alive
from optplan.probes.microbench import (
    MicrobenchError,
    MicrobenchResult,
    _failure_line,
    child_command,
    run_child,
    run_microbench,
)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()





def assert_gone_soon(pid: int, message: str) -> None:
    """``pid`` ends within 5 s; else it is killed (so the run goes on clean) and the test fails."""
    for _ in range(100):
        if not alive(pid):
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(message)


@pytest.fixture(scope="module")
def cpu_result() -> MicrobenchResult:
    return run_microbench(device="cpu", quick=True, allreduce_nproc=2, timeout_s=120)


def test_cpu_matmul_copy_and_allreduce_are_positive_and_sane(cpu_result: MicrobenchResult) -> None:
    r = cpu_result
    assert r.device == "cpu" and r.torch_version and r.device_name
    for dtype in ("fp32", "bf16"):
        assert 1e8 < r.matmul_flops_per_s[dtype] < 1e13, dtype
        assert r.matmul_size[dtype] > 0
    assert "tf32" not in r.matmul_flops_per_s and "fp8" not in r.matmul_flops_per_s  # CUDA-only formats
    assert r.matmul_fast_accum_flops_per_s == {}  # fp8's fast-accumulation GEMM only where fp8 ran
    assert 1e8 < r.copy_bytes_per_s < 1e13 and r.copy_size_bytes >= 2**20
    assert r.allreduce_ranks == 2
    assert r.allreduce_bus_bytes_per_s is not None and 1e5 < r.allreduce_bus_bytes_per_s < 1e12
    assert max(r.allreduce_bus_bytes_per_s_by_size) == r.allreduce_size_bytes
    assert r.allreduce_bus_bytes_per_s_by_size[r.allreduce_size_bytes] == r.allreduce_bus_bytes_per_s
    assert 0 < r.wall_s < 60
    # the head's training GEMMs with an odd vocabulary against a padded one (fp32 only on the CPU): a ratio of two
    # wall-clock timings, so only its presence and sign are checked (a loaded CI core measured 0.15)
    assert set(r.unaligned_gemm_slowdown) == {"fp32"}
    assert 0 < r.unaligned_gemm_slowdown["fp32"] < float("inf")
    assert r.unaligned_gemm_skipped == {}
    shape = r.unaligned_gemm_shape
    assert shape["n"] % 2 == 1 and shape["padded_n"] == shape["n"] + 1 and shape["padded_n"] % 128 == 0
    # causal SDPA on the CPU: torch's own backend only (the forced fused ones are CUDA's), both passes timed
    assert set(r.attention_flops_per_s) == {"default"} and r.attention_skipped == {}
    assert set(r.attention_flops_per_s["default"]) == {128}
    assert all(1e6 < rate < 1e13 for rate in r.attention_flops_per_s["default"][128].values())
    assert r.attention_shape == {"heads": 2, "head_dim": 128, "tokens": 128, "dtype": "float32"}
    (fwd, bwd), = r.attention_fractions(1e12)["default"].values()
    assert fwd == r.attention_flops_per_s["default"][128]["forward"] / 1e12 and bwd > 0


def test_result_turns_into_measured_ceilings(cpu_result: MicrobenchResult) -> None:
    c = cpu_result.ceilings()
    assert isinstance(c, MeasuredCeilings)
    assert c.matmul_flops_per_s["fp32"] == cpu_result.matmul_flops_per_s["fp32"]
    assert c.copy_bytes_per_s == cpu_result.copy_bytes_per_s
    assert c.allreduce_bus_bytes_per_s == cpu_result.allreduce_bus_bytes_per_s
    assert "cpu" in c.source and "2 ranks" in c.source
    assert c.unaligned_gemm_slowdown == cpu_result.unaligned_gemm_slowdown
    odd = cpu_result.model_copy(update={"matmul_flops_per_s": {"fp32": 1e9, "int8": 5e9}})
    assert set(odd.ceilings().matmul_flops_per_s) == {"fp32"}


def test_child_runs_without_pydantic_or_optuna(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    code = textwrap.dedent(f"""
        import runpy, sys
        for name in ("pydantic", "pydantic_core", "optuna", "yaml", "textual"):
            sys.modules[name] = None  # importing them now raises ImportError
        sys.argv = ["microbench_child", "--out", {str(out)!r}, "--device", "cpu", "--quick", "--dtypes", "fp32"]
        try:
            runpy.run_module("optplan.probes.microbench_child", run_name="__main__")
        except SystemExit as exc:
            assert not exc.code, exc.code
        print(sorted(m for m in sys.modules if m.startswith("optplan")))
        """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    # nothing else of optplan than the two standard-library-only process helpers
    assert set(eval(run.stdout.strip())) <= {"optplan", "optplan.probes", "optplan.probes._safe_path",
                                             "optplan.probes._pdeathsig"}
    doc = json.loads(out.read_text())
    assert set(doc["matmul_flops_per_s"]) == {"fp32"} and doc["copy_bytes_per_s"] > 0
    assert doc["device"] == "cpu" and doc["allreduce_bus_bytes_per_s"] is None
    assert not list(tmp_path.glob(".*.tmp"))  # written via a temporary file and renamed


def test_timeout_kills_the_child_and_raises_one_line() -> None:
    t0 = time.monotonic()
    with pytest.raises(MicrobenchError) as info:
        run_microbench(device="cpu", quick=True, timeout_s=0.3)
    assert time.monotonic() - t0 < 15
    msg = str(info.value)
    assert "\n" not in msg and "did not finish within the 0.3 s limit" in msg and "timeout" in msg


def test_timeout_kills_grandchildren_in_their_own_sessions(tmp_path: Path) -> None:
    """torchrun starts its workers with start_new_session=True: they must die with the parent."""
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
            "print('GRANDCHILD', p.pid, file=sys.stderr, flush=True); time.sleep(120)")
    with pytest.raises(MicrobenchError) as info:
        run_child([sys.executable, "-c", code], tmp_path / "none.json", what="test child", timeout_s=1.5)
    pid = int(info.value.detail.split("GRANDCHILD")[1].split()[0])
    assert_gone_soon(pid, "the grandchild survived the timeout")


def test_killed_child_raises_one_line(tmp_path: Path) -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    with pytest.raises(MicrobenchError) as info:
        run_child([sys.executable, "-c", code], tmp_path / "none.json", what="test child", timeout_s=30)
    msg = str(info.value)
    assert "\n" not in msg and "killed by SIGKILL" in msg and "to see its full output" in msg


def test_child_that_writes_nothing_raises(tmp_path: Path) -> None:
    with pytest.raises(MicrobenchError, match="wrote no readable result"):
        run_child([sys.executable, "-c", "pass"], tmp_path / "none.json", what="test child", timeout_s=30)


@pytest.mark.skipif(_cuda_available(), reason="needs a machine without CUDA")
def test_failing_child_reports_its_own_error_line() -> None:
    with pytest.raises(MicrobenchError) as info:
        run_microbench(device="cuda", quick=True, timeout_s=60)
    msg = str(info.value)
    assert "\n" not in msg and "exit code 1" in msg and "torch.cuda.is_available() is False" in msg
    assert "Traceback" in info.value.detail


def test_failure_line_skips_torchrun_decoration() -> None:
    stderr = ("Traceback ...\nmicrobench_child: error: RuntimeError: boom\n"
              "E0101 torchrun: failed\n====================\n")
    assert _failure_line(stderr) == "RuntimeError: boom"
    assert _failure_line("something broke\n*****\n\n") == "something broke"
    assert _failure_line("") == ""


def test_child_commands() -> None:
    plain = child_command("r.json", device="cpu", quick=True)
    assert plain == [sys.executable, "-m", "optplan.probes.microbench_child", "--out", "r.json", "--device",
                     "cpu", "--quick"]
    ar = child_command("r.json", device="cuda", quick=False, allreduce_nproc=4)
    assert ar[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert ar[5:9] == ["-m", "optplan.probes.microbench_child", "--allreduce", "--out"]


def test_bad_arguments_raise_before_running() -> None:
    with pytest.raises(MicrobenchError, match="allreduce_nproc must be >= 0"):
        run_microbench(device="cpu", allreduce_nproc=-1)
    with pytest.raises(MicrobenchError, match="unknown device"):
        run_microbench(device="tpu")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA GPU")
def test_cuda_microbench() -> None:
    import torch

    r = run_microbench(device="cuda", quick=True, timeout_s=300)
    assert r.device == "cuda" and r.device_name == torch.cuda.get_device_name(0)
    for dtype in ("fp32", "tf32", "bf16", "fp16"):
        assert 1e12 < r.matmul_flops_per_s[dtype] < 1e16, dtype
    assert r.matmul_flops_per_s["tf32"] > r.matmul_flops_per_s["fp32"]  # TF32 really was off for fp32
    if torch.cuda.get_device_capability() >= (8, 9):
        assert r.matmul_flops_per_s["fp8"] > r.matmul_flops_per_s["bf16"]
        # fast accumulation (Transformer Engine's forward GEMMs) is never slower than full-precision accumulation
        assert r.matmul_fast_accum_flops_per_s["fp8"] > 0.95 * r.matmul_flops_per_s["fp8"], r.matmul_skipped
    assert 1e11 < r.copy_bytes_per_s < 2e13
    assert set(r.unaligned_gemm_slowdown) == {"bf16", "fp16", "fp32"}
    assert all(0.5 < s < 50 for s in r.unaligned_gemm_slowdown.values()), r.unaligned_gemm_slowdown
    # torch's own SDPA pick and FlashAttention-2 run on every CUDA GPU it supports, at every quick sequence length
    for backend in ("default", "flash"):
        assert set(r.attention_flops_per_s[backend]) == {2048, 8192, 32768}, r.attention_skipped
        assert all(1e12 < x < 3e15 for seq in r.attention_flops_per_s[backend].values() for x in seq.values())
    if torch.cuda.device_count() > 1:
        assert r.allreduce_ranks == torch.cuda.device_count() and r.allreduce_bus_bytes_per_s > 1e9
    else:
        assert r.allreduce_bus_bytes_per_s is None


def test_cancel_kills_the_child_and_its_grandchildren(tmp_path: Path) -> None:
    """The dashboard's quit during a microbenchmark: Cancelled within a poll, and nothing left running."""
    from optplan.estimators.errors import Cancelled

    pid_file = tmp_path / "grandchild"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    started = time.monotonic()
    with pytest.raises(Cancelled):
        run_child([sys.executable, "-c", code], tmp_path / "none.json", what="test child", timeout_s=60,
                  cancelled=lambda: pid_file.exists() and bool(pid_file.read_text()))
    assert time.monotonic() - started < 30  # long before the 60 s timeout
    pid = int(pid_file.read_text())
    assert_gone_soon(pid, "the grandchild survived the cancel")


def _marked(mark: str) -> list[tuple[int, str]]:
    """(pid, command line) of live processes whose environment holds ``mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark.encode() in (entry / "environ").read_bytes() and alive(int(entry.name)):
                    found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
            except OSError:
                continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_kill_9_of_the_parent_takes_the_allreduce_workers_along(tmp_path: Path) -> None:
    """torchrun starts its workers in sessions of their own; with optplan SIGKILLed (no clean-up runs)
    the kernel still kills torchrun and both workers (each arms the parent-death signal)."""
    mark = f"OPTPLAN_TEST_MARK={tmp_path}"
    code = ("from optplan.probes.microbench import run_microbench; "
            f"run_microbench(device='cpu', quick=True, allreduce_nproc=2, env={{'OPTPLAN_TEST_MARK': {str(tmp_path)!r}}})")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len([c for _, c in _marked(mark) if "--allreduce" in c and "torch.distributed.run" not in c]) < 2:
        assert parent.poll() is None, "the microbenchmark ended before its all-reduce workers were seen"
        assert time.monotonic() < deadline, "the all-reduce workers never started"
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _marked(mark)
    for pid, _ in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []
