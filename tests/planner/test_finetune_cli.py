"""``--finetune lora|qlora`` end to end: flag checks (one line each, before profiling), the single-GPU QLoRA plan of
an --hf model, its finetune.json/finetune.py exports built and checked, and finetune.py training on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_models import save_tiny_llama
from typer.testing import CliRunner

from optplan.tui.cli import app

runner = CliRunner()


@pytest.mark.parametrize("argv,message", [
    (["estimate", "--arch", "layers=2,hidden=64,heads=4", "--finetune", "lora"], "adds adapters to a real model"),
    (["estimate", "examples/mlp.py", "--lora-rank", "8"], "add --finetune lora"),
    (["estimate", "examples/mlp.py", "--lora-rank", "8", "--lora-alpha", "4"],
     "--lora-rank, --lora-alpha apply to LoRA fine-tuning: add --finetune lora (or qlora), or drop --lora-rank and "
     "--lora-alpha"),
    (["estimate", "examples/mlp.py", "--finetune", "qlora", "--quant", "none"], "--finetune qlora quantises"),
    (["estimate", "examples/mlp.py", "--finetune", "lora", "--quant", "fp3"], "unknown --quant 'fp3'"),
    (["recommend", "examples/mlp.py", "--finetune", "adapter"], "unknown --finetune 'adapter'"),
    (["recommend", "examples/mlp.py", "--finetune", "lora", "--lora-rank", "0"], "--lora-rank must be >= 1"),
    (["profile", "examples/mlp.py", "--finetune", "lora", "--lora-targets", " , "], "--lora-targets is empty"),
    (["estimate", "examples/mlp.py", "--quant", "nf4"], "--quant applies to LoRA fine-tuning"),
    (["estimate", "examples/mlp.py", "--lora-dropout", "0.1"], "--lora-dropout applies to LoRA fine-tuning"),
    (["estimate", "examples/mlp.py", "--finetune", "lora", "--lora-dropout", "1.5"], "--lora-dropout is a probability"),
    # layouts finetune.py cannot start are refused, not priced (or silently turned into a torch plan)
    (["estimate", "examples/llama.py", "--finetune", "lora", "--gpus", "2", "--zero", "2"], "not deepspeed: drop --zero"),
    (["estimate", "examples/llama.py", "--finetune", "lora", "--gpus", "2", "--engine", "deepspeed"],
     "not deepspeed: drop --engine"),
    (["estimate", "examples/llama.py", "--finetune", "lora", "--gpus", "2", "--tp", "2"], "with --tp 2"),
    (["estimate", "examples/llama.py", "--finetune", "qlora", "--gpus", "2", "--fsdp", "full", "--offload", "params"],
     "with offload"),
    (["recommend", "examples/llama.py", "--finetune", "lora", "--gpus", "2", "--engine", "deepspeed"],
     "--engine names deepspeed"),
])
def test_bad_finetune_flags_are_one_line(argv: list[str], message: str) -> None:
    r = runner.invoke(app, argv)
    assert r.exit_code == 2 and message in r.output, r.output
    assert "Traceback" not in r.output


def test_lora_targets_that_match_nothing(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    r = runner.invoke(app, ["profile", "examples/mlp.py", "--finetune", "lora", "--lora-targets", "q_proj"])
    assert r.exit_code == 2 and "match no linear layer" in r.output and "name some of its linear layers" in r.output


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama saved with random weights and a word-level tokenizer, and a 16-line jsonl dataset."""
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    return save_tiny_llama(tmp_path_factory.mktemp("ft"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's OPTPLAN_CACHE_DIR: the --hf model file is written once, at one path, so that the profile cache
    profiles each LoRA request of it once (the LoRA plans of 1 and 2 GPUs share one)."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("method,quant,precision,dropout", [("qlora", "nf4-dq", "bf16-pure", 0.05),
                                                            ("lora", "none", "amp-bf16", None)])
def test_single_gpu_plan_exports_and_trains(hf_model: Path, cache_dir: Path, tmp_path: Path, method: str, quant: str,
                                            precision: str, dropout: float | None) -> None:
    out = tmp_path / "plan"
    env = {"OPTPLAN_CACHE_DIR": str(cache_dir)}
    extra = ["--lora-dropout", str(dropout)] if dropout is not None else []
    r = runner.invoke(app, ["recommend", "--hf", str(hf_model / "model"), "--finetune", method, "--gpu", "RTX-4090",
                            "--gpus", "1", "--seq-len", "64", "--no-probe", "--out", str(out), "--json", *extra],
                      env=env)
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output[r.output.index("{"):])
    plan = rec["plan"]["strategy"] if "strategy" in rec["plan"] else rec["plan"]
    assert (plan["quant"], plan["precision"], plan["engine"], plan["dp"]) == (quant, precision, "torch", 1)
    cfg = json.loads((out / "finetune.json").read_text())
    assert cfg["lora"]["r"] == 16 and cfg["lora"]["target_modules"][0] == "q_proj"
    assert cfg["lora"]["lora_dropout"] == (dropout or 0.0)  # the dropout the memory was profiled with
    assert (cfg["bnb"] or {}).get("bnb_4bit_use_double_quant", False) is (quant == "nf4-dq")
    assert cfg["sft"]["per_device_train_batch_size"] == plan["mbs"] and cfg["sft"]["max_length"] == 64
    assert not (out / "train.py").exists() and not (out / "ds_config.json").exists()  # they train every parameter
    run = subprocess.run([sys.executable, "finetune.py", "--dataset", str(hf_model / "data.jsonl"), "--max-steps", "2",
                          "--cpu"], cwd=out, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "out" / "adapter_model.safetensors").is_file()


def test_export_refuses_full_training_plans_for_finetune(tmp_path: Path) -> None:
    r = runner.invoke(app, ["recommend", "examples/mlp.py", "--gpu", "H100-SXM", "--gpus", "1", "--no-probe",
                            "--out", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["export", str(tmp_path / "p" / "plan.json"), "--to", "finetune", "--out",
                            str(tmp_path / "q")])
    assert r.exit_code == 2 and "needs a Hugging Face model" in r.output and "--hf" in r.output


def test_qlora_plans_without_bitsandbytes_and_says_the_launch_needs_it(hf_model: Path, cache_dir: Path,
                                                                       tmp_path: Path) -> None:
    """bitsandbytes missing (a None entry in sys.modules makes its import fail): the plan and its exports are
    still made (the formats are priced from formulas), and a note names what the launch needs. (The module's cache
    folder: the profile of rank-16 adapters without dropout is the LoRA plan's above, not made again.)"""
    code = ("import sys; sys.modules['bitsandbytes'] = None\n"
            "from optplan.tui.cli import main\n"
            f"main(['recommend', '--hf', {str(hf_model / 'model')!r}, '--finetune', 'qlora', '--gpu', 'RTX-4090', "
            f"'--gpus', '1', '--seq-len', '64', '--no-probe', '--out', {str(tmp_path / 'o')!r}])\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OPTPLAN_CACHE_DIR": str(cache_dir), "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "bitsandbytes cannot be imported here" in run.stdout and "pip install bitsandbytes" in run.stdout
    assert "Traceback" not in run.stdout + run.stderr
    assert json.loads((tmp_path / "o" / "finetune.json").read_text())["bnb"]["load_in_4bit"] is True


def test_two_gpu_lora_plan_launches_finetune_py(hf_model: Path, cache_dir: Path, tmp_path: Path) -> None:
    """launch.sh of a LoRA plan starts finetune.py (train.py trains every parameter): two DDP processes on the CPU."""
    out = tmp_path / "plan"
    r = runner.invoke(app, ["recommend", "--hf", str(hf_model / "model"), "--finetune", "lora", "--gpu", "RTX-4090",
                            "--gpus", "2", "--seq-len", "64", "--global-batch", "8", "--no-probe", "--out", str(out)],
                      env={"OPTPLAN_CACHE_DIR": str(cache_dir)})
    assert r.exit_code == 0, r.output
    launch = (out / "launch.sh").read_text()
    assert "DEFAULT_TRAIN_SCRIPT=finetune.py" in launch and "--nproc-per-node 2" in launch
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", "launch.sh", "--dataset", str(hf_model / "data.jsonl"), "--cpu", "--max-steps", "1"],
                         cwd=out, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "out" / "adapter_model.safetensors").is_file()


def test_a_lora_plan_of_a_model_file_exports_no_script_and_its_launch_sh_says_so(tmp_path: Path) -> None:
    """finetune.py loads a Hugging Face model and train.py trains every parameter: a LoRA plan of a plain model file
    gets neither, every refusal says what to do instead, and launch.sh stops before any rank starts unless
    TRAIN_SCRIPT names the user's script (it started a finetune.py that was never written)."""
    pytest.importorskip("peft")
    out = tmp_path / "p"
    r = runner.invoke(app, ["recommend", "examples/mlp.py", "--finetune", "lora", "--gpu", "H100-SXM", "--gpus", "1",
                            "--no-probe", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert not (out / "finetune.py").exists() and not (out / "train.py").exists()
    assert "LoRA plan of a model file, which finetune.py cannot load" in " ".join(r.output.split())
    launch = (out / "launch.sh").read_text()
    assert "this LoRA plan is of a model file, so optplan wrote no finetune.py" in launch
    env = {**os.environ, "TRAIN_SCRIPT": str(tmp_path / "missing.py")}
    run = subprocess.run(["bash", str(out / "launch.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 2 and "optplan wrote no finetune.py" in run.stderr
    doc = json.loads((out / "plan.json").read_text())
    assert doc["export"]["adapter"]["rank"] > 0  # what the note points the user's script at


def test_recommend_json_names_the_lora_flags_that_price_the_plan_again(tmp_path: Path) -> None:
    """``finetune`` (estimate's flag names) with ``plan``: estimate with those flags gives the plan's own estimate (a
    LoRA plan on a 16-bit base has quant none, which alone read as a full fine-tune)."""
    pytest.importorskip("peft")
    r = runner.invoke(app, ["recommend", "examples/mlp.py", "--finetune", "lora", "--lora-rank", "4", "--gpu",
                            "H100-SXM", "--gpus", "1", "--no-probe", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    ft, plan = doc["finetune"], doc["plan"]
    assert ft["finetune"] == "lora" and ft["lora_rank"] == 4 and ft["quant"] == plan["quant"] == "none"
    flags = ["--finetune", ft["finetune"], "--lora-rank", str(ft["lora_rank"]), "--lora-alpha", str(ft["lora_alpha"]),
             "--lora-targets", ft["lora_targets"], "--lora-dropout", str(ft["lora_dropout"])]
    plan_flags = ["--precision", plan["precision"], "--mbs", str(plan["mbs"]), "--gas", str(plan["grad_accum"]),
                  "--checkpointing", plan["checkpointing"], "--engine", plan["engine"]]
    again = runner.invoke(app, ["estimate", "examples/mlp.py", "--gpu", "H100-SXM", "--gpus", "1", *flags, *plan_flags,
                                "--json"])
    assert again.exit_code == 0, again.output
    est = json.loads(again.output)
    assert est["time"]["step_s"] == pytest.approx(doc["estimate"]["time"]["step_s"], rel=1e-9)
    assert est["memory"]["total_bytes"] == doc["estimate"]["memory"]["total_bytes"]
    full = json.loads(runner.invoke(app, ["recommend", "examples/mlp.py", "--gpu", "H100-SXM", "--gpus", "1",
                                          "--no-probe", "--json"]).output)
    assert full["finetune"] is None
