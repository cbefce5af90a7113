"""Full fine-tuning of a Hugging Face model: the search offers torch tensor parallelism by the model's own tp_plan,
and finetune.json/finetune.py launch it through transformers' DistributedConfig (checked by building it, and
by loading the tiny model sharded over CPU processes under torchrun and running one forward and backward)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hf_models import save_tiny_llama
from typer.testing import CliRunner

from optplan.estimators.buckets import DeepSpeedBuckets
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from optplan.planner.export.context import ExportPlan, NotExportable
from optplan.planner.export.finetune import render_finetune_json, render_finetune_py, validate_finetune
from optplan.planner.hf_source import find_hf_config, write_hf_model_file
from optplan.planner.space import build_space
from optplan.planner.validate import ExportValidationError
from optplan.probes.loader import profile_model_file
from optplan.tui.cli import app

runner = CliRunner()
BUCKETS = DeepSpeedBuckets(reduce_bucket_size=589_824, allgather_bucket_size=589_824,
                           stage3_prefetch_bucket_size=530_841, stage3_param_persistence_threshold=7_680,
                           stage3_max_live_parameters=1_000_000_000)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("trl")
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.distributed")
    del transformers
    return save_tiny_llama(tmp_path_factory.mktemp("full"))


@pytest.fixture(scope="module")
def model_file(hf_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_model_file(find_hf_config(str(hf_model / "model")), tmp_path_factory.mktemp("gen"))


def _plan(model_file: Path, **strategy: object) -> ExportPlan:
    s = Strategy(**{"engine": "torch", "precision": "amp-bf16", "mbs": 2, **strategy})  # type: ignore[arg-type]
    return ExportPlan(strategy=s, model="tiny", model_path=str(model_file), block_class="LlamaDecoderLayer",
                      params=100_000, seq_len=32, buckets=BUCKETS, gpu="H100-SXM", gpus_per_node=8)


def _write(plan: ExportPlan, out: Path) -> dict:
    config, script = render_finetune_json(plan), render_finetune_py(plan)
    validate_finetune(config, script, plan)
    out.mkdir()
    (out / "finetune.json").write_text(config)
    (out / "finetune.py").write_text(script)
    return json.loads(config)


def test_hf_profile_carries_its_plan_and_the_search_offers_torch_tp(model_file: Path) -> None:
    prof = profile_model_file(str(model_file), seq_len=64)
    assert prof.tensor_plan is not None and prof.tensor_plan.gathers_logits
    assert prof.tensor_plan.sharded_params == prof.params - (2 * 2 + 1) * 64  # all but the norms
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8)
    space = build_space(prof, cluster, engines=["torch"])
    torch_tp = [g for g in space.groups() if g.layout.tp > 1]
    assert {g.layout.tp for g in torch_tp} == {2}  # the 2 key-value heads allow tp 2 only
    assert all(g.sharding.engine == "torch" and g.layout.pp == g.layout.cp == 1 for g in torch_tp)
    assert {g.sharding.fsdp for g in torch_tp} == {"full"}  # dp 4: FSDP2 FULL_SHARD, what DistributedConfig runs
    # a model without a plan (a model file of one's own) gets no torch tensor parallelism
    plain = build_space(prof.model_copy(update={"tensor_plan": None}), cluster, engines=["torch"])
    assert not [g for g in plain.groups() if g.layout.tp > 1]


@pytest.mark.parametrize(("tp", "dp", "fsdp"), [(2, 1, "none"), (2, 2, "full")])
def test_tensor_parallel_plan_loads_sharded_and_steps(model_file: Path, hf_model: Path, tmp_path: Path, tp: int,
                                                      dp: int, fsdp: str) -> None:
    cfg = _write(_plan(model_file, tp=tp, dp=dp, fsdp=fsdp, checkpointing="full"), tmp_path / "out")
    dist = cfg["model"]["distributed_config"]
    assert (dist["tp_size"], dist["fsdp_size"], dist["tp_plan"]) == (tp, dp, "auto")
    assert cfg["lora"] is None and cfg["model"]["dtype"] == "float32"
    assert "fsdp" not in cfg["sft"]  # transformers shards the model itself: the Trainer must not wrap it again
    assert cfg["sft"]["activation_checkpointing"] is True
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun
    run = subprocess.run([torchrun, "--nproc-per-node", str(tp * dp), "finetune.py", "--dataset",
                          str(hf_model / "data.jsonl"), "--cpu", "--dry-run"], cwd=tmp_path / "out",
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    losses = re.findall(r"dry run: loss (\d+\.\d+)", run.stdout)  # the ranks' lines may interleave
    assert len(losses) == tp * dp and len(set(losses)) == 1, run.stdout  # same micro-batch, same loss on each


def test_dry_run_takes_chat_messages_as_well_as_text(model_file: Path, hf_model: Path, tmp_path: Path) -> None:
    """finetune.py's docstring promises "text" or chat "messages" rows; --dry-run read row["text"] only (KeyError)."""
    _write(_plan(model_file, dp=1), tmp_path / "out")
    rows = [json.loads(line) for line in (hf_model / "data.jsonl").read_text().splitlines()]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["text"]},
                                                     {"role": "assistant", "content": r["text"]}]}) + "\n"
                            for r in rows))
    run = subprocess.run([sys.executable, "finetune.py", "--dataset", str(chat), "--cpu", "--dry-run"],
                         cwd=tmp_path / "out", capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"dry run: loss \d+\.\d+", run.stdout), run.stdout


def test_full_fine_tune_trains_with_sft_trainer(hf_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan"
    env = {"OPTPLAN_CACHE_DIR": str(tmp_path / "cache")}
    r = runner.invoke(app, ["recommend", "--hf", str(hf_model / "model"), "--finetune", "full", "--gpu", "H100-SXM",
                            "--gpus", "1", "--seq-len", "64", "--no-probe", "--engine", "torch", "--precision",
                            "amp-bf16", "--out", str(out)],  # SFTTrainer's bf16 switch is autocast without FSDP
                      env=env)
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "finetune.json").read_text())  # written under "all": an --hf model
    assert cfg["lora"] is None and "distributed_config" not in cfg["model"]
    run = subprocess.run([sys.executable, "finetune.py", "--dataset", str(hf_model / "data.jsonl"), "--max-steps", "1",
                          "--cpu"], cwd=out, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize(("strategy", "message"), [
    ({"tp": 2, "dp": 4, "fsdp": "grad_op"}, "FULL_SHARD only"),
    ({"tp": 2, "dp": 4, "fsdp": "none"}, "FULL_SHARD only"),
    ({"tp": 2, "pp": 2, "dp": 2, "fsdp": "full"}, "--pp 1"),
    ({"tp": 2, "dp": 4, "fsdp": "full", "precision": "fp8"}, "no fp8 switch"),
])
def test_unlaunchable_plans_are_refused(model_file: Path, strategy: dict, message: str) -> None:
    with pytest.raises(NotExportable, match=message):
        render_finetune_json(_plan(model_file, **strategy))


def test_validator_catches_a_mesh_that_is_not_the_plans(model_file: Path) -> None:
    plan = _plan(model_file, tp=2, dp=4, fsdp="full")
    cfg = json.loads(render_finetune_json(plan))
    cfg["model"]["distributed_config"]["tp_size"] = 4
    cfg["model"]["distributed_config"]["fsdp_size"] = 2
    with pytest.raises(ExportValidationError, match=r"\(tp, dp, cpu offload\)"):
        validate_finetune(json.dumps(cfg), render_finetune_py(plan), plan)
    del cfg["model"]["distributed_config"]
    with pytest.raises(ExportValidationError, match="no distributed_config"):
        validate_finetune(json.dumps(cfg), render_finetune_py(plan), plan)


def test_deepspeed_full_plan_writes_its_ds_config(model_file: Path) -> None:
    """A full fine-tune on DeepSpeed ZeRO: finetune.json's SFTConfig names ds_config.json (written with it), checked
    with HF's own DeepSpeed integration, as hf_training_args.json is."""
    pytest.importorskip("deepspeed")
    from optplan.planner.export.registry import render_targets

    plan = _plan(model_file, engine="deepspeed", zero=2, dp=8, precision="bf16", grad_accum=2)
    files, skipped = render_targets(plan, ["finetune"])
    assert skipped == [] and set(files) == {"finetune.json", "finetune.py", "ds_config.json"}
    cfg = json.loads(files["finetune.json"])
    ds = json.loads(files["ds_config.json"])
    assert cfg["sft"]["deepspeed"] == "ds_config.json" and cfg["sft"]["bf16"] is True
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_accumulation_steps"] == 2
    assert cfg["sft"]["learning_rate"] == ds["optimizer"]["params"]["lr"]  # HF compares the two
    cfg["sft"]["gradient_accumulation_steps"] = 4
    with pytest.raises(ExportValidationError):
        validate_finetune(json.dumps(cfg), files["finetune.py"], plan)
    with pytest.raises(NotExportable, match="Megatron-LM"):
        render_finetune_json(_plan(model_file, engine="megatron", zero=1, dp=8, precision="bf16"))


@pytest.mark.parametrize("strategy", [{"dp": 4, "fsdp": "full", "grad_accum": 4},
                                      {"tp": 2, "dp": 2, "fsdp": "full", "grad_accum": 4}])
def test_fsdp_accumulation_syncs_each_micro_batch(model_file: Path, tmp_path: Path, strategy: dict) -> None:
    """The Trainer would accumulate FSDP gradients unsharded (no_sync) without sync_each_batch (export/hf.py writes it, export/hf_check.py refuses it)."""
    cfg = _write(_plan(model_file, **strategy), tmp_path / "out")
    assert cfg["sft"]["accelerator_config"] == {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    plain = _write(_plan(model_file, **{**strategy, "grad_accum": 1}), tmp_path / "one")
    assert "accelerator_config" not in plain["sft"]
