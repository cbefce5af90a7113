"""The CLI end to end on every example (typer's test runner), with --json parsed and checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optplan.tui.cli import app, main
from optplan.tui.fmt import amount

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"
runner = CliRunner()

H100 = ["--gpu", "H100-SXM", "--gpus", "8"]


def _json(args: list[str], env: dict[str, str] | None = None, code: int = 0) -> dict:
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == code, (result.stdout, result.stderr)
    return json.loads(result.stdout)


@pytest.mark.parametrize(("example", "env", "tokens"), [
    ("gpt2.py", {}, True), ("mlp.py", {}, False), ("resnet.py", {}, False),
    ("llama.py", {"OPTPLAN_LLAMA_SIZE": "1B"}, True),
])
def test_recommend_json_on_each_example(example: str, env: dict[str, str], tokens: bool) -> None:
    doc = _json(["recommend", str(EX / example), *H100, "--json"], env=env)
    assert doc["fits"] is True
    plan, est = doc["plan"], doc["estimate"]
    assert {"precision", "zero", "mbs", "grad_accum", "checkpointing", "dp"} <= plan.keys()
    assert plan["dp"] == 8 and est["gpus"] == 8 and est["gpu"] == "H100-SXM"
    assert est["strategy"] == plan
    mem = est["memory"]
    parts = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes",
             "overhead_bytes")
    assert mem["total_bytes"] == sum(mem[k] for k in parts)
    assert 0 < mem["total_bytes"] <= mem["capacity_bytes"] == int(0.98 * 80 * 2**30)
    assert est["global_batch"] == plan["mbs"] * plan["grad_accum"] * 8
    assert (est["tokens_per_s"] is not None) == tokens
    assert 0 < est["mfu"] < 1 and est["time"]["step_s"] > 0
    assert len(doc["rationale"]) >= 5 and doc["pareto"]
    # ranked by samples/s at the band's slow end; the pick is the best or the simplest plan tied with it
    def at(e: dict, end: str) -> float:
        return e["samples_per_s"] * e["time"]["step_s"] / e["time"][end]

    slow = [at(a["estimate"], "step_s_high") for a in doc["alternatives"]]
    assert slow == sorted(slow, reverse=True)
    if slow and slow[0] > at(est, "step_s_high"):
        assert at(est, "step_s_low") >= slow[0]
        assert any(r.startswith("ties: ") for r in doc["rationale"])


def test_recommend_70b_on_8_gpus_says_nothing_fits_and_what_would() -> None:
    result = runner.invoke(app, ["recommend", str(EX / "llama.py"), *H100, "--no-offload"],
                           env={"OPTPLAN_LLAMA_SIZE": "70B"})
    assert result.exit_code == 1
    out = result.stdout
    assert "NO PLAN FITS" in out and "no searched plan fits 8 x H100-SXM" in out
    assert "ZeRO-3" in out and "--gpus" in out and "offload" in out
    assert "best plans" not in out


def test_recommend_70b_on_8_gpus_fits_only_with_offload_and_says_so() -> None:
    doc = _json(["recommend", str(EX / "llama.py"), *H100, "--json"], env={"OPTPLAN_LLAMA_SIZE": "70B"})
    plan = doc["plan"]
    assert doc["fits"] and "cpu" in (plan["offload_optimizer"], plan["offload_params"])
    line = next(r for r in doc["rationale"] if r.startswith("CPU offload"))
    assert "without it this plan needs" in line and "GiB" in line


def test_recommend_out_writes_validated_exports_and_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    doc = _json(["recommend", str(EX / "mlp.py"), *H100, "--global-batch", "64", "--engine", "deepspeed", "--out",
                 str(out), "--json"])
    files = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))  # not the study's lock files
    assert files == ["PLAN.md", "accelerate.yaml", "ds_config.json", "hf_training_args.json", "launch.sh",
                     "lightning.json", "optplan-study.log", "plan.json", "train.py"]
    written, not_written = doc.pop("written"), doc.pop("not_written")  # --json --out lists what --out holds
    assert sorted(Path(w).name for w in written) == [f for f in files if f != "optplan-study.log"]
    assert len(not_written) == 1 and not_written[0].startswith("slurm: the plan runs on one node")  # said, not silent
    assert json.loads((out / "plan.json").read_text()) == doc
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 64 == doc["estimate"]["global_batch"]
    assert ds["train_micro_batch_size_per_gpu"] == doc["plan"]["mbs"]
    assert ds["zero_optimization"]["stage"] == doc["plan"]["zero"]
    assert "--nproc-per-node 8" in (out / "launch.sh").read_text()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = runner.invoke(app, ["recommend", str(EX / "mlp.py"), *H100, "--engine", "deepspeed", "--out", str(out)])
    assert again.exit_code == 2
    assert "--force" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    forced = runner.invoke(app, ["recommend", str(EX / "mlp.py"), *H100, "--global-batch", "128", "--engine",
                                 "deepspeed", "--out", str(out), "--force"])
    assert forced.exit_code == 0, forced.stderr
    assert json.loads((out / "ds_config.json").read_text())["train_batch_size"] == 128


def test_estimate_json_fits_and_reason() -> None:
    args = ["estimate", str(EX / "gpt2.py"), *H100, "--zero", "2", "--mbs", "4", "--json"]
    est = _json(args)
    assert est["fits"] is True and est["reason"].startswith("fits:")
    assert est["strategy"]["zero"] == 2 and est["strategy"]["mbs"] == 4
    big = _json(["estimate", str(EX / "gpt2.py"), *H100, "--zero", "0", "--mbs", "512", "--precision", "fp32",
                 "--json"])
    assert big["fits"] is False and "does not fit" in big["reason"]


def test_profile_json_and_hardware() -> None:
    prof = _json(["profile", str(EX / "mlp.py"), "--json"])
    assert prof["params"] > 0 and prof["repeated_block"]["count"] >= 2 and prof["activations"]
    hw = _json(["hardware", "--json"])
    assert set(hw) >= {"available", "reason", "devices"}
    if not hw["available"]:  # no GPU here: the table shows what --gpu takes, each name with its memory and aliases
        result = runner.invoke(app, ["hardware"], env={"COLUMNS": "160"})
        assert result.exit_code == 0 and "Commands plan for --gpu" in result.stdout
        lines = result.stdout.splitlines()
        a100 = next(line for line in lines if line.split()[:1] == ["A100-80GB"])
        assert "80 GiB" in a100 and "A100," in a100  # plain 'A100' means the 80 GB card: said
        assert any(line.split()[:1] == ["H200"] for line in lines)


@pytest.mark.parametrize(("argv", "needle"), [
    (["recommend", "no_such_model.py"], "not found"),
    (["recommend", "EXAMPLE", "--gpu", "X999"], "unknown GPU"),
    (["recommend", "EXAMPLE", "--gpus", "8", "--global-batch", "100"], "not divisible"),
    (["recommend", "EXAMPLE", "--gpus", "abc"], "--gpus"),
    (["recommend", "EXAMPLE", "--gpus", "0"], "--gpus"),
    (["estimate", "EXAMPLE", "--zero", "5"], "--zero"),
    (["estimate", "EXAMPLE", "--precision", "fp64"], "--precision"),
    (["estimate", "EXAMPLE", "--zero", "0", "--offload-params", "cpu"], "ZeRO stage 3"),
    (["recommend", "EXAMPLE", "--seq-len", "0"], "--seq-len"),
    (["bogus"], "No such command"),
])
def test_bad_input_is_one_line_exit_2_no_traceback(argv: list[str], needle: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(EX / "mlp.py") if a == "EXAMPLE" else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in err


def test_an_internal_error_is_one_line_and_exit_3(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A bug inside optplan (here: the --arch parser raising what no user input should cause) prints one line that
    says so and points at --debug, exits 3 (not 2: the input was fine), no traceback; --debug shows it."""
    import optplan.planner.api as api

    def broken(text: str, **_kw: object) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(api, "parse_arch", broken)
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--arch", "layers=2,hidden=64,heads=2"])
    assert exc.value.code == 3
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "internal error" in lines[0] and "ZeroDivisionError" in lines[0] and "--debug" in lines[0]
    result = runner.invoke(app, ["--debug", "profile", "--arch", "layers=2,hidden=64,heads=2"])
    assert result.exit_code == 3 and "Traceback" in result.stderr and "ZeroDivisionError" in result.stderr
    # --debug after the subcommand works as well (it was "No such option: --debug")
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--arch", "layers=2,hidden=64,heads=2", "--debug"])
    assert exc.value.code == 3 and "Traceback" in capsys.readouterr().err


def test_debug_first_moves_only_the_commands_own_flag() -> None:
    from optplan.tui.cli import debug_first

    assert debug_first(["recommend", "m.py", "--debug", "--json"]) == ["--debug", "recommend", "m.py", "--json"]
    assert debug_first(["--debug", "recommend", "m.py"]) == ["--debug", "recommend", "m.py"]
    assert debug_first(["validate", "d", "m.py", "--", "--debug"]) == ["validate", "d", "m.py", "--", "--debug"]


def test_debug_shows_the_traceback_and_keeps_the_exit_code() -> None:
    """--debug adds the traceback; the exit code stays the one the error has without it (2: bad input)."""
    plain = runner.invoke(app, ["recommend", "no_such_model.py"])
    result = runner.invoke(app, ["--debug", "recommend", "no_such_model.py"])
    assert plain.exit_code == result.exit_code == 2 and "Traceback" in result.stderr
    assert plain.stderr.strip().splitlines()[-1] == result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("argv", [
    ["estimate", "BROKEN", "--mbs", "0"],
    ["estimate", "BROKEN", "--precision", "fp8", "--gpu", "A100-80GB"],
    ["recommend", "BROKEN", "--gpus", "8", "--global-batch", "7"],
    ["recommend", "BROKEN", "--gpu", "V100", "--precision", "bf16"],
    ["recommend", "BROKEN", "--gpus", "8", "--gpus-per-node", "3"],
])
def test_flags_are_checked_before_the_model_is_profiled(argv: list[str], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("def build_model(:\n")
    with pytest.raises(SystemExit) as exc:
        main([str(broken) if a == "BROKEN" else a for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "syntax" not in err.lower() and "broken.py" not in err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_sequence_longer_than_the_model_supports(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["recommend", str(EX / "gpt2.py"), "--seq-len", "2048"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "longer than the model's maximum of 1024" in err and "--seq-len 1024" in err


def test_chinchilla_command() -> None:
    doc = _json(["chinchilla", "--params", "70e9", "--json"])
    assert {"params", "tokens", "flops", "loss"} <= doc.keys()
    assert doc["tokens"] == pytest.approx(1.4e12) and doc["flops"] == pytest.approx(6 * 70e9 * 1.4e12)
    epoch = _json(["chinchilla", "--compute", "5.76e23", "--fit", "epoch", "--json"])
    assert epoch["params"] == pytest.approx(70e9, rel=0.05)
    bad = runner.invoke(app, ["chinchilla", "--params", "1e9", "--tokens", "1e10", "--compute", "1e20"])
    assert bad.exit_code == 2 and "exactly one" in bad.stderr
    # --params with --tokens: the loss of that model on that budget, not an optimum
    given = _json(["chinchilla", "--params", "7e9", "--tokens", "2e12", "--json"])
    assert given["method"] == "given" and given["flops"] == pytest.approx(6 * 7e9 * 2e12)
    assert given["loss"] == pytest.approx(1.69 + 406.4 / 7e9**0.34 + 410.7 / 2e12**0.28)
    assert any("2e+12 tokens is outside" in why for why in given["outside_fit"])
    text = runner.invoke(app, ["chinchilla", "--params", "1e9", "--tokens", "1e10"])
    assert text.exit_code == 0 and "compute-optimal for the same FLOPs" in text.stdout
    assert "extrapolation" not in text.stdout  # 1B on 10B tokens lies inside the fitted runs
    tiny = runner.invoke(app, ["chinchilla", "--tokens", "1e3"])
    assert tiny.exit_code == 0 and "the loss is an extrapolation" in tiny.stdout


def test_estimate_cost_and_gas_alias() -> None:
    est = _json(["estimate", str(EX / "gpt2.py"), *H100, "--zero", "1", "--mbs", "8", "--gas", "4",
                 "--tokens", "1e10", "--price", "2.5", "--json"])
    assert est["strategy"]["grad_accum"] == 4
    assert est["memory"]["fits"] is True
    cost = est["cost"]
    assert cost["train_time_s"] == pytest.approx(1e10 / est["tokens_per_s"])
    assert cost["gpu_hours"] == pytest.approx(8 * cost["train_time_s"] / 3600)
    assert cost["cost_usd"] == pytest.approx(2.5 * cost["gpu_hours"])
    assert cost["energy_kwh"] == pytest.approx(8 * 700 * cost["train_time_s"] / 3.6e6)
    assert (cost["price_per_gpu_hour"], cost["gpu_power_w"]) == (2.5, 700)
    t = est["time"]  # the throughput's band: the global batch over the step band's slow and fast ends
    assert t["tokens_per_s_low"] == pytest.approx(est["tokens_per_s"] * t["step_s"] / t["step_s_high"])
    assert t["tokens_per_s_high"] == pytest.approx(est["tokens_per_s"] * t["step_s"] / t["step_s_low"])


def test_estimate_checkpoint_layers() -> None:
    """--checkpoint-layers N: the first N blocks checkpointed, memory and time between none and full; bad counts are
    one line naming the fix, exit code 2."""
    arch = ["--arch", "layers=12,hidden=768,heads=12,vocab=50257,seq=1024", *H100, "--mbs", "8", "--json"]
    none, part, full = (_json(["estimate", *arch, *extra]) for extra in (
        [], ["--checkpointing", "full", "--checkpoint-layers", "6"], ["--checkpointing", "full"]))
    assert part["strategy"]["checkpoint_layers"] == 6 and full["strategy"]["checkpoint_layers"] is None
    acts = [e["memory"]["activations_bytes"] for e in (none, part, full)]
    steps = [e["time"]["step_s"] for e in (none, part, full)]
    assert acts[0] > acts[1] > acts[2] and steps[0] < steps[1] < steps[2]
    for extra, needle in ((["--checkpoint-layers", "6"], "add --checkpointing full"),
                          (["--checkpointing", "full", "--checkpoint-layers", "12"], "use 1-11")):
        bad = runner.invoke(app, ["estimate", *arch, *extra])
        assert bad.exit_code == 2 and needle in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_estimate_and_recommend_take_an_arch_instead_of_a_file() -> None:
    arch = "layers=12,hidden=768,heads=12,vocab=50257,seq=1024"
    est = _json(["estimate", "--arch", arch, *H100, "--zero", "2", "--mbs", "4", "--json"])
    assert est["strategy"]["zero"] == 2 and est["tokens_per_s"] > 0 and est["memory"]["fits"]
    doc = _json(["recommend", "--arch", arch, *H100, "--global-batch", "512", "--json"])
    assert doc["fits"] and doc["model_path"] == "--arch" and doc["estimate"]["global_batch"] == 512
    both = runner.invoke(app, ["estimate", str(EX / "mlp.py"), "--arch", arch])
    assert both.exit_code == 2 and "not both" in both.stderr
    prof = _json(["profile", "--arch", arch, "--json"])
    assert prof["params"] == 124_439_808 and prof["path"] == "--arch"
    neither = runner.invoke(app, ["recommend"])
    assert neither.exit_code == 2 and "--arch" in neither.stderr


def test_debug_shows_the_user_code_traceback_from_the_child(tmp_path: Path) -> None:
    bad = tmp_path / "shapebug.py"
    bad.write_text("import torch, torch.nn as nn\n"
                   "class M(nn.Module):\n"
                   "    def __init__(self):\n"
                   "        super().__init__(); self.fc = nn.Linear(8, 2)\n"
                   "    def forward(self, x):\n"
                   "        return self.fc(x.view(-1, 7))\n"
                   "def build_model(): return M()\n"
                   "def example_batch(b, s): return torch.randn(b, 8)\n")
    plain = runner.invoke(app, ["profile", str(bad)])
    assert plain.exit_code == 2 and len(plain.stderr.strip().splitlines()) == 1
    debug = runner.invoke(app, ["--debug", "profile", str(bad)])
    assert debug.exit_code == 2
    assert f'File "{bad}", line 6, in forward' in debug.stderr


def test_estimate_json_has_the_pinned_time_and_memory_keys() -> None:
    est = _json(["estimate", "--arch", "layers=4,hidden=256,heads=4,seq=512", *H100, "--mbs", "2", "--json"])
    assert {"params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes",
            "overhead_bytes", "total_bytes", "capacity_bytes", "fits"} <= est["memory"].keys()
    assert {"step_s", "compute_s", "comm_s", "exposed_comm_s", "bubble_s", "tokens_per_s", "samples_per_s",
            "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu", "hfu"} <= est["time"].keys()


def test_estimate_takes_every_strategy_flag() -> None:
    arch = "layers=24,hidden=2048,heads=16,vocab=51200,seq=2048"
    est = _json(["estimate", "--arch", arch, "--gpu", "H100", "--gpus", "64", "--tp", "4", "--pp", "2", "--vpp", "3",
                 "--cp", "2", "--no-sp", "--zero", "1", "--global-batch", "64", "--mbs", "1",
                 "--checkpointing", "selective", "--no-flash", "--engine", "megatron", "--optimizer", "adamw8bit",
                 "--precision", "fp8", "--json"])
    s = est["strategy"]
    assert (s["dp"], s["tp"], s["pp"], s["vpp"], s["cp"], s["sp"]) == (4, 4, 2, 3, 2, False)
    assert (s["grad_accum"], s["engine"], s["optimizer"], s["precision"]) == (16, "megatron", "adamw8bit", "fp8")
    assert est["gpus"] == 64 and est["memory"]["rank"].startswith("pipeline stage")
    fsdp = _json(["estimate", "--arch", arch, *H100, "--fsdp", "hybrid", "--offload", "params", "--json"])
    assert fsdp["strategy"]["engine"] == "torch" and fsdp["memory"]["host_bytes"] > 0


def test_estimate_params_gives_model_states_only() -> None:
    est = _json(["estimate", "--params", "7e9", *H100, "--zero", "3", "--precision", "bf16", "--json"])
    assert est["time"] is None and est["memory"]["activations_bytes"] == 0
    assert est["memory"]["optimizer_bytes"] == 12 * 7e9 / 8 and est["memory"]["params_bytes"] == 2 * 7e9 / 8


def test_estimate_reads_a_cluster_file(tmp_path: Path) -> None:
    f = tmp_path / "cluster.yaml"
    f.write_text("gpu: A100-80GB\ngpus_per_node: 8\nnodes: 2\nprice_per_gpu_hour: 2.0\ngpu_power_w: 350\n")
    est = _json(["estimate", "--arch", "layers=4,hidden=256,heads=4,seq=512", "--cluster", str(f), "--tp", "2",
                 "--tokens", "1e9", "--json"])
    assert est["gpu"] == "A100-80GB" and est["gpus"] == 16 and est["strategy"]["dp"] == 8
    assert est["cost"]["cost_usd"] == pytest.approx(2.0 * est["cost"]["gpu_hours"])
    assert est["cost"]["energy_kwh"] == pytest.approx(16 * 350 * est["cost"]["train_time_s"] / 3.6e6)
    t = est["time"]  # the estimate's time to train and cost over its step band too
    assert est["cost"]["train_time_s_low"] == pytest.approx(est["cost"]["train_time_s"] * t["step_s_low"] / t["step_s"])
    assert est["cost"]["cost_usd_high"] == pytest.approx(est["cost"]["cost_usd"] * t["step_s_high"] / t["step_s"])
    for name in ("gpu_hours", "energy_kwh"):  # GPU-hours and energy scale with the step as well
        for end in ("low", "high"):
            assert est["cost"][f"{name}_{end}"] == pytest.approx(est["cost"][name] * t[f"step_s_{end}"] / t["step_s"])
    text = runner.invoke(app, ["estimate", "--arch", "layers=4,hidden=256,heads=4,seq=512", "--cluster", str(f),
                               "--tp", "2", "--tokens", "1e9"])
    flat = " ".join(text.stdout.split())  # the nominal figures, then the band that qualifies each of them
    assert text.exit_code == 0 and "(over the step's band: " in flat and ") (" not in flat, flat
    assert "kWh of GPU power (over the step's band: " in flat
    band = flat[flat.index("(over the step's band: "):].split(")")[0]
    assert band.count("GPU-hours") == 1 and band.count("$") == 2 and band.endswith("kWh"), band
    clash = runner.invoke(app, ["estimate", "--params", "1e9", "--cluster", str(f), "--gpus", "8"])
    assert clash.exit_code == 2 and "--gpus" in clash.stderr


def test_a_cluster_files_price_waits_for_a_token_budget(tmp_path: Path) -> None:
    """The file's price prices --tokens; without them recommend plans as usual (it said '--price needs --tokens')."""
    f = tmp_path / "cluster.yaml"
    f.write_text("gpu: H100-SXM\ngpus_per_node: 8\nnodes: 1\nprice_per_gpu_hour: 2.5\n")
    arch = ["--arch", "layers=2,hidden=256,heads=4,seq=512", "--cluster", str(f), "--method", "enumerate"]
    plain = _json(["recommend", *arch, "--json"])
    assert plain["plan"] is not None and plain["estimate"]["cost"] is None
    priced = _json(["recommend", *arch, "--tokens", "1e8", "--json"])
    cost = priced["estimate"]["cost"]
    assert cost["cost_usd"] == pytest.approx(2.5 * cost["gpu_hours"])
    text = runner.invoke(app, ["recommend", *arch, "--tokens", "1e8"])
    assert text.exit_code == 0 and " 0.0 h " not in text.stdout and " 0 GPU-hours" not in text.stdout
    line = next(x for x in text.stdout.splitlines() if x.startswith("to train"))
    assert f"{cost['gpu_hours']:.2g} GPU-hours" in line and f"${cost['cost_usd']:.2f}" in line, line
    # and the price at the ends of the step time's band (it scales with the step)
    t = priced["estimate"]["time"]
    assert t["step_s_low"] < t["step_s"] < t["step_s_high"]
    low, high = (cost["cost_usd"] * t[k] / t["step_s"] for k in ("step_s_low", "step_s_high"))
    assert (cost["cost_usd_low"], cost["cost_usd_high"]) == pytest.approx((low, high))
    assert cost["train_time_s_high"] == pytest.approx(cost["train_time_s"] * t["step_s_high"] / t["step_s"])
    flat = " ".join(text.stdout.split())  # the console wraps the line at 80 columns
    assert f"${cost['cost_usd']:.2f}, " in flat and f"${low:.2f}-${high:.2f}, " in flat, flat
    kwh = [amount(cost["energy_kwh"] * t[k] / t["step_s"]) for k in ("step_s_low", "step_s_high")]
    assert "kWh of GPU power (over the step's band: " in flat and f"{kwh[0]}-{kwh[1]} kWh)" in flat, flat


@pytest.mark.parametrize(("args", "needle"), [
    (["--tp", "3"], "not divisible by tp·pp·cp"),
    (["--tp", "16", "--gpus", "8"], "not divisible by tp·pp·cp = 16"),
    (["--tp", "8", "--arch", "layers=2,hidden=768,heads=12,seq=512"], "does not divide the 12 attention heads"),
    (["--pp", "8", "--arch", "layers=4,hidden=256,heads=4,seq=512"], "larger than the 4 layers"),
    (["--precision", "fp8", "--gpu", "A100-80GB"], "fp8"),
    (["--gpu", "H10"], "did you mean"),
    (["--mbs", "0"], "--mbs must be >= 1"),
    (["--zero", "5"], "--zero must be 0, 1, 2 or 3"),
    (["--fsdp", "sharded"], "unknown --fsdp"),
    (["--dp", "3"], "does not match --gpus 8"),
    (["--params", "-5"], "--params must be a finite number > 0"),
    (["--params", "inf"], "--params must be a finite number > 0"),
    (["--tokens", "inf"], "--tokens must be a finite number > 0"),
    (["--tokens", "1e12", "--price", "nan"], "--price must be a finite number >= 0 (got nan): e.g. --price 2.5"),
    (["--tokens", "-1e11"], "--tokens must be a finite number > 0 (got -1e+11): e.g. --tokens 1e11"),
    (["--arch", "layers=4,hidden=256,heads=4,seq=512", "--seq-len", "1024"], "disagree"),
    (["--arch", "layers=4,hidden=256,heads=4,layers=8,seq=512"], "gives layers twice"),
    (["--arch", "layers=0,hidden=256,heads=4,seq=512"], "invalid --arch layers=0"),
    (["--arch", "layers=4,hidden=256,heads=4", "--seq-len", "0"], "--seq-len must be >= 1"),
    (["--arch", "layers=12,hidden=256,heads=4,seq=512", "--pp", "4", "--vpp", "2", "--gas", "4", "--engine",
      "deepspeed"], "divisible by pp·vpp = 8"),
    (["--arch", "layers=12,hidden=256,heads=4,seq=512", "--pp", "8", "--vpp", "2", "--gas", "8", "--engine",
      "megatron"], "exceed the 12 layers plus the embedding and the loss"),
    (["--tp", "3", "--gpus", "8"], "is not divisible by tp"),
])
def test_estimate_bad_strategy_input_is_one_line_exit_2(args: list[str], needle: str) -> None:
    base = ["estimate"] + ([] if "--gpus" in args else ["--gpus", "8"])
    if "--arch" not in args:
        base += ["--params", "1e9"] if "--params" not in args else []
    if "--gpu" not in args:
        base += ["--gpu", "H100"]
    result = runner.invoke(app, base + args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_estimate_prices_tensor_parallelism_across_nodes() -> None:
    args = ["estimate", "--arch", "layers=24,hidden=2048,heads=16,seq=2048", "--gpus", "16", "--gpus-per-node", "8",
            "--engine", "megatron", "--gpu", "H100"]
    across = _json([*args, "--tp", "16", "--json"])
    inside = _json([*args, "--tp", "8", "--dp", "2", "--gas", "1", "--json"])
    assert across["strategy"]["tp"] == 16 and across["gpus"] == 16
    assert across["time"]["tp_comm_s"] > inside["time"]["tp_comm_s"]
    assert any("spans 2 nodes" in n for n in across["notes"])
    assert across["time"]["step_s_low"] < across["time"]["step_s"] < across["time"]["step_s_high"]
    shown = runner.invoke(app, [*args, "--tp", "16"])
    assert shown.exit_code == 0 and "spans 2 nodes" in " ".join(shown.stdout.split())


def test_recommend_reads_a_cluster_file(tmp_path: Path) -> None:
    f = tmp_path / "cluster.yaml"
    f.write_text("gpu: A100-40GB\ngpus_per_node: 4\nnodes: 1\n")
    doc = _json(["recommend", "--arch", "layers=4,hidden=256,heads=4,seq=512", "--cluster", str(f), "--json"])
    assert doc["cluster"]["gpu"] == "A100-40GB" and doc["cluster"]["gpus"] == 4 and doc["plan"]["dp"] == 4


@pytest.mark.parametrize(("args", "needle"), [
    (["--params", "inf"], "--params must be a finite number > 0"),
    (["--tokens", "nan"], "--tokens must be a finite number > 0"),
    (["--compute", "0"], "--compute must be a finite number > 0"),
])
def test_chinchilla_bad_numbers_name_their_flag(args: list[str], needle: str) -> None:
    result = runner.invoke(app, ["chinchilla", *args])
    assert result.exit_code == 2 and needle in result.stderr


def test_estimate_defaults_to_fp16_without_bf16_and_notes_uncalibrated_gpus() -> None:
    v100 = _json(["estimate", "--arch", "layers=4,hidden=256,heads=4,seq=512", "--gpu", "V100", "--gpus", "8",
                  "--json"])
    assert v100["strategy"]["precision"] == "fp16"
    assert any("no fitted efficiencies" in n for n in v100["notes"])
    a100 = _json(["estimate", "--arch", "layers=4,hidden=256,heads=4,seq=512", "--gpu", "A100", "--gpus", "8",
                  "--json"])
    assert not any("no fitted efficiencies" in n for n in a100["notes"])  # A100 is fitted...
    # ...but a 4-layer toy is far outside every measured run: the band says so, and only the band (after what the
    # profile itself says: a shape priced by formula)
    assert [n.split(" (")[0] for n in a100["notes"]] == ["profile from --arch by formula",
                                                          "time: outside the measured domain"]
    default = runner.invoke(app, ["estimate", "--params", "1e9", "--tp", "3"])
    assert default.exit_code == 2 and "(the detected or default count: pass --gpus)" in default.stderr


def test_estimate_takes_megatrons_communication_overlap() -> None:
    arch = "layers=16,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0,seq=4096"
    base = ["estimate", "--arch", arch, *H100, "--engine", "megatron", "--tp", "4", "--zero", "1", "--json"]
    plain = _json(base)
    over = _json([*base, "--comm-overlap"])
    assert over["strategy"]["comm_overlap"] is True and plain["strategy"]["comm_overlap"] is False
    assert over["time"]["tp_comm_s"] < plain["time"]["tp_comm_s"]
    assert over["time"]["comm_s"] == pytest.approx(plain["time"]["comm_s"])
    result = runner.invoke(app, ["estimate", "--arch", arch, *H100, "--fsdp", "full", "--comm-overlap"])
    assert result.exit_code != 0 and "--comm-overlap" in result.output and "Traceback" not in result.output


def _one_line_error(args: list[str], words: str) -> None:
    """``optplan ARGS`` fails with a one-line error (two lines at most: typer's usage line) naming ``words``."""
    result = runner.invoke(app, args)
    assert result.exit_code != 0 and words in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) <= 2


def test_estimate_takes_when_fsdp_reduces_its_gradients() -> None:
    arch = "layers=16,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0,seq=4096"
    base = ["estimate", "--arch", arch, *H100, "--engine", "torch", "--fsdp", "full", "--gas", "4", "--json"]
    plain = _json(base)
    once = _json([*base, "--fsdp-grad-sync", "step"])
    assert once["strategy"]["fsdp_grad_sync"] == "step" and plain["strategy"]["fsdp_grad_sync"] == "micro_batch"
    assert once["memory"]["total_bytes"] > plain["memory"]["total_bytes"]
    assert once["time"]["dp_comm_s"] < plain["time"]["dp_comm_s"]
    for bad, words in ((["--fsdp-grad-sync", "sometimes"], "--fsdp-grad-sync"),
                       (["--fsdp-grad-sync", "step", "--engine", "deepspeed", "--zero", "3"], "--fsdp-grad-sync")):
        _one_line_error(["estimate", "--arch", arch, *H100, *bad], words)


def test_fsdp_reduce_dtype_flag() -> None:
    arch = "layers=16,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0,seq=4096"
    base = ["estimate", "--arch", arch, "--gpu", "H100", "--gpus", "16", "--gpus-per-node", "8", "--engine", "torch",
            "--fsdp", "full", "--gas", "4", "--fsdp-grad-sync", "step", "--json"]
    plain, low = _json(base), _json([*base, "--fsdp-reduce-dtype", "bf16"])
    assert plain["strategy"]["fsdp_reduce_dtype"] == "auto" and low["strategy"]["fsdp_reduce_dtype"] == "bf16"
    assert low["memory"]["total_bytes"] < plain["memory"]["total_bytes"]  # the held gradients in bf16
    assert low["time"]["dp_comm_s"] < plain["time"]["dp_comm_s"]
    assert _json([*base, "--fsdp-reduce-dtype", "fp32"])["time"] == plain["time"]  # fp32 is bf16's default
    for bad, words in ((["--fsdp-reduce-dtype", "int8"], "--fsdp-reduce-dtype"),
                       (["--fsdp-reduce-dtype", "fp16", "--engine", "torch", "--fsdp", "full"],
                        "does not match precision bf16"),
                       (["--fsdp-reduce-dtype", "bf16", "--engine", "deepspeed", "--zero", "3"], "sets torch FSDP's")):
        _one_line_error(["estimate", "--arch", arch, *H100, *bad], words)


def test_async_tp_flag() -> None:
    arch = "layers=16,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0,seq=8192"
    base = ["estimate", "--arch", arch, "--gpu", "H100", "--gpus", "16", "--gpus-per-node", "8", "--engine", "torch",
            "--fsdp", "full", "--tp", "8", "--dp", "2", "--sp", "--compile", "--mbs", "4", "--json"]
    plain, fused = _json(base), _json([*base, "--async-tp"])
    assert not plain["strategy"]["async_tp"] and fused["strategy"]["async_tp"]
    assert fused["time"]["tp_comm_s"] < plain["time"]["tp_comm_s"] and fused["time"]["step_s"] < plain["time"]["step_s"]
    assert fused["memory"] == plain["memory"]  # a schedule of the same collectives, no buffer priced
    for bad, words in ((["--async-tp", "--engine", "megatron"], "--async-tp is torch's"),
                       (["--async-tp", "--engine", "torch", "--fsdp", "full", "--tp", "8", "--dp", "2"], "add --sp and --compile"),
                       (["--async-tp", "--engine", "torch", "--fsdp", "full", "--tp", "8", "--dp", "2", "--sp", "--compile",
                         "--gpus-per-node", "4"], "inside one node")):
        _one_line_error(["estimate", "--arch", arch, "--gpu", "H100", "--gpus", "16", *bad], words)


LLAMA_ARCH = "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1"


def test_compile_prices_fused_kernels_and_megatron_refuses_it() -> None:
    base = ["estimate", "--arch", LLAMA_ARCH, "--seq-len", "8192", "--gpu", "H100", "--gpus", "8", "--engine",
            "torch", "--fsdp", "full", "--mbs", "2", "--json"]
    eager = _json(base)
    compiled = _json([*base, "--compile"])
    assert compiled["strategy"]["compile"] is True and eager["strategy"]["compile"] is False
    # Inductor's kernels move a third of the eager bytes; the step saves about what torchtitan measured for this
    # model on 8 H100s (14 %: its eager/compiled pair, which the torch engine's eager multiplier reproduces)
    assert compiled["time"]["memory_bound_s"] < 0.6 * eager["time"]["memory_bound_s"]
    assert 0.05 < 1 - compiled["time"]["step_s"] / eager["time"]["step_s"] < 0.25
    assert any("torch.compile" in why for why in compiled["time"]["outside_measured"])
    bad = runner.invoke(app, ["estimate", "--arch", LLAMA_ARCH, "--gpu", "H100", "--gpus", "8", "--tp", "8",
                              "--engine", "megatron", "--compile"])
    assert bad.exit_code == 2 and "drop --compile" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_recommend_compile_plans_compile_and_eager_plans_say_what_it_would_save() -> None:
    base = ["recommend", "--arch", LLAMA_ARCH, "--seq-len", "4096", "--gpu", "H100", "--gpus", "8", "--engine",
            "torch", "--no-offload", "--json"]
    eager = _json(base)
    assert eager["plan"]["compile"] is False
    assert any("--compile" in line for line in eager["rationale"])
    compiled = _json([*base, "--compile"])
    assert compiled["plan"]["compile"] is True
    # the throughput objective's figure (the picks' micro-batches may differ, so not the step time)
    assert compiled["estimate"]["time"]["samples_per_s"] > eager["estimate"]["time"]["samples_per_s"]


def test_a_model_files_optplan_tokens_is_the_budget(tmp_path: Path) -> None:
    """README: OPTPLAN's ``tokens`` is a default: --objective time takes it when --tokens is not given (it was
    refused as missing); without it anywhere the one-line error stands; --price alone is refused, not ignored."""
    model = tmp_path / "tiny.py"
    model.write_text("import torch\nfrom torch import nn\n"
                     "OPTPLAN = {'seq_len': 32, 'tokens': 5e9}\n"
                     "def build_model():\n    return nn.Sequential(nn.Embedding(256, 32), nn.Linear(32, 256))\n")
    result = runner.invoke(app, ["recommend", str(model), "--objective", "time", "--gpus", "2", "--no-probe",
                                 "--json"], env={"OPTPLAN_CACHE_DIR": str(tmp_path / "cache")})
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["tokens"] == pytest.approx(5e9) and doc["objective"] == "time"
    assert doc["estimate"]["cost"]["train_time_s"] == pytest.approx(5e9 / doc["estimate"]["tokens_per_s"], rel=1e-6)
    model.write_text(model.read_text().replace(", 'tokens': 5e9", ""))
    missing = runner.invoke(app, ["recommend", str(model), "--objective", "time", "--gpus", "2", "--no-probe"],
                            env={"OPTPLAN_CACHE_DIR": str(tmp_path / "cache")})
    assert missing.exit_code == 2 and "needs --tokens" in missing.output
    price = runner.invoke(app, ["recommend", "--arch", "layers=2,hidden=64,heads=2,seq=128", "--gpus", "2",
                                "--price", "2"])
    assert price.exit_code == 2 and "--price needs --tokens" in price.output


def test_recommend_limits_the_checkpointing_searched() -> None:
    """--checkpointing (repeatable) is what the export errors' "plan with --checkpointing full" asks for: every plan
    shown uses a named mode; a mode the model cannot run is one line."""
    arch = ["recommend", "--arch", "layers=4,hidden=256,heads=4,seq=128", "--gpus", "2"]
    result = runner.invoke(app, [*arch, "--checkpointing", "full", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert {doc["plan"]["checkpointing"], *(a["plan"]["checkpointing"] for a in doc["alternatives"])} == {"full"}
    # full alone is every block; partial (searched with full) adds the fewest first blocks that fit
    assert {doc["plan"]["checkpoint_layers"], *(a["plan"]["checkpoint_layers"] for a in doc["alternatives"])} == {None}
    part = json.loads(runner.invoke(app, [*arch, "--checkpointing", "partial", "--json"]).output)
    assert {part["plan"]["checkpointing"], *(a["plan"]["checkpointing"] for a in part["alternatives"])} == {"full"}
    both = json.loads(runner.invoke(app, [*arch, "--checkpointing", "none", "--checkpointing", "full", "--json"]).output)
    assert {both["plan"]["checkpointing"], *(a["plan"]["checkpointing"] for a in both["alternatives"])} <= {"none", "full"}
    for bad, needle in ((["--checkpointing", "sometimes"], "unknown --checkpointing"), (["--checkpointing", "moe"], "has none")):
        r = runner.invoke(app, [*arch, *bad])
        assert r.exit_code == 2 and needle in r.output, r.output


def test_a_resumed_study_says_so_in_the_header(tmp_path: Path) -> None:
    """A rerun on a finished study re-prices only what it recorded: the header and PLAN.md say so instead of
    'searched 0 plans' (PLAN.md: '0 candidates priced') beside a count of recorded plans."""
    args = ["recommend", "--arch", "layers=4,hidden=256,heads=4,seq=128", "--gpus", "2", "--storage",
            str(tmp_path / "s.log")]
    first = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert first.exit_code == 0 and "searched " in first.output and "resumed the study" not in first.output
    assert "resumed the study" not in (tmp_path / "a" / "PLAN.md").read_text()
    again = runner.invoke(app, [*args, "--out", str(tmp_path / "b")])
    text = " ".join(again.output.split())
    assert again.exit_code == 0 and "resumed the study in" in text and "plans it recorded re-priced" in text
    assert "searched 0 plans" not in text
    search = (tmp_path / "b" / "PLAN.md").read_text().split("## Search", 1)[1]
    assert "resumed the study: " in search and "candidates it recorded re-priced" in search, search
    assert " 0 candidates priced" not in search


def test_nothing_fits_names_the_leanest_plan_whole_against_the_usable_memory() -> None:
    """The NO PLAN FITS panel prints plan labels as text ('[megatron]' was swallowed as markup) and compares with the
    usable GiB the table uses (it said the datasheet's 80.0)."""
    result = runner.invoke(app, ["recommend", "--arch", "layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,"
                                 "vocab=128256,gated=1,tied=0,seq=4096", "--gpus", "8", "--gpu", "H100-SXM",
                                 "--no-offload"])
    text = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 1 and "NO PLAN FITS" in text
    assert "[megatron]) of 78.4 GiB usable" in text and " )" not in text


def test_storage_and_results_paths_are_checked_in_one_line(tmp_path: Path) -> None:
    """A --storage in a missing folder, or a folder, and a results folder given to calibrate: one line each that
    names the fix (they said the file was 'not an optplan study' and 'fix its permissions'); a --storage inside the
    --out folder about to be created works."""
    arch = ["recommend", "--arch", "layers=2,hidden=64,heads=2,seq=64", "--gpus", "2"]
    missing = runner.invoke(app, [*arch, "--storage", str(tmp_path / "no" / "s.log")])
    assert missing.exit_code == 2 and "does not exist: create it" in missing.output
    folder = runner.invoke(app, [*arch, "--storage", str(tmp_path)])
    assert folder.exit_code == 2 and "is a folder: give a file in it" in folder.output
    results = runner.invoke(app, ["calibrate", str(tmp_path)])
    assert results.exit_code == 2 and "is a folder: pass the measurements.json" in results.output
    out = tmp_path / "plan"
    inside = runner.invoke(app, [*arch, "--storage", str(out / "s.log"), "--out", str(out)])
    assert inside.exit_code == 0, inside.output
    assert (out / "s.log").is_file() and (out / "plan.json").is_file()


def test_a_gpus_range_note_names_the_range_not_one_count() -> None:
    """Without --gpu the cluster note came from GPU detection ("no GPU detected ...: planning for 8 x H100-SXM"),
    which contradicted the searched range; every such note now says the range."""
    doc = _json(["recommend", "--arch", "layers=12,hidden=768,heads=12,vocab=50257,seq=1024", "--gpus-range", "8:16",
                 "--json"])
    planning = [n for n in doc["notes"] if "planning for" in n]
    assert planning and all("planning for 8-16 x" in n for n in planning), planning


def test_estimate_keeps_what_the_profile_noticed(tmp_path: Path) -> None:
    """An OPTPLAN typo's warning reaches estimate's notes (text and --json), as it does recommend's."""
    f = tmp_path / "typo.py"
    f.write_text("import torch, torch.nn as nn\nOPTPLAN = {'precison': 'fp32'}\n"
                 "def build_model():\n    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))\n"
                 "def example_batch(batch_size, seq_len):\n    return torch.randn(batch_size, 32)\n")
    doc = _json(["estimate", str(f), *H100, "--json"])
    assert any("OPTPLAN['precison'] is not a key" in n for n in doc["notes"]), doc["notes"]
    text = runner.invoke(app, ["estimate", str(f), *H100])
    assert text.exit_code == 0 and "precison" in text.stdout


def test_a_token_budget_on_a_model_without_tokens_is_refused_not_priced_as_infinite(tmp_path: Path) -> None:
    """--objective time/cost, --price and --tokens count the budget in tokens: a model of images has none (the time
    objective ranked every plan at 'inf days' and picked a slow one); one line naming what to drop. The file's
    OPTPLAN tokens on such a model is not a budget either: the throughput plan stands."""
    model = tmp_path / "images.py"
    model.write_text("import torch\nfrom torch import nn\n"
                     "OPTPLAN = {'tokens': 5e9}\n"
                     "def build_model():\n    return nn.Sequential(nn.Flatten(), nn.Linear(48, 10))\n"
                     "def example_batch(batch_size, seq_len):\n    return torch.randn(batch_size, 3, 4, 4)\n")
    env = {"OPTPLAN_CACHE_DIR": str(tmp_path / "cache")}
    for extra, named in ((["--objective", "time"], "drop --tokens and --objective time"),
                         (["--price", "2"], "drop --tokens and --price"), ([], "drop --tokens (")):
        result = runner.invoke(app, ["recommend", str(model), "--tokens", "1e9", "--gpus", "2", "--no-probe", *extra],
                               env=env)
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "--tokens needs a token model" in lines[0] and named in lines[0], lines
    plain = runner.invoke(app, ["recommend", str(model), "--gpus", "2", "--no-probe", "--json"], env=env)
    assert plain.exit_code == 0, plain.output
    doc = json.loads(plain.output)
    assert doc["tokens"] is None and doc["objective"] == "throughput"
