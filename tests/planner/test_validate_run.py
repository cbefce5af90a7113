"""planner/validate_run.py's preparation of exported files for a local run (no run here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from optplan.planner.probe_stage import LocalDevices
from optplan.planner.validate_run import _accelerate_config_for_run, _runnable_ds_config

CPU = LocalDevices(device="cpu", name="cpu", count=1)
GPU = LocalDevices(device="cuda", name="NVIDIA H100 80GB HBM3", count=1, catalogue_name="H100-SXM")
DS = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True}}


def _export(folder: Path, ref: str = "ds_config.json") -> Path:
    (folder / "ds_config.json").write_text(json.dumps(DS))
    path = folder / "accelerate.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED",
                                    "deepspeed_config": {"deepspeed_config_file": ref}}))
    return path


def test_a_relative_deepspeed_config_file_becomes_absolute_and_torch_adam_where_needed(tmp_path: Path) -> None:
    export, scratch = tmp_path / "plan", tmp_path / "scratch"
    export.mkdir()
    scratch.mkdir()
    notes: list[str] = []
    run_yaml = _accelerate_config_for_run(_export(export), scratch, CPU, notes)
    assert run_yaml.parent == scratch and (export / "accelerate.yaml").read_text().count("ds_config.json") == 1
    ref = Path(yaml.safe_load(run_yaml.read_text())["deepspeed_config"]["deepspeed_config_file"])
    assert ref.is_absolute() and ref.parent == scratch  # a copy: the exported ds_config.json is untouched
    assert json.loads(ref.read_text())["optimizer"]["params"] == {"lr": 1e-4, "torch_adam": True}
    assert json.loads((export / "ds_config.json").read_text()) == DS
    assert any("torch_adam" in n for n in notes)


def test_without_nvcc_a_gpu_run_uses_torch_adam_and_with_it_the_fused_kernel(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    notes: list[str] = []
    assert _runnable_ds_config(DS, GPU, notes)["optimizer"]["params"]["torch_adam"] is True
    assert "no nvcc" in notes[0]
    _runnable_ds_config(DS, GPU, notes)  # an accelerate.yaml run asks twice: its note is said once
    assert len(notes) == 1
    monkeypatch.setattr("shutil.which", lambda name: "/usr/local/cuda/bin/nvcc")
    assert _runnable_ds_config(DS, GPU, []) is DS  # DeepSpeed builds its fused Adam


def test_an_absolute_reference_that_needs_nothing_is_used_as_is(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: "/usr/local/cuda/bin/nvcc")
    path = _export(tmp_path, ref=str(tmp_path / "ds_config.json"))
    assert _accelerate_config_for_run(path, tmp_path / "unused", GPU, []) == path


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16", "amp-fp16", "bf16", "fp16", "bf16-pure"])
def test_a_ds_config_alone_reads_back_the_precision_it_was_exported_with(precision: str) -> None:
    """validate on a ds_config.json without its plan.json prices the recipe the file runs: the torch_autocast
    section of the AMP recipes included (it was read as fp32)."""
    from optplan.estimators.buckets import DeepSpeedBuckets
    from optplan.estimators.strategy import Strategy
    from optplan.planner.export.deepspeed import render_ds_config
    from optplan.planner.validate_run import strategy_from_ds_config

    s = Strategy(engine="deepspeed", zero=2, dp=4, mbs=2, grad_accum=3, precision=precision)  # type: ignore[arg-type]
    buckets = DeepSpeedBuckets(reduce_bucket_size=1, allgather_bucket_size=1, stage3_prefetch_bucket_size=1,
                               stage3_param_persistence_threshold=1, stage3_max_live_parameters=1)
    back = strategy_from_ds_config(render_ds_config(s, buckets))
    assert (back.precision, back.zero, back.dp, back.mbs, back.grad_accum) == (precision, 2, 4, 2, 3)


def test_a_plan_for_another_model_file_is_refused(tmp_path: Path) -> None:
    from optplan.estimators.errors import OptplanError
    from optplan.planner.validate_run import check_same_model

    class Plan:
        model_path = "examples/gpt2.py"

    class Profile:
        path = "/work/examples/mlp.py"

    with pytest.raises(OptplanError, match="was planned for examples/gpt2.py, not /work/examples/mlp.py"):
        check_same_model(Plan(), Profile(), tmp_path / "ds_config.json")  # type: ignore[arg-type]
    Profile.path = "/elsewhere/gpt2.py"  # the same file name in a copied folder: taken as the same model
    check_same_model(Plan(), Profile(), tmp_path / "ds_config.json")  # type: ignore[arg-type]


def test_runs_together_stop_when_one_fails_or_the_caller_is_interrupted() -> None:
    """validate --jobs: an error (or Ctrl-C) while waiting cancels the other runs: a running one sees
    ``cancelled()`` (run_probe then stops its whole process tree), one not started never starts."""
    import time

    from optplan.estimators.strategy import Strategy
    from optplan.planner.validate_run import _run_together
    from optplan.probes.runtime import ProbeSpec

    specs = [ProbeSpec(model_path=f"m{i}.py", strategy=Strategy(engine="torch", mbs=1)) for i in range(3)]
    stopped: list[str] = []
    started: list[str] = []

    def runner(spec, *, timeout_s, cancelled, env):  # noqa: ANN001, ANN202
        assert env["OPTPLAN_QUIET_GROUP"] and env["OPTPLAN_DEVICE_LOCK"] == "x.lock"  # one group, one lock
        started.append(spec.model_path)
        if spec.model_path == "m0.py":
            time.sleep(0.2)
            raise KeyboardInterrupt  # as Ctrl-C reaching the wait
        deadline = time.monotonic() + 30
        while not cancelled() and time.monotonic() < deadline:
            time.sleep(0.01)
        stopped.append(spec.model_path)
        raise RuntimeError("cancelled")

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        _run_together(specs, runner, timeout_s=60, jobs=2, lock="x.lock")
    assert time.monotonic() - t0 < 10  # not the 30 s a run would wait uncancelled
    # every run that started (the third may have, on the worker m0 freed) saw the cancel
    assert {"m0.py", "m1.py"} <= set(started) and sorted(stopped) == sorted(p for p in started if p != "m0.py")
