"""recommend --probe, validate and hardware --microbench through the CLI, for real on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optplan.tui.cli import app

ROOT = Path(__file__).resolve().parents[2]
MLP = str(ROOT / "examples" / "mlp.py")
runner = CliRunner()


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTPLAN_CACHE_DIR", str(tmp_path / "cache"))


def _run(args: list[str], code: int = 0) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == code, (result.stdout, result.stderr)
    return result.stdout


def test_recommend_probe_on_cpu_runs_the_top_candidates_and_reports_them() -> None:
    # fp32: DeepSpeed's bf16 engines hold more than the accounting predicts on the CPU probe (examples/mlp.py,
    # one process: ZeRO-1/2 -12 %, ZeRO-3 -10 % after the step-conversion term); the GPU campaign measures them
    doc = json.loads(_run(["recommend", MLP, "--gpus", "2", "--precision", "fp32", "--probe", "--probe-top-k", "2",
                           "--probe-steps", "1", "--json"]))
    probes = doc["probes"]
    assert probes["device"] == "cpu" and probes["time_comparable"] is False
    assert len(probes["probed"]) == 2
    for c in probes["probed"]:
        r = c["result"]
        assert r["status"] == "ok", r
        assert len(r["step_times_s"]) == 1 and r["step_s"] > 0
        assert c["probed"]["mbs"] == 1 and c["probed"]["dp"] == 1
        # measured peak live bytes are within 20 % of the CPU accounting (tightly checked in benchmarks/fidelity.py)
        assert 0.8 < r["peak_allocated_bytes"] / c["predicted_allocated_bytes"] < 1.2
    assert doc["plan"] == probes["probed"][0]["candidate"]  # off the planned GPU the pick stays analytic
    assert any(line.startswith("probes: 2 candidate(s) run for real on the CPU") for line in doc["rationale"])


def test_recommend_without_gpu_does_not_probe_by_default() -> None:
    doc = json.loads(_run(["recommend", MLP, "--gpus", "2", "--json"]))
    assert doc["probes"] is None and doc["calibration"] is None


@pytest.mark.parametrize(("args", "needle"), [
    (["--arch", "layers=2,hidden=64,heads=2", "--probe"], "--probe runs the model FILE"),
    ([MLP, "--probe-budget", "0"], "--probe-budget must be a finite number > 0"),
    ([MLP, "--probe-top-k", "0"], "--probe-top-k must be >= 1"),
])
def test_probe_flags_are_checked(args: list[str], needle: str) -> None:
    result = runner.invoke(app, ["recommend", *args, "--gpus", "2"])
    assert result.exit_code == 2
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_validate_runs_the_exported_launch_files(tmp_path: Path) -> None:
    """A torch plan's launch.sh and accelerate.yaml under ``optplan validate`` (a DeepSpeed plan's three files run
    the same way in benchmarks/gpu_campaign.py's CPU run: tests/benchmarks/test_gpu_campaign.py)."""
    engine = "torch"
    out = tmp_path / "plan"
    _run(["recommend", MLP, "--gpus", "2", "--engine", engine, "--precision", "fp32", "--no-offload",
          "--out", str(out)])
    doc = json.loads(_run(["validate", str(out), MLP, "--steps", "1", "--json"]))
    runs = {Path(r["file"]).name: r for r in doc["runs"]}
    assert set(runs) == {"launch.sh", "accelerate.yaml"}
    for run in runs.values():
        assert run["started"] is True and run["fits"] is True, run
        assert run["comparison"]["result"]["status"] == "ok"
        assert any("ran 1 of the plan's 2" in n for n in run["notes"])


TOKENS = """
import torch, torch.nn as nn, torch.nn.functional as F
OPTPLAN = {"seq_len": 64}
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.fc = nn.Linear(32, 64)
    def forward(self, idx):
        return self.fc(self.emb(idx))
def build_model():
    return Net()
def example_batch(batch_size, seq_len):
    return torch.randint(0, 64, (batch_size, seq_len))
def loss_fn(logits, batch):
    return F.cross_entropy(logits.reshape(-1, 64), batch.reshape(-1))
"""


def test_validate_runs_the_plans_sequence_length_and_one_sample_on_the_cpu(tmp_path: Path) -> None:
    """A plan made at --seq-len 16 (the file's own is 64) is validated at 16 without repeating the flag (it ran at
    the model's default and compared with a prediction plan.json never made), and on the CPU at one sample per
    micro-batch, as probes run (a GPU plan's micro-batch of an 80 GB device was run as is and the host's
    out-of-memory killer ended it), which its note says."""
    model = tmp_path / "tokens.py"
    model.write_text(TOKENS)
    out = tmp_path / "plan"
    _run(["recommend", str(model), "--gpus", "1", "--seq-len", "16", "--global-batch", "8", "--engine", "torch",
          "--precision", "fp32", "--no-offload", "--no-probe", "--out", str(out)])
    plan = json.loads((out / "plan.json").read_text())["export"]
    assert plan["seq_len"] == 16 and plan["strategy"]["mbs"] * plan["strategy"]["grad_accum"] == 8
    doc = json.loads(_run(["validate", str(out / "launch.sh"), str(model), "--steps", "1", "--json"]))
    (run,) = doc["runs"]
    result = run["comparison"]["result"]
    assert result["status"] == "ok" and result["spec"]["seq_len"] == 16
    assert (result["spec"]["strategy"]["mbs"], result["spec"]["strategy"]["grad_accum"]) == (1, 1)
    assert any(n.startswith("on the CPU one sample per micro-batch") for n in run["notes"]), run["notes"]


def test_validate_with_two_cpu_processes_runs_accelerate_with_one(tmp_path: Path) -> None:
    """--nproc 2 on the CPU: launch.sh runs both ranks; `accelerate launch --cpu` starts one process whatever its
    --num_processes (multi-CPU is its mpirun launcher), so accelerate.yaml runs one and says so (it failed with
    'rank 1 wrote no result')."""
    out = tmp_path / "plan"
    _run(["recommend", MLP, "--gpus", "2", "--engine", "torch", "--precision", "fp32", "--no-offload", "--no-probe",
          "--out", str(out)])
    doc = json.loads(_run(["validate", str(out), MLP, "--steps", "1", "--nproc", "2", "--json"]))
    runs = {Path(r["file"]).name: r for r in doc["runs"]}
    assert runs["launch.sh"]["comparison"]["result"]["world_size"] == 2
    accelerate = runs["accelerate.yaml"]
    assert accelerate["comparison"]["result"]["status"] == "ok", accelerate
    assert any("accelerate launch --cpu starts one process" in n for n in accelerate["notes"])


def test_validate_jobs_runs_the_files_together_taking_the_device_in_turn(tmp_path: Path) -> None:
    """--jobs 2: both files start at once and take one device lock in turn; the lock-held intervals (from taking it
    to handing it over) do not overlap, and the runs train as with --jobs 1."""
    out = tmp_path / "plan"
    _run(["recommend", MLP, "--gpus", "1", "--engine", "torch", "--precision", "fp32", "--no-offload", "--no-probe",
          "--out", str(out)])
    doc = json.loads(_run(["validate", str(out), MLP, "--steps", "1", "--jobs", "2", "--json"]))
    results = [r["comparison"]["result"] for r in doc["runs"]]
    assert [Path(r["file"]).name for r in doc["runs"]] == ["launch.sh", "accelerate.yaml"]  # in the folder's order
    assert all(r["status"] == "ok" for r in results), results
    locks = {r["spec"]["device_lock"] for r in results}
    assert len(locks) == 1 and None not in locks
    spans = sorted((r["device_acquired_at"], r["device_acquired_at"] + r["timeline_s"]["released"]
                    - r["timeline_s"]["device_acquired"]) for r in results)
    # one after the other on the device (to a few ms: each span is a wall-clock start plus a perf_counter length)
    assert spans[0][1] <= spans[1][0] + 0.02
    # the first to take the device stopped the other (alive: importing, or waiting for the lock) for its timed
    # steps, so the two ran together, in one quiet group (whether the second then waited depends on its imports)
    first = min(results, key=lambda r: r["device_acquired_at"])
    assert first["quieted_processes"] >= 1 and all(r["host_op_s"] > 0 for r in results)  # accelerate: 2 processes
    result = runner.invoke(app, ["validate", str(out), MLP, "--jobs", "0"])
    assert result.exit_code == 2 and "--jobs must be >= 1" in result.stderr


def test_validate_reports_a_config_that_does_not_start(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    _run(["recommend", MLP, "--gpus", "2", "--engine", "deepspeed", "--precision", "fp32", "--no-offload",
          "--out", str(out)])
    cfg = json.loads((out / "ds_config.json").read_text())
    cfg["zero_optimization"]["no_such_key"] = 1  # DeepSpeed's own config model forbids unknown keys
    (out / "ds_config.json").write_text(json.dumps(cfg))
    result = runner.invoke(app, ["validate", str(out / "ds_config.json"), MLP, "--steps", "1"])
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert "ds_config.json" in result.stdout and "error" in result.stdout and "no_such_key" in result.stdout


def test_validate_bad_target_is_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", str(tmp_path), MLP])
    assert result.exit_code == 2 and "has none of ds_config.json, launch.sh, accelerate.yaml" in result.stderr


def test_hardware_microbench_quick_json() -> None:
    doc = json.loads(_run(["hardware", "--microbench", "--quick", "--json"]))
    bench = doc["microbench"]
    assert doc["hardware"]["available"] is False and bench["device"] == "cpu"
    assert bench["matmul_flops_per_s"]["fp32"] > 1e8 and bench["copy_bytes_per_s"] > 1e8


def test_a_replanned_folder_says_what_an_earlier_plan_left(tmp_path: Path) -> None:
    """recommend --out --force over a DeepSpeed plan's folder with a torch plan: the earlier ds_config.json is named
    as left over (launched, it would run the old plan), and validate refuses it in one line."""
    out = tmp_path / "plan"
    _run(["recommend", MLP, "--gpus", "2", "--engine", "deepspeed", "--precision", "fp32", "--no-probe", "--out", str(out)])
    result = runner.invoke(app, ["recommend", MLP, "--gpus", "2", "--engine", "torch", "--precision", "fp32",
                                 "--no-probe", "--out", str(out), "--force"])
    assert result.exit_code == 0, result.stderr
    assert "from an earlier plan, not this one's: ds_config.json" in " ".join(result.stdout.split())
    stale = runner.invoke(app, ["validate", str(out / "ds_config.json"), MLP, "--steps", "1"])
    assert stale.exit_code == 2 and "left from an earlier plan" in stale.stderr and "Traceback" not in stale.stderr
