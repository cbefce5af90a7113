"""Runtime probe, one process on CPU: real training steps of tiny models in a child process.

Each probe starts a child Python (torch import ~1.5 s), so the tests run several probes in two threads
where they compare recipes. Models come from ``conftest.TINY_TOKEN_MODEL`` (a token model whose forward
misbehaves as ``PROBE_TEST_MODE`` says) and ``examples/mlp.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from sleeping_probe import killed_while_sleeping, pids_in

from optplan.estimators.strategy import Strategy
from optplan.probes.distributed import alive, processes_with_env
from optplan.probes.runtime import ProbeResult, ProbeSpec, run_probe

TINY_PARAMS = 116_160
"""Parameters of TINY_TOKEN_MODEL at width 64, depth 3 (embedding 8,192 + 3 blocks x 33,216 + head 8,320)."""
P4 = 4 * TINY_PARAMS  # fp32 bytes of the parameters


def spec(path: Path, **kw: Any) -> ProbeSpec:
    """A CPU ProbeSpec on the torch engine; Strategy fields and ProbeSpec fields mixed in ``kw``."""
    strategy_keys = set(Strategy.model_fields)
    strat = {"engine": "torch", "precision": "fp32", "mbs": 4}
    strat.update({k: kw.pop(k) for k in list(kw) if k in strategy_keys})
    kw.setdefault("warmup_steps", 1)
    kw.setdefault("timed_steps", 3)
    return ProbeSpec(model_path=str(path), strategy=Strategy(**strat), **kw)


def probe(path: Path, *, env: dict[str, str] | None = None, timeout_s: float = 120, **kw: Any) -> ProbeResult:
    return run_probe(spec(path, **kw), timeout_s=timeout_s, env=env)


def in_parallel(*calls: Any) -> list[ProbeResult]:
    """Run probes ``(path, kwargs)`` two at a time (2 CPU cores)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda c: probe(c[0], **c[1]), calls))




def test_example_mlp_with_full_checkpointing(examples_dir: Path) -> None:
    r = probe(examples_dir / "mlp.py", block_class="MLPBlock", checkpointing="full", mbs=16, grad_accum=2)
    assert r.ok, r.reason + "\n" + r.tail
    assert r.checkpointing_applied == "full"
    assert r.samples_per_step == 32 and len(r.step_times_s) == 3


def test_precision_recipes_change_what_is_held(tiny_lm_file: Path) -> None:
    recipes = ["fp32", "amp-bf16", "amp-fp16", "bf16", "fp16", "bf16-pure"]
    results = dict(zip(recipes, in_parallel(*[(tiny_lm_file, {"precision": p}) for p in recipes]), strict=True))
    for name, r in results.items():
        assert r.ok, f"{name}: {r.reason}\n{r.tail}"
        assert all(x == x for x in r.losses), name
    cat = {name: r.peak_by_category_bytes for name, r in results.items()}
    p2 = P4 // 2
    assert cat["fp32"]["param"] == P4 and cat["amp-bf16"]["param"] == P4  # autocast keeps fp32 weights
    assert cat["bf16-pure"]["param"] == p2  # bf16 weights ...
    assert cat["bf16-pure"]["optimizer"] == pytest.approx(2 * p2, abs=1024)  # ... and bf16 moments
    for name in ("bf16", "fp16"):  # 16-bit weights, fp32 master copy and fp32 moments
        assert cat[name]["param"] == p2 and cat[name]["master"] == P4, name
        assert cat[name]["optimizer"] == pytest.approx(2 * P4, abs=1024), name
    # autocast saves 16-bit activations: less than fp32
    assert cat["amp-bf16"]["activation"] < cat["fp32"]["activation"]


def test_checkpointing_lowers_the_measured_activation_peak(tiny_lm_file: Path) -> None:
    env = {"PROBE_TEST_DEPTH": "4"}
    none, full, sel, part = in_parallel(*[(tiny_lm_file, {"checkpointing": c, "checkpoint_layers": n,
                                                          "block_class": "Block", "mbs": 16, "seq_len": 64, "env": env})
                                          for c, n in (("none", None), ("full", None), ("selective", None),
                                                       ("full", 2))])
    for r in (none, full, sel, part):
        assert r.ok, r.reason + "\n" + r.tail
    assert (none.checkpointing_applied, full.checkpointing_applied, sel.checkpointing_applied) == \
        ("none", "full", "selective")
    act = {n: r.peak_by_category_bytes["activation"] for n, r in (("none", none), ("full", full), ("sel", sel),
                                                                  ("part", part))}
    assert act["full"] < act["sel"] < act["none"]
    # checkpoint_layers 2: the first 2 of the 4 blocks (partial checkpointing), between none and every block
    assert part.checkpointing_applied == "full" and "the first 2 of 4 blocks" in " ".join(part.notes)
    assert act["full"] < act["part"] < act["none"]
    assert part.losses == pytest.approx(none.losses, rel=1e-5)
    assert full.peak_allocated_bytes is not None and none.peak_allocated_bytes is not None
    assert full.peak_allocated_bytes < none.peak_allocated_bytes
    # the same computation: checkpointing does not change the losses
    assert full.losses == pytest.approx(none.losses, rel=1e-5)


def test_checkpointing_without_block_class_is_noted(tiny_lm_file: Path) -> None:
    r = probe(tiny_lm_file, checkpointing="full")
    assert r.ok and r.checkpointing_applied == "none"
    assert any("needs block_class" in n for n in r.notes)


def test_optimizers(tiny_lm_file: Path) -> None:
    sgd, ada, bnb = in_parallel(*[(tiny_lm_file, {"optimizer": o}) for o in ("sgd", "adafactor", "adamw8bit")])
    assert sgd.ok and ada.ok, sgd.reason + ada.reason
    assert sgd.peak_by_category_bytes["optimizer"] == pytest.approx(P4, abs=1024)  # one momentum buffer
    assert ada.peak_by_category_bytes["optimizer"] < P4 // 4  # factored second moment only
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # noqa: BLE001
        assert bnb.status == "error" and "pip install bitsandbytes" in bnb.reason
    else:  # pragma: no cover - bitsandbytes is not installed in CI
        assert bnb.ok or bnb.status == "error"


# ---------------------------------------------------------------------------------------------------
# outcomes
# ---------------------------------------------------------------------------------------------------
def test_memory_cap_gives_oom(tiny_lm_file: Path) -> None:
    r = probe(tiny_lm_file, memory_cap_bytes=100_000)
    assert r.status == "oom" and not r.ok
    assert "exceed the memory cap of 100,000 bytes" in r.reason and "memory-tracked step" in r.reason


def test_nan_loss(tiny_lm_file: Path) -> None:
    r = probe(tiny_lm_file, env={"PROBE_TEST_MODE": "nan"})
    assert r.status == "nan"
    assert r.reason == "loss is nan at step 1 (warm-up)"
    assert r.exit_code == 3


def test_forward_that_raises(tiny_lm_file: Path) -> None:
    r = probe(tiny_lm_file, env={"PROBE_TEST_MODE": "raise"})
    assert r.status == "error"
    assert r.reason == "forward raised RuntimeError: boom in forward"
    assert "in forward" in r.tail and r.tail.endswith("RuntimeError: boom in forward")  # the traceback


def test_segfault_names_the_signal(tiny_lm_file: Path) -> None:
    r = probe(tiny_lm_file, env={"PROBE_TEST_MODE": "segv"})
    assert r.status == "error" and r.exit_code == -11
    assert "SIGSEGV" in r.reason and "code -11" in r.reason
    assert "tiny_lm.py line" in r.reason and "in forward" in r.reason  # faulthandler's innermost frame


def test_timeout_kills_everything(tiny_lm_file: Path, tmp_path: Path) -> None:
    _, pid_file = killed_while_sleeping(partial(probe, tiny_lm_file), tmp_path, (10, 20), ranks=1)
    pids = pids_in(pid_file)
    assert pids, "the child never reached forward"
    assert not [p for p in pids if alive(p)]
    if Path("/proc").is_dir():
        assert processes_with_env(f"PROBE_TEST_PID_FILE={pid_file}") == []


def test_missing_package_in_model_file(write_model: Any) -> None:
    path = write_model("import not_a_real_package_xyz\n", "needs_pkg.py")
    r = probe(path)
    assert r.status == "error"
    assert "not_a_real_package_xyz" in r.reason and "pip install" in r.reason


def test_no_model_in_file(write_model: Any) -> None:
    r = probe(write_model("X = 1\n", "empty.py"))
    assert r.status == "error" and "no model found" in r.reason


def test_slow_step_is_pruned(tiny_lm_file: Path) -> None:
    r = probe(tiny_lm_file, stop_if_step_slower_than_s=0.05, env={"PROBE_TEST_MODE": "slow"})
    assert r.status == "pruned" and not r.ok
    assert "slower than the limit of 0.05 s" in r.reason
    assert len(r.step_times_s) == 1 and r.step_times_s[0] > 0.05
    assert r.exit_code == 0


def test_refused_strategies_do_not_start_a_child(tiny_lm_file: Path) -> None:
    r = probe(tiny_lm_file, tp=2)
    assert r.status == "error" and r.reason.startswith("the probe runs data-parallel strategies only")
    assert r.exit_code is None  # no child process ran
    r = probe(tiny_lm_file, precision="fp8")
    assert r.status == "error" and "Transformer Engine" in r.reason


def test_deepspeed_spec_needs_a_ds_config(tiny_lm_file: Path) -> None:
    with pytest.raises(ValidationError, match="ds_config"):
        ProbeSpec(model_path=str(tiny_lm_file), strategy=Strategy(engine="deepspeed"))


# ---------------------------------------------------------------------------------------------------
# the child imports only torch
# ---------------------------------------------------------------------------------------------------
BLOCKED = ("pydantic", "optuna", "typer", "rich", "yaml", "textual")


def test_child_runs_without_the_planners_dependencies(tiny_lm_file: Path, tmp_path: Path) -> None:
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(spec(tiny_lm_file, block_class="Block", checkpointing="full").model_dump_json())
    code = "\n".join([
        "import sys",
        f"BLOCKED = {BLOCKED!r}",
        "for name in BLOCKED:",
        "    sys.modules[name] = None  # any import of these raises ImportError",
        "import runpy",
        f"sys.argv = ['runtime_child', '--spec', {str(spec_path)!r}, '--out', {str(out_path)!r}]",
        "runpy.run_module('optplan.probes.runtime_child', run_name='__main__', alter_sys=True)",
    ])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out_path.read_text())
    assert doc["status"] == "ok", doc["reason"]
    assert len(doc["step_times_s"]) == 3 and doc["peak_allocated_bytes"] > 4 * P4


# ---------------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_probe_reports_allocator_figures(tiny_lm_file: Path) -> None:  # pragma: no cover - no GPU in CI
    r = probe(tiny_lm_file, device="cuda", precision="amp-bf16", block_class="Block", checkpointing="full")
    assert r.ok, r.reason + "\n" + r.tail
    assert r.peak_allocated_bytes and r.peak_allocated_bytes > 4 * P4
    assert r.peak_reserved_bytes is not None and r.peak_reserved_bytes >= r.peak_allocated_bytes
    assert r.non_torch_bytes is not None and r.non_torch_bytes > 0  # the CUDA context at least
    assert r.device_name and len(r.step_times_s) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_probe_hands_the_device_over_before_it_exits(tiny_lm_file: Path, tmp_path: Path) -> None:  # pragma: no cover - no GPU in CI
    """With a device lock, a finished probe lets go of its model, empties the allocator's cache and releases the
    lock before it exits (probes/device_lock.py), with its memory figures read before that."""
    r = probe(tiny_lm_file, device="cuda", precision="amp-bf16", block_class="Block", device_lock=str(tmp_path / "l"))
    assert r.ok, r.reason + "\n" + r.tail
    assert r.device_handed_over is True, r.device_residue_bytes
    assert r.cuda_initialized_before_lock is False  # the imports before the lock (dynamo, ...) touched no device
    assert r.device_residue_bytes is not None and r.device_residue_bytes <= 256 * 2**20
    assert r.peak_allocated_bytes and r.peak_allocated_bytes > 4 * P4 and r.non_torch_bytes
    t = r.timeline_s
    assert t["device_acquired"] <= t["device_ready"] <= t["measured"] < t["released"] < t["exited"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_memory_cap_gives_oom(tiny_lm_file: Path) -> None:  # pragma: no cover - no GPU in CI
    r = probe(tiny_lm_file, device="cuda", memory_cap_bytes=100_000)
    assert r.status == "oom", r.reason + "\n" + r.tail
    assert "out of memory" in r.reason.lower()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_memory_is_freed_when_a_hung_probe_is_killed(tiny_lm_file: Path, tmp_path: Path) -> None:  # pragma: no cover - no GPU in CI
    """A probe that holds ~1.6 GB on the GPU and hangs in forward: while it hangs the GPU's free memory is
    lower by at least 1 GiB; after the timeout kills it, the memory is back (within 256 MiB) in 10 s. The free
    memory is NVML's: this process creates no CUDA context of its own (run beside other probes, a context here
    would count in their device-wide figures until pytest exits)."""
    from optplan.probes.hardware import PynvmlApi

    nvml = PynvmlApi()
    nvml.init()

    def free() -> int:
        return nvml.memory_info(0).free

    free_before = free()
    pid_file = tmp_path / "pids"
    env = {"PROBE_TEST_MODE": "sleep", "PROBE_TEST_PID_FILE": str(pid_file), "PROBE_TEST_WIDTH": "4096"}
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            # 30 s: the child reaches forward in 6-15 s on the H200 visits (imports, CUDA context); the campaign
            # waits it out
            running = pool.submit(probe, tiny_lm_file, device="cuda", timeout_s=30, env=env)
            deadline = time.monotonic() + 28
            while not pids_in(pid_file) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert pids_in(pid_file), "the probe never reached forward"
            held = free_before - free()
            r = running.result()
        assert r.status == "timeout", r.reason
        assert held > 2**30, f"the probe held only {held / 2**20:.0f} MiB"
        deadline = time.monotonic() + 10
        while free_before - free() > 2**28 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert free_before - free() <= 2**28
        assert not [p for p in pids_in(pid_file) if alive(p)]
    finally:
        nvml.shutdown()


def test_ctrl_c_in_the_parent_leaves_no_probe_process(tiny_lm_file: Path, tmp_path: Path) -> None:
    """SIGINT to the planner while a 2-rank torchrun probe runs: KeyboardInterrupt reaches the caller and the
    whole probe tree (torchrun and both ranks, in sessions of their own) is gone."""
    import os
    import signal
    import textwrap

    pid_file = tmp_path / "pids"
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        from optplan.estimators.strategy import Strategy
        from optplan.probes.runtime import ProbeSpec, run_probe
        spec = ProbeSpec(model_path={str(tiny_lm_file)!r}, strategy=Strategy(engine="torch", dp=2, precision="fp32"),
                         nproc=2, warmup_steps=1, timed_steps=1)
        try:
            run_probe(spec, timeout_s=300, env={{"PROBE_TEST_MODE": "sleep", "PROBE_TEST_PID_FILE": {str(pid_file)!r}}})
        except KeyboardInterrupt:
            print("interrupted")
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while len(pids_in(pid_file)) < 2 and time.monotonic() < deadline:  # both ranks reached forward
        time.sleep(0.2)
    assert len(pids_in(pid_file)) == 2, "the ranks never reached forward"
    os.kill(parent.pid, signal.SIGINT)
    out, _ = parent.communicate(timeout=30)
    assert "interrupted" in out
    time.sleep(0.5)
    assert not [p for p in pids_in(pid_file) if alive(p)]
    assert processes_with_env(f"PROBE_TEST_PID_FILE={pid_file}") == []


def test_deepspeed_16_bit_engines_get_16_bit_inputs(examples_dir: Path) -> None:
    # DeepSpeed's bf16/fp16 engines hold the module in 16 bits and leave the inputs alone: the probe casts
    # float inputs (examples/mlp.py feeds float32 features) as a training script must, or the first matmul
    # fails with "mat1 and mat2 must have the same dtype" (bf16: DeepSpeed refuses fp16 on the CPU)
    from optplan.planner.export.deepspeed import render_ds_config
    from optplan.probes.loader import profile_model_file

    path = examples_dir / "mlp.py"
    s = Strategy(precision="bf16", engine="deepspeed", zero=1, mbs=4)
    config = render_ds_config(s, profile_model_file(path))
    config.pop("optimizer", None)  # a client torch optimizer on the CPU (no fused-Adam build)
    r = run_probe(ProbeSpec(model_path=str(path), strategy=s, ds_config=config, warmup_steps=0, timed_steps=1),
                  timeout_s=240)
    assert r.status == "ok", r.reason
    assert r.losses and all(loss == loss for loss in r.losses)  # finite, not NaN


def test_a_batch_with_more_items_than_forward_takes_trains(write_model: Any) -> None:
    """(images, labels) for a model whose forward takes the images only (torchvision's, timm's): forward gets the
    first item, the loss the whole batch, in the profile (with a note) and in a real training step alike (the
    training loop's call_model; the profile read it as a forward that rejected the batch)."""
    from optplan.probes.contract import forward_arity, load_contract
    from optplan.probes.static import profile_contract

    path = write_model("""
        import torch, torch.nn as nn, torch.nn.functional as F

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(12, 5)

            def forward(self, x):
                return self.fc(x.flatten(1))

        def build_model():
            return Net()

        def example_batch(batch_size, seq_len):
            return torch.randn(batch_size, 3, 2, 2), torch.randint(0, 5, (batch_size,))

        def loss_fn(logits, batch):
            return F.cross_entropy(logits, batch[1])
        """)
    profile = profile_contract(load_contract(path))
    assert any("returns 2 items and forward takes 1: forward gets the first 1, the loss the whole batch" in n
               for n in profile.notes)
    r = probe(path, mbs=4)
    assert r.ok, r.reason + "\n" + r.tail
    import torch.nn as nn

    assert forward_arity(nn.Linear(2, 2)) == 1 and forward_arity(nn.Sequential()) == 1
    compiled = torch.compile(nn.Linear(2, 2))
    assert forward_arity(compiled) == 1  # through the compiled wrapper to the module's own forward

    class Any_(nn.Module):
        def forward(self, *inputs: Any) -> Any:
            return inputs

    assert forward_arity(Any_()) is None
