"""plan.json / PLAN.md, the export registry (every target through its own validator) and optplan export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_gpu, make_profile
from typer.testing import CliRunner

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import Cluster
from optplan.estimators.units import long_duration, sig3
from optplan.planner.api import export_plan, export_plan_file, render_exports
from optplan.planner.export.context import FILE_NAMES
from optplan.planner.export.registry import TARGETS, ExportOptions, render_targets, targets_for
from optplan.planner.export.report import load_plan_json, plan_json_text, render_plan_md
from optplan.planner.recommend import recommend
from optplan.tui.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def ds_rec():  # type: ignore[no-untyped-def]
    return recommend(make_profile(), Cluster(gpu=make_gpu(), gpus=16, gpus_per_node=8), global_batch=256,
                     engines=["deepspeed"])


@pytest.fixture(scope="module")
def megatron_rec():  # type: ignore[no-untyped-def]
    # Megatron only: with DeepSpeed searched too, ZeRO-1 over 64 GPUs fits without model parallelism and wins
    prof = profile_from_arch(parse_arch("layers=48,hidden=6144,heads=48,vocab=51200,seq=2048"))
    return recommend(prof, Cluster(gpu=make_gpu(80), gpus=64, gpus_per_node=8), global_batch=512,
                     engines=["megatron"])


def test_plan_json_round_trips(ds_rec) -> None:  # type: ignore[no-untyped-def]
    text = plan_json_text(ds_rec)
    rec, export = load_plan_json(text)
    assert rec == ds_rec and export == ds_rec.export
    assert json.loads(text)["plan"] == ds_rec.plan.model_dump(mode="json")


def test_plan_md_has_the_table_rationale_and_figures(ds_rec) -> None:  # type: ignore[no-untyped-def]
    md = render_plan_md(ds_rec)
    assert ds_rec.plan.label() in md
    for line in ds_rec.rationale:
        assert line in md
    assert "| engine |" in md and "## Pareto front" in md and "MFU" in md


def test_bad_plan_json_is_one_line(tmp_path: Path) -> None:
    for text, needle in (("{", "not JSON"), ("[]", "not an optplan plan"),
                         ('{"plan": null, "fits": false, "export": null}', "no fitting plan")):
        with pytest.raises(OptplanError, match=needle):
            load_plan_json(text)
    with pytest.raises(OptplanError, match="does not exist"):
        export_plan_file(tmp_path / "nope.json", ["all"], tmp_path / "o", force=False)
    with pytest.raises(OptplanError, match="unknown export target"):
        targets_for(["jax"])


def test_all_targets_for_a_deepspeed_plan_are_validated(ds_rec) -> None:  # type: ignore[no-untyped-def]
    files, skipped = render_exports(ds_rec)
    for target in ("deepspeed", "accelerate", "torchrun", "slurm", "hf", "lightning", "plan", "report"):
        assert FILE_NAMES[target] in files, (target, skipped)
    ds = json.loads(files["ds_config.json"])
    assert ds["train_batch_size"] == 256 and ds["zero_optimization"]["stage"] == ds_rec.plan.zero


def test_megatron_plan_exports_launch_files_and_says_why_not_ds_config(megatron_rec) -> None:  # type: ignore[no-untyped-def]
    assert megatron_rec.plan.engine == "megatron"
    files, skipped = render_targets(megatron_rec.export, ["all"])
    assert "launch.sh" in files and "slurm.sbatch" in files
    assert "--tensor-model-parallel-size" in files["launch.sh"]
    assert "ds_config.json" not in files and any(s.startswith("deepspeed:") for s in skipped)
    with pytest.raises(OptplanError):
        render_targets(megatron_rec.export, ["deepspeed"])


def test_export_command_writes_refuses_and_forces(ds_rec, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "plan"
    written, _ = export_plan(ds_rec, out, force=False)
    plan_file = out / "plan.json"
    assert plan_file in written
    dest = tmp_path / "again"
    result = runner.invoke(app, ["export", str(plan_file), "--to", "deepspeed", "--to", "torchrun", "--out",
                                 str(dest)])
    assert result.exit_code == 0, result.stderr
    # the plan travels with its files (validate reads it beside launch.sh); exporting into the plan's own folder
    # or where an identical copy lies adds nothing
    assert sorted(p.name for p in dest.iterdir()) == ["ds_config.json", "launch.sh", "plan.json"]
    assert (dest / "plan.json").read_text() == plan_file.read_text()
    assert (dest / "ds_config.json").read_text() == (out / "ds_config.json").read_text()
    again = runner.invoke(app, ["export", str(plan_file), "--to", "slurm", "--out", str(dest)])
    assert again.exit_code == 0 and "plan.json" not in again.stdout, again.stdout + again.stderr
    here = runner.invoke(app, ["export", str(plan_file), "--to", "torchrun", "--out", str(out), "--force"])
    assert here.exit_code == 0 and "plan.json" not in here.stdout
    before = (dest / "launch.sh").read_bytes()
    refused = runner.invoke(app, ["export", str(plan_file), "--to", "torchrun", "--out", str(dest),
                                  "--launcher", "deepspeed"])
    assert refused.exit_code == 2 and "--force" in refused.stderr
    assert (dest / "launch.sh").read_bytes() == before
    forced = runner.invoke(app, ["export", str(plan_file), "--to", "torchrun", "--out", str(dest),
                                 "--launcher", "deepspeed", "--force"])
    assert forced.exit_code == 0, forced.stderr
    assert "deepspeed" in (dest / "launch.sh").read_text() and (dest / "hostfile").exists()
    bad = runner.invoke(app, ["export", str(plan_file), "--to", "jax", "--out", str(dest)])
    assert bad.exit_code == 2 and "unknown export target" in bad.stderr


def test_every_target_is_registered() -> None:
    assert set(TARGETS) == {"deepspeed", "accelerate", "torchrun", "slurm", "hf", "lightning", "train", "finetune"}
    assert ExportOptions().launcher == "torchrun"


def test_plan_md_gives_the_step_band_and_why_it_is_out_of_domain(ds_rec) -> None:  # type: ignore[no-untyped-def]
    md = render_plan_md(ds_rec)
    t = ds_rec.estimate.time
    assert t.step_s_low < t.step_s < t.step_s_high
    assert f"{sig3(t.step_s)} [{sig3(t.step_s_low)}-{sig3(t.step_s_high)}]" in md
    assert f"band {t.step_s_low:.3f}-{t.step_s_high:.3f} s ({t.band_basis})" in md
    for why in t.outside_measured:
        assert f"- out of the measured domain: {why}" in md


def test_plan_md_prices_the_time_to_train_over_the_step_band() -> None:
    """With a token budget and a price, PLAN.md gives the days and the dollars at the step band's ends too (both
    scale with the step)."""
    from optplan.planner.goal import Goal

    rec = recommend(make_profile(), Cluster(gpu=make_gpu(), gpus=16, gpus_per_node=8), global_batch=256,
                    engines=["deepspeed"], goal=Goal(tokens=1e11, price_per_gpu_hour=2.0))
    c, t = rec.estimate.cost, rec.estimate.time
    assert c is not None and c.train_time_s_low is not None and c.cost_usd_high is not None
    assert c.train_time_s_low == pytest.approx(c.train_time_s * t.step_s_low / t.step_s)
    assert c.cost_usd_high == pytest.approx(c.cost_usd * t.step_s_high / t.step_s)
    md = render_plan_md(rec)
    assert c.gpu_hours_high == pytest.approx(c.gpu_hours * t.step_s_high / t.step_s)
    assert c.energy_kwh_low == pytest.approx(c.energy_kwh * t.step_s_low / t.step_s)
    assert (f"; over the step's band {long_duration(c.train_time_s_low)}-{long_duration(c.train_time_s_high)}, "
            f"{c.gpu_hours_low:,.0f}-{c.gpu_hours_high:,.0f} GPU-hours, ${c.cost_usd_low:,.0f}-${c.cost_usd_high:,.0f}, "
            f"{c.energy_kwh_low:,.0f}-{c.energy_kwh_high:,.0f} kWh") in md
    # a short run reads in hours or minutes, never "0.00 days"
    short = recommend(make_profile(), Cluster(gpu=make_gpu(), gpus=16, gpus_per_node=8), global_batch=256,
                      engines=["deepspeed"], goal=Goal(tokens=1e7))
    assert short.estimate.cost is not None and short.estimate.cost.train_time_s < 3600
    md = render_plan_md(short)
    assert f"tokens in {long_duration(short.estimate.cost.train_time_s)}: " in md and "0.00 days" not in md
    # the tables' train column too (not "0.0 d"), and their figures at three significant digits, zeros kept
    row = next(line for line in md.splitlines() if line.startswith(f"| {short.plan.engine} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1] == long_duration(short.estimate.cost.train_time_s) and cells[-1] != "0.0 d"
    assert cells[8] == sig3(short.estimate.samples_per_s) and cells[7].startswith(sig3(short.estimate.time.step_s))



@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("dp", [1, 8])
@pytest.mark.parametrize("target", ["accelerate", "hf", "lightning"])
def test_autocast_switches_refuse_16bit_weight_plans(target: str, precision: str, dp: int) -> None:
    """Without FSDP the trainers' 16-bit switch (accelerate's mixed_precision, TrainingArguments' bf16/fp16,
    Lightning's bf16-mixed/16-mixed) is autocast over fp32 weights: a plan priced with 16-bit weights and fp32
    masters is refused in one line naming train.py and the amp recipe; under FSDP (16-bit compute over fp32
    shards, as planned) and with the amp recipe it is written."""
    from optplan.estimators.buckets import DeepSpeedBuckets
    from optplan.estimators.strategy import Strategy
    from optplan.planner.export.context import ExportPlan

    def plan(**kw: object) -> ExportPlan:
        return ExportPlan(strategy=Strategy(engine="torch", **kw), model="gpt2", model_path="examples/gpt2.py",  # type: ignore[arg-type]
                          block_class="Block", params=124_439_808, seq_len=1024, gpu="H100-SXM", gpus_per_node=8,
                          buckets=DeepSpeedBuckets(reduce_bucket_size=1, allgather_bucket_size=1,
                                                   stage3_prefetch_bucket_size=1, stage3_param_persistence_threshold=1,
                                                   stage3_max_live_parameters=1))

    with pytest.raises(OptplanError, match=f"--precision amp-{precision}") as err:
        render_targets(plan(dp=dp, precision=precision), [target])
    assert "train.py" in str(err.value) and "\n" not in str(err.value)
    for ok in (plan(dp=8, precision=precision, fsdp="full"), plan(dp=dp, precision=f"amp-{precision}")):
        files, skipped = render_targets(ok, [target])
        assert files and not skipped, skipped
