"""planner/results.py: results files -> one calibration per (GPU, model, torch), and what it buys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optplan.estimators.errors import OptplanError
from optplan.estimators.strategy import Strategy
from optplan.planner.calibrate import ProbeComparison, load_calibration
from optplan.planner.results import RESULTS_FORMAT, MeasuredCase, calibrations_from_results, read_results
from optplan.probes.runtime import ProbeResult, ProbeSpec
from optplan.tui.cli import app

runner = CliRunner()


def _case(mbs: int, predicted_s: float, measured_s: float, *, gpu: str = "H100-SXM", model_hash: str = "abc",
          allocated: int = 1000, measured_bytes: int = 1100, status: str = "ok") -> dict:
    s = Strategy(precision="bf16", engine="torch", mbs=mbs)
    spec = ProbeSpec(model_path="m.py", strategy=s, device="cuda")
    result = ProbeResult(spec=spec, status=status, step_s=measured_s if status == "ok" else None,  # type: ignore[arg-type]
                         step_times_s=(measured_s,) if status == "ok" else (), torch_version="2.6.0",
                         peak_allocated_bytes=measured_bytes if status == "ok" else None,
                         peak_reserved_bytes=int(measured_bytes * 1.1) if status == "ok" else None,
                         reason="" if status == "ok" else "CUDA out of memory")
    comp = ProbeComparison(candidate=s, probed=s, predicted_step_s=predicted_s, predicted_on_device_s=predicted_s,
                           predicted_exposed_comm_s=0.0, predicted_allocated_bytes=allocated,
                           predicted_total_bytes=allocated + 500, time_comparable=True, result=result)
    return MeasuredCase(gpu=gpu, model="m", model_hash=model_hash, torch_version="2.6.0",
                        comparison=comp).model_dump(mode="json")


def _file(path: Path, measured: list[dict]) -> Path:
    path.write_text(json.dumps({"format": RESULTS_FORMAT, "env": {}, "measured": measured}))
    return path


def test_one_fit_per_gpu_model_and_torch_across_files(tmp_path: Path) -> None:
    a = _file(tmp_path / "a.json", [_case(1, 0.10, 0.12), _case(2, 0.20, 0.24)])
    b = _file(tmp_path / "b.json", [_case(4, 0.40, 0.48), _case(1, 0.1, 0.2, model_hash="other"),
                                    _case(8, 0.8, 0.0, status="oom")])
    fits = calibrations_from_results([a, b])
    assert [(f.calibration.model_hash, f.runs) for f in fits] == [("abc", 4), ("other", 1)]
    main = fits[0]
    assert main.calibration.compute_scale == pytest.approx(1.2) and main.calibration.time_probes == 3
    assert main.calibration.allocated_scale == pytest.approx(1.1)
    assert main.time_error_before_pct == pytest.approx(100 / 6) and main.time_error_after_pct == pytest.approx(0)
    assert main.memory_error_before_pct == pytest.approx(100 / 11) and main.memory_error_after_pct == pytest.approx(0)
    assert "step time error 16.7% -> 0.0%" in main.line()


def test_a_scale_that_fits_its_own_runs_worse_than_none_is_not_kept(tmp_path: Path) -> None:
    """Two runs 1.3x and 5.4x slower than predicted (the H200 visit's timm ResNet-50 in fp32 and under AMP): their
    median scale, 3.35, would put both 1.6-2.6x off; the step time stays uncalibrated, memory is still fitted."""
    f = _file(tmp_path / "a.json", [_case(1, 0.010, 0.013), _case(2, 0.010, 0.054)])
    (fit,) = calibrations_from_results([f])
    cal = fit.calibration
    assert (cal.compute_scale, cal.comm_scale, cal.time_probes) == (1.0, 1.0, 0) and not cal.calibrates_time
    assert cal.allocated_scale == pytest.approx(1.1) and cal.memory_probes == 2
    assert fit.time_error_after_pct == pytest.approx(fit.time_error_before_pct)
    assert "step time not calibrated" in fit.line() and "1.30-5.40" in fit.line()
    # one run, or runs one scale fits, are calibrated as before
    (one,) = calibrations_from_results([_file(tmp_path / "b.json", [_case(1, 0.010, 0.054)])])
    assert one.calibration.compute_scale == pytest.approx(5.4) and one.calibration.time_probes == 1


def test_the_cli_writes_the_cache_that_plans_read(tmp_path: Path) -> None:
    f = _file(tmp_path / "r.json", [_case(1, 0.10, 0.15), _case(2, 0.2, 0.3)])
    cache = tmp_path / "cache.json"
    out = runner.invoke(app, ["calibrate", str(f), "--cache", str(cache)])
    assert out.exit_code == 0, out.stderr
    cal = load_calibration("H100-SXM", "abc", "2.6.0", path=cache)
    assert cal is not None and cal.compute_scale == pytest.approx(1.5) and cal.source.startswith("results files")


@pytest.mark.parametrize(("text", "needle"), [
    ("not json", "is not JSON"),
    ('{"format": "other", "measured": []}', "neither a train.py measurements file"),
    ("[]", "pass the measurements.json an exported train.py wrote"),
    (json.dumps({"format": RESULTS_FORMAT, "measured": [{"gpu": "H100-SXM"}]}), "measured[0].model"),
])
def test_bad_results_files_are_one_line(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(OptplanError, match=None) as err:
        read_results(f)
    assert needle in str(err.value) and "\n" not in str(err.value)
    out = runner.invoke(app, ["calibrate", str(f), "--cache", str(tmp_path / "c.json")])
    assert out.exit_code == 2 and needle in out.stderr and not (tmp_path / "c.json").exists()


def test_nothing_measured_is_an_error_not_an_empty_cache(tmp_path: Path) -> None:
    f = _file(tmp_path / "r.json", [_case(1, 0.1, 0.0, status="oom")])
    out = runner.invoke(app, ["calibrate", str(f), "--cache", str(tmp_path / "c.json")])
    assert out.exit_code == 2 and "nothing to calibrate" in out.stderr and not (tmp_path / "c.json").exists()
    missing = runner.invoke(app, ["calibrate", str(tmp_path / "nope.json")])
    assert missing.exit_code == 2 and "not found" in missing.stderr


VISIT4 = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "2026-11-28-H200-visit4"


@pytest.mark.parametrize("call", ["c1a", "c2a"])
def test_a_gpu_train_py_run_calibrates_the_release_plans_look_up(call: str, tmp_path: Path) -> None:
    """The fourth H200 visit's launched train.py (torch and DeepSpeed plans of GPT-2): its measurements.json records
    ``torch.__version__`` (2.11.0+cu130) while the planner looks calibrations up by the package metadata's version
    (2.11.0, what the plan's prediction carries). The calibration must be found under the latter, and it must
    reproduce the run it was fitted on."""
    run = json.loads((VISIT4 / call / "launch.json").read_text())["runs"][0]
    doc = run["measurements"]
    pred = doc["plan"]["prediction"]
    assert doc["software"]["torch"] == "2.11.0+cu130" and pred["torch_version"] == "2.11.0"
    path = tmp_path / "measurements.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    cache = tmp_path / "cache.json"
    out = runner.invoke(app, ["calibrate", str(path), "--cache", str(cache), "--json"])
    assert out.exit_code == 0, out.stderr
    (fit,) = json.loads(out.stdout)["calibrations"]
    assert fit["time_error_before_pct"] > 15 and fit["time_error_after_pct"] == pytest.approx(0, abs=0.5)
    cal = load_calibration("H200", pred["model_hash"], pred["torch_version"], path=cache)
    assert cal is not None and cal.time_probes == 1 and cal.memory_probes == 1
    measured = doc["measured"]["step_s"]
    calibrated = cal.compute_scale * pred["uncalibrated_on_device_s"] + cal.comm_scale * pred["uncalibrated_exposed_comm_s"]
    assert calibrated == pytest.approx(measured, rel=0.01)
    assert load_calibration("H200", pred["model_hash"], "2.11.0+cu130", path=cache) == cal  # either spelling



@pytest.mark.parametrize(("field", "value"), [("step_s", -1), ("step_s", 0), ("peak_allocated_bytes", -5)])
def test_an_impossible_measurement_is_refused_not_folded_in(field: str, value: float, tmp_path: Path) -> None:
    """A measurements.json with a negative or zero step time (or negative bytes) is one line naming the field and
    its value, exit 2, and no cache is written (it was folded in as a -100 % error before)."""
    doc = json.loads((VISIT4 / "c1a" / "launch.json").read_text())["runs"][0]["measurements"]
    doc["measured"][field] = value
    path = tmp_path / "measurements.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    cache = tmp_path / "cache.json"
    out = runner.invoke(app, ["calibrate", str(path), "--cache", str(cache)])
    assert out.exit_code == 2 and f"{field} is {value}" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not cache.exists()

def test_a_gpu_runs_measurements_improve_the_next_plan_end_to_end(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17's loop through the user's commands: ``recommend --out`` writes train.py; a run of it on the plan's GPU
    writes measurements.json (here: its PLAN with a measured step 1.5x the prediction and 2 % more allocated bytes,
    the torch version spelled as ``torch.__version__`` spells a CUDA build); ``optplan calibrate`` folds it into the
    cache; the next ``recommend`` of the same model and GPU starts from that calibration (the fourth H200 visit found
    this link broken by the version's local label)."""
    import runpy

    from optplan.planner.calibrate import torch_version

    monkeypatch.setenv("OPTPLAN_CACHE_DIR", str(tmp_path / "cache"))
    model = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"
    args = ["recommend", str(model), "--gpus", "1", "--gpu", "H100-SXM", "--global-batch", "64", "--engine", "torch",
            "--no-probe", "--json"]
    first = runner.invoke(app, [*args, "--out", str(tmp_path / "plan")])
    assert first.exit_code == 0, first.stderr
    plan = runpy.run_path(str(tmp_path / "plan" / "train.py"), run_name="not_main")["PLAN"]
    pred = plan["prediction"]
    step_s = 1.5 * pred["uncalibrated_step_s"]
    allocated = int(1.02 * pred["allocated_bytes"])
    doc = {"format": "optplan-measurements/1", "plan": plan,
           "measured": {"status": "ok", "steps": 6, "warmup_steps": 2, "step_times_s": [3 * step_s] * 2 + [step_s] * 4,
                        "step_s": step_s, "peak_allocated_bytes": allocated,
                        "peak_reserved_bytes": int(1.1 * allocated), "non_torch_bytes": 600 * 2**20},
           "cluster": {"world_size": 1, "procs_per_node": 1, "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3"},
           "software": {"torch": torch_version().split("+")[0] + "+cu130"}}
    measurements = tmp_path / "measurements.json"
    measurements.write_text(json.dumps(doc), encoding="utf-8")
    cal = runner.invoke(app, ["calibrate", str(measurements), "--json"])
    assert cal.exit_code == 0, cal.stderr
    (fit,) = json.loads(cal.stdout)["calibrations"]
    assert fit["time_error_before_pct"] == pytest.approx(100 / 3, rel=1e-3) and fit["time_error_after_pct"] < 0.5
    second = runner.invoke(app, args)
    assert second.exit_code == 0, second.stderr
    before, after = json.loads(first.stdout), json.loads(second.stdout)
    assert before["calibration"] is None and after["calibration"] is not None
    assert after["calibration"]["compute_scale"] == pytest.approx(fit["calibration"]["compute_scale"])
    if after["plan"] == before["plan"]:  # the same pick: its step is now the measured one
        assert after["estimate"]["time"]["step_s"] == pytest.approx(step_s, rel=0.02)


def test_runs_recorded_before_the_loop_compiled_its_loss_are_priced_as_the_eager_loss_they_ran(tmp_path: Path) -> None:
    """A recorded plan with compile and no ``compile_loss`` ran its loss eagerly (the loop compiled blocks only then):
    it reads back as ``compile_loss: false``; a file that records the key keeps what it says."""
    old = _case(4, 0.1, 0.1)
    for key in ("candidate", "probed"):
        old["comparison"][key].pop("compile_loss")
        old["comparison"][key]["compile"] = True
    old["comparison"]["result"]["spec"]["strategy"].pop("compile_loss")
    new = _case(8, 0.1, 0.1)
    new["comparison"]["probed"]["compile"] = True
    old_case, new_case = read_results(_file(tmp_path / "r.json", [old, new]))
    assert old_case.comparison.probed.compile and not old_case.comparison.probed.loss_compiled
    assert old_case.comparison.result.spec.strategy.compile_loss is False
    assert new_case.comparison.probed.compile_loss is None and new_case.comparison.probed.loss_compiled
    # a train.py measurements file: what the run's loop did (loss_compiled), eager when it predates the record
    run = json.loads((VISIT4 / "c1a" / "launch.json").read_text())["runs"][0]["measurements"]
    run["plan"]["strategy"]["compile"] = True
    path = tmp_path / "measurements.json"
    path.write_text(json.dumps(run), encoding="utf-8")
    (case,) = read_results(path)
    assert case.comparison.probed.compile and not case.comparison.probed.loss_compiled
    run["measured"]["loss_compiled"] = True
    path.write_text(json.dumps(run), encoding="utf-8")
    assert read_results(path)[0].comparison.probed.loss_compiled
