"""benchmarks/gpu_campaign.py's CPU path end to end (issue 16: the CPU run is a test), the results files it
writes, and ``optplan calibrate`` taking them.

One real campaign (``results``: ``--device cpu --quick``, about 280 s of CPU, see the campaign's docstring) serves
every test of its files; two more campaigns measure nothing (a spent budget; sections whose models are filtered
out) and the bad-input tests call ``main`` in this process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optplan.planner.calibrate import load_calibration
from optplan.planner.results import RESULTS_FORMAT, MeasuredCase, read_results
from optplan.tui.cli import app

ROOT = Path(__file__).resolve().parents[2]
CAMPAIGN = ROOT / "benchmarks" / "gpu_campaign.py"
runner = CliRunner()


def _campaign(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CAMPAIGN), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("campaign")
    # the 480 s default budget is a GPU visit's; CI's shared cores get room (~280 s of CPU, 410 s wall at twice the
    # load) so that no run is left out of time
    proc = _campaign("--device", "cpu", "--quick", "--budget-s", "1500", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith(
        "campaign: probes, gpu_tests, fidelity, trace, exports, launch, grid written to")
    return out


def _load(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def test_every_file_carries_the_environment_record(results: Path) -> None:
    for name in ("probes", "fidelity", "trace", "exports", "launch", "grid"):
        doc = _load(results, name)
        assert doc["format"] == RESULTS_FORMAT and doc["section"] == name
        env = doc["env"]
        assert env["device"] == "cpu" and env["torch"].startswith("2.") and env["packages"]["pydantic"]
        assert env["commit"] and env["started_at"] and env["deepspeed_import_error"] is None
    assert "campaign:" in (results / "campaign.log").read_text()


def test_probe_paths_oom_is_data_and_microbench_runs(results: Path) -> None:
    doc = _load(results, "probes")
    assert doc["oom"]["status"] == "oom" and "memory cap" in doc["oom"]["reason"] and doc["oom"]["ok"]
    bench = doc["microbench"]["result"]
    assert doc["microbench"]["ok"] and bench["matmul_flops_per_s"]["fp32"] > 1e8 and bench["copy_bytes_per_s"] > 1e8
    slowdown = bench["unaligned_gemm_slowdown"]
    assert set(slowdown) == {"fp32"} and bench["unaligned_gemm_skipped"] == {}
    assert bench["attention_flops_per_s"]["default"]["128"]["forward"] > 0  # causal SDPA, torch's own backend
    gamma = doc["microbench"]["alignment_exponent"]
    assert gamma["dtype"] == "fp32" and gamma["gamma"] == pytest.approx(max(0.0, math.log(slowdown["fp32"]) / math.log(4)))
    tests = doc["gpu_tests"]
    assert tests["ok"] and tests["counts"]["skipped"] >= 3 and tests["counts"]["failed"] == 0  # no CUDA here
    assert any("hung" in name for name in tests["tests"])


def test_trace_says_where_the_step_time_went(results: Path) -> None:
    """A traced run's per-category operator time (probes/step_trace.py) adds up to no more than its traced step. The
    run is the fidelity section's own probe of that case, traced after its timed steps: nothing was run twice, and
    its memory figure is the untraced one. (On a GPU the kernels fill most of the step; on CI's 2 shared cores the
    step's wall clock also counts the time the process waited for a core, so the busy share is no bound here: a
    loaded run measured 23 ms busy in a 253 ms step.)"""
    doc = _load(results, "trace")
    run = doc["runs"][0]
    assert run["status"] == "ok" and run["measured_step_s"] > 0
    assert run["source"] == "fidelity" and run["case"] == "fp32 torch mbs16"
    fid = next(x for x in _load(results, "fidelity")["cases"] if x["model"] == "mlp" and x["label"] == run["case"])
    assert fid["traced"] and fid["measured_step_s"] == run["measured_step_s"]
    assert abs(fid["memory_error_pct"]) < 2.0
    assert sum(x["traced"] for x in _load(results, "fidelity")["cases"]) == 1  # only the trace section's case
    trace = run["trace"]
    cats = trace["time_by_category_s"]
    assert set(cats) == {"gemm", "attention", "optimizer", "communication", "other"}
    assert cats["gemm"] > 0 and cats["optimizer"] > 0 and trace["kernels"] > 10
    assert trace["busy_s"] == pytest.approx(sum(cats.values()))
    assert 0 < trace["busy_s"] <= 1.05 * trace["step_wall_s"]


def test_fidelity_memory_and_the_calibration_round_trip(results: Path) -> None:
    doc = _load(results, "fidelity")
    s = doc["summary"]
    errors = {f'{c["model"]} {c["label"]} x{c["nproc"]}': c["memory_error_pct"] for c in doc["cases"]}
    assert s["ok"] == s["cases"] >= 6, errors  # the 2-rank engines run in test_train_script.py's matrix
    # --jobs 3 (the default): every probe took the device lock and handed it over before its exit
    assert s["device_held_s"]["n"] == s["cases"] and all("released" in c["timeline_s"] for c in doc["cases"])
    # every case within 2 %
    off = {name: round(err, 2) for name, err in errors.items() if abs(err) > 2.0}
    assert not off, off
    assert any(c["label"].startswith("fp32 ZeRO-0") and c["nproc"] == 1 for c in doc["cases"])
    cases = [MeasuredCase.model_validate(m) for m in doc["measured"]]
    assert len(cases) == s["cases"] and {c.gpu for c in cases} == {"cpu"}
    assert all(c.comparison.result.peak_allocated_bytes for c in cases)
    cal = doc["calibration"]
    assert len(cal["fits"]) == 2 and all(f["runs"] >= 3 for f in cal["fits"])
    for used in cal["used"]:  # read back from the cache file and applied by estimate()
        fit = next(f for f in cal["fits"] if f["model"] == used["model"])
        assert used["loaded"] and used["calibrated_note"].startswith("calibrated on cpu")
        assert used["applied_allocated_scale"] == pytest.approx(fit["calibration"]["allocated_scale"], rel=1e-6)
    cached = cases[0]
    assert load_calibration("cpu", cached.model_hash, cached.torch_version,
                            path=results / "calibration_cache.json") is not None


def test_exports_launch_through_their_trainers(results: Path) -> None:
    doc = _load(results, "exports")
    launched = {(p["engine"], r["file"]): r for p in doc["plans"] for r in p["runs"]}
    assert {f for _, f in launched} >= {"ds_config.json", "launch.sh", "accelerate.yaml"}
    assert all(r["status"] == "ok" and r["started"] and r["fits"] for r in launched.values()), launched
    assert doc["summary"]["ok"] == doc["summary"]["launched"] >= 3  # CPU: the DeepSpeed plan's 3 files
    # validate --jobs 3: the files started together and took the device lock in turn; the first to time its steps
    # stopped the others, alive meanwhile (the campaign's quiet group)
    assert doc["jobs"] == 3 and max(r["quieted_processes"] or 0 for r in launched.values()) >= 2
    # the CPU's DeepSpeed plan is for 2 GPUs (bf16: its accelerate.yaml, launched without the DeepSpeed plugin on
    # the CPU, keeps the module fp32 and so its inputs), run on 1 process: each file's batch is scaled to it
    # (DeepSpeed checks train_batch_size against micro-batch x accumulation x world size), and DeepSpeed's Adam runs
    # as torch's (no fused-Adam JIT build on the CPU), said once per file
    plan = next(p["plan"] for p in doc["plans"] if p["engine"] == "deepspeed")
    assert plan["dp"] == 2 and plan["precision"] == "bf16", plan
    for name in ("ds_config.json", "launch.sh", "accelerate.yaml"):
        notes = launched[("deepspeed", name)]["notes"]
        assert any("ran 1 of the plan's 2" in n for n in notes) and sum("torch_adam: true" in n for n in notes) == 1, notes


def test_launch_trains_the_exported_plan_and_calibrate_takes_its_measurements(results: Path) -> None:
    """The user's path: recommend --out, train.py run with the plan (on the CPU under the live-tensor tracker),
    its measurements.json through optplan calibrate into an empty cache, recommend again with that cache."""
    doc = _load(results, "launch")
    run = doc["runs"][0]
    assert run["engine"] == "torch" and run["launch_exit_code"] == 0 and "error" not in run, run.get("error")
    assert any("measured" in line and "vs predicted" in line for line in run["launch_output"])
    m = run["measurements"]
    assert m["format"] == "optplan-measurements/1" and m["measured"]["steps"] == 3 and m["measured"]["step_s"] > 0
    assert m["plan"]["strategy"] == run["first_plan"]
    (fit,) = run["calibrations"]
    assert fit["runs"] == 1 and fit["calibration"]["gpu"] == "cpu" and fit["calibration"]["memory_probes"] == 1
    # the live-tensor tracker's peak against the plan's prediction: the CPU fidelity suite's 2 %
    assert abs(fit["memory_error_before_pct"]) < 2.0 and abs(fit["memory_error_after_pct"]) <= abs(
        fit["memory_error_before_pct"])
    assert run["second_plan"] and run["second_predicted"]["step_s"] > 0
    assert doc["summary"] == {"launched": 1, "calibrated": 1}


def test_grid_judges_the_pick_against_measured_runs(results: Path) -> None:
    doc = _load(results, "grid")
    model = doc["models"][0]
    ok = [r for r in model["runs"] if r["status"] == "ok" and r["why"] == "grid"]
    assert len(ok) >= 4 and all(r["measured_samples_per_s"] > 0 and r["predicted_samples_per_s"] > 0 for r in ok)
    # the planner's choice among the grid's own configurations is ranked; recommend's free pick is shown
    assert model["pick"] in {r["strategy"] for r in ok} and 1 <= model["pick_rank"] <= len(ok)
    assert model["recommend_pick"]
    best = max(r["measured_samples_per_s"] for r in ok)
    assert model["best_measured"]["samples_per_s"] == pytest.approx(best)
    pick = next(r for r in ok if r["strategy"] == model["pick"])
    assert model["pick_share_of_best"] == pytest.approx(pick["measured_samples_per_s"] / best)
    assert model["spearman_predicted_vs_measured"] is None or -1 <= model["spearman_predicted_vs_measured"] <= 1
    assert doc["time_comparable"] is False  # the CPU's times are measured, not judged
    assert len(read_results(results / "grid.json")) == len(doc["measured"]) >= len(ok)


def test_optplan_calibrate_folds_results_files_into_the_cache(results: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cal.json"
    out = runner.invoke(app, ["calibrate", str(results / "fidelity.json"), str(results / "grid.json"),
                              "--cache", str(cache), "--json"])
    assert out.exit_code == 0, out.stderr
    doc = json.loads(out.stdout)
    keys = {f["calibration"]["model_hash"] for f in doc["calibrations"]}
    assert len(keys) == 2 and json.loads(cache.read_text())["calibrations"]
    shown = runner.invoke(app, ["calibrate", str(results / "fidelity.json"), "--cache", str(cache)])
    assert shown.exit_code == 0 and "allocated memory error" in shown.stdout and "wrote 2 calibration(s)" in shown.stdout


def test_a_spent_budget_still_writes_every_file_and_models_filter_them(tmp_path: Path) -> None:
    """Every section's file, with what did not run marked; ``--models mlp`` keeps the MLP in fidelity, trace and
    grid (each lists it, out of time) and leaves the Llama out. Nothing runs: a start-up's cost."""
    proc = _campaign("--device", "cpu", "--quick", "--budget-s", "1", "--models", "mlp", "--out", str(tmp_path),
                     timeout=300)
    assert proc.returncode == 0, proc.stderr
    probes = _load(tmp_path, "probes")
    assert all(probes[k] == {"skipped": "out of time"} for k in ("oom", "microbench"))
    assert probes["gpu_tests"]["skipped"] == "out of time"
    cases = _load(tmp_path, "fidelity")["cases"]
    assert cases and all(c["status"] == "skipped" and c["reason"] == "out of time" for c in cases)
    assert {c["model"] for c in cases} == {"mlp"}
    models = _load(tmp_path, "grid")["models"]
    assert [m["model"] for m in models] == ["mlp"] and all(m.get("skipped") == "out of time" for m in models)
    runs = _load(tmp_path, "trace")["runs"]
    assert [r["model"] for r in runs] == ["mlp"] and runs[0]["skipped"] == "out of time"
    assert _load(tmp_path, "exports")["plans"] == [{"engine": "deepspeed", "skipped": "out of time"}]
    assert _load(tmp_path, "launch")["runs"] == [{"engine": "torch", "skipped": "out of time"}]


def test_sections_run_in_the_order_given_and_models_filter_them(tmp_path: Path) -> None:
    proc = _campaign("--device", "cpu", "--quick", "--sections", "grid,trace", "--models", "gpt2", "--out",
                     str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("campaign: grid, trace written to")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["campaign.log", "grid.json", "trace.json"]
    # the CPU's quick grid and trace hold the MLP alone: --models gpt2 leaves both empty, not skipped
    assert _load(tmp_path, "grid")["models"] == [] and _load(tmp_path, "trace")["runs"] == []
    # --models mlp keeping the MLP: test_a_spent_budget_still_writes_every_file_and_models_filter_them; its trace
    # run measured: the module's campaign (test_trace_says_where_the_step_time_went)


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """gpu_campaign.main in this process (a child would spend ~4 s of CPU importing torch to print one line):
    its exit code and stderr. The script's own exit code is main()'s (``sys.exit(main())``), run in ``results``."""
    sys.path.insert(0, str(CAMPAIGN.parent))
    try:
        import gpu_campaign
    finally:
        sys.path.remove(str(CAMPAIGN.parent))
    capsys.readouterr()
    code = gpu_campaign.main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("args", "needle"), [
    (["--device", "cuda"], "sees no CUDA device"),
    (["--device", "cpu", "--budget-s", "0"], "--budget-s must be > 0"),
    (["--device", "cpu", "--sections", "probes,grids"], "unknown grids; choose from probes"),
    (["--device", "cpu", "--models", "gpt3"], "unknown gpt3; choose from mlp"),
    (["--device", "cpu", "--engines", "megatron"], "unknown megatron; choose from torch, deepspeed"),
    (["--device", "cpu", "--cases", "bf16 compiled"], "unknown word(s) compiled; use words of a case's tag"),
    (["--device", "cpu", "--cases", " , "], "unknown word(s) (empty)"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _main([*args, "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_out_must_be_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "file"
    f.write_text("keep me")
    code, err = _main(["--device", "cpu", "--out", str(f)], capsys)
    assert code == 2 and "is a file" in err and f.read_text() == "keep me"


def test_cases_filter_keeps_the_calibration_probe_and_matching_cases() -> None:
    """--cases: a filter keeps a case whose tag holds all its words; each model's first case always runs."""
    sys.path.insert(0, str(CAMPAIGN.parent))
    try:
        import fidelity_suite
        import gpu_campaign
    finally:
        sys.path.remove(str(CAMPAIGN.parent))
    c = gpu_campaign.Campaign(device="cuda", out=Path("."), env={}, deadline=0.0, quick=False, gpu=None,
                              cases=("compile", "bf16 selective"))
    llama = [x for x in fidelity_suite.SUITE if x.model == "llama" and "cuda" in x.where]
    kept = [gpu_campaign.case_tag(x) for i, x in enumerate(llama) if c.keeps_case(x, first=i == 0)]
    assert kept == ["fp32 single mbs1 none", "bf16 single mbs2 selective", "bf16 single mbs2 none compile",
                    "bf16 single mbs2 selective compile"]
    everything = gpu_campaign.Campaign(device="cuda", out=Path("."), env={}, deadline=0.0, quick=False, gpu=None)
    assert all(everything.keeps_case(x, first=False) for x in llama)
    assert everything.wants_engine("deepspeed") and c.wants_engine("deepspeed")  # --engines not given: every engine
    torch_only = gpu_campaign.Campaign(device="cuda", out=Path("."), env={}, deadline=0.0, quick=False, gpu=None,
                                       engines=frozenset({"torch"}))
    assert torch_only.wants_engine("torch") and not torch_only.wants_engine("deepspeed")
