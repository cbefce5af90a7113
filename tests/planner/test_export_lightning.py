"""lightning.json export, checked by Lightning's own Trainer, strategies and precision plugins (no GPU).

Golden files live in tests/planner/golden/lightning/; after a reviewed change regenerate them with
``OPTPLAN_UPDATE_GOLDEN=1 python -m pytest tests/planner/test_export_lightning.py`` and review the diff.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from optplan.estimators.buckets import DeepSpeedBuckets
from optplan.estimators.errors import OptplanError
from optplan.estimators.strategy import Strategy
from optplan.planner.export.context import ExportPlan, NotExportable
from optplan.planner.export.deepspeed import render_ds_config
from optplan.planner.export.lightning import (
    RESERVED_KEYS,
    lightning_notes,
    lightning_spec,
    lightning_trainer_kwargs,
    render_lightning_json,
)
from optplan.planner.export.lightning_check import validate_lightning_json
from optplan.planner.validate import ExportValidationError

GOLDEN = Path(__file__).parent / "golden" / "lightning"
UPDATE = os.environ.get("OPTPLAN_UPDATE_GOLDEN") == "1"

BUCKETS = DeepSpeedBuckets(
    reduce_bucket_size=589_824, allgather_bucket_size=589_824, stage3_prefetch_bucket_size=530_841,
    stage3_param_persistence_threshold=7_680, stage3_max_live_parameters=1_000_000_000,
)


def make_plan(*, block_class: str | None = "Block", gpus_per_node: int = 8, **strategy: Any) -> ExportPlan:
    """Torch plans without FSDP default to amp-bf16: the trainers' 16-bit switch is autocast there, and plans with
    16-bit weights and fp32 masters (bf16, fp16) are refused (test_export_registry.py)."""
    if strategy.get("engine") == "torch" and strategy.get("fsdp", "none") == "none":
        strategy.setdefault("precision", "amp-bf16")
    return ExportPlan(
        strategy=Strategy(**strategy), model="gpt2", model_path="examples/gpt2.py", block_class=block_class,
        params=124_439_808, seq_len=1024, buckets=BUCKETS, gpu="H100-SXM", gpus_per_node=gpus_per_node,
    )


def ds_config_for(plan: ExportPlan, **kw: Any) -> dict[str, Any]:
    """The DeepSpeed export's ds_config for ``plan``, whichever form render_ds_config takes."""
    first = next(iter(inspect.signature(render_ds_config).parameters))
    if first == "plan":  # pragma: no cover - a later signature
        return render_ds_config(plan, **kw)
    return render_ds_config(plan.strategy, plan.buckets, **kw)


def check(plan: ExportPlan) -> dict[str, Any]:
    text = render_lightning_json(plan)
    validate_lightning_json(text, plan)
    return json.loads(text)


def text_of(spec: dict[str, Any]) -> str:
    return json.dumps(spec, indent=2) + "\n"


def tiny_model() -> Any:
    """A model whose repeated block class is called Block (what the plans name)."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h = nn.ModuleList([Block(), Block()])

    return GPT()


# --------------------------------------------------------------------------------------------------
# Golden files
# --------------------------------------------------------------------------------------------------

GOLDEN_CASES: dict[str, dict[str, Any]] = {
    "single_gpu_bf16": {"engine": "torch", "dp": 1, "mbs": 8},
    "ddp_2x8_amp_fp16_sgd": {"engine": "torch", "dp": 16, "mbs": 4, "grad_accum": 2, "precision": "amp-fp16",
                             "optimizer": "sgd"},
    "ddp_8gpu_fp8_ckpt": {"engine": "torch", "dp": 8, "mbs": 4, "precision": "fp8", "checkpointing": "full"},
    "fsdp_full_2x8_ckpt": {"engine": "torch", "fsdp": "full", "dp": 16, "mbs": 2, "grad_accum": 4,
                           "checkpointing": "full"},
    "fsdp_grad_op_offload_bf16_pure": {"engine": "torch", "fsdp": "grad_op", "dp": 8, "mbs": 4,
                                       "offload_params": "cpu", "precision": "bf16-pure"},
    "fsdp_hybrid_2x8_adafactor": {"engine": "torch", "fsdp": "hybrid", "dp": 16, "mbs": 2, "optimizer": "adafactor",
                                  "checkpointing": "selective"},
    "zero1_adamw8bit": {"engine": "deepspeed", "zero": 1, "dp": 8, "mbs": 4, "optimizer": "adamw8bit"},
    "zero2_offload_fp16": {"engine": "deepspeed", "zero": 2, "dp": 8, "mbs": 4, "precision": "fp16",
                           "offload_optimizer": "cpu"},
    "zero2_amp_bf16_ckpt": {"engine": "deepspeed", "zero": 2, "dp": 8, "mbs": 2, "grad_accum": 8,
                            "precision": "amp-bf16", "checkpointing": "full"},
    "zero3_offload_2x8": {"engine": "deepspeed", "zero": 3, "dp": 16, "mbs": 2, "offload_optimizer": "cpu",
                          "offload_params": "cpu"},
    "zero3_nvme_optimizer_only": {"engine": "deepspeed", "zero": 3, "dp": 8, "mbs": 2, "offload_optimizer": "nvme"},
    "zero3_bf16_pure_sgd": {"engine": "deepspeed", "zero": 3, "dp": 8, "mbs": 2, "precision": "bf16-pure",
                            "optimizer": "sgd"},
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden(name: str) -> None:
    plan = make_plan(**GOLDEN_CASES[name])
    text = render_lightning_json(plan)
    path = GOLDEN / f"{name}.json"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"missing golden {path}: run with OPTPLAN_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(encoding="utf-8"), \
        f"{name} differs from {path} (OPTPLAN_UPDATE_GOLDEN=1 updates it)"
    validate_lightning_json(text, plan)


def test_golden_files_have_no_strays() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.json")) == sorted(GOLDEN_CASES)


# --------------------------------------------------------------------------------------------------
# Round trips through Lightning
# --------------------------------------------------------------------------------------------------

ZERO_OFFLOADS = [  # (stage, optimizer offload, parameter offload, Lightning preset)
    (0, "none", "none", "deepspeed"), (1, "none", "none", "deepspeed_stage_1"), (1, "cpu", "none", "deepspeed"),
    (2, "none", "none", "deepspeed_stage_2"), (2, "cpu", "none", "deepspeed_stage_2_offload"),
    (3, "none", "none", "deepspeed_stage_3"), (3, "cpu", "none", "deepspeed"),
    (3, "cpu", "cpu", "deepspeed_stage_3_offload"), (3, "nvme", "none", "deepspeed"),
    (3, "none", "nvme", "deepspeed"),
    (3, "nvme", "nvme", "deepspeed_stage_3_offload_nvme"),
]


@pytest.mark.parametrize("dp", [1, 8, 32])
@pytest.mark.parametrize("zero, opt, params, preset", ZERO_OFFLOADS)
def test_every_zero_stage_and_offload_round_trips(zero: int, opt: str, params: str, preset: str, dp: int) -> None:
    plan = make_plan(engine="deepspeed", zero=zero, offload_optimizer=opt, offload_params=params, dp=dp, mbs=2,
                     grad_accum=3)
    spec = check(plan)
    assert spec["strategy"] == preset
    assert (spec["devices"], spec["num_nodes"]) == (min(dp, 8), max(1, dp // 8))
    assert spec["accumulate_grad_batches"] == 3
    config = spec["_strategy_kwargs"]["config"]
    expected = ds_config_for(plan)
    for key in ("gradient_accumulation_steps", "gradient_clipping", "train_batch_size"):
        expected.pop(key)
    assert config == expected  # the DeepSpeed export's config, less what Lightning fills


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("offload", ["none", "cpu"])
@pytest.mark.parametrize("fsdp", ["full", "grad_op", "hybrid"])
def test_every_fsdp_form_round_trips(fsdp: str, offload: str, checkpointing: str, nodes: int) -> None:
    plan = make_plan(engine="torch", fsdp=fsdp, offload_params=offload, checkpointing=checkpointing, dp=8 * nodes)
    spec = check(plan)
    kwargs = spec["_strategy_kwargs"]
    assert spec["strategy"] == ("fsdp_cpu_offload" if offload == "cpu" else "fsdp")
    assert kwargs["sharding_strategy"] == {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD_OP",
                                           "hybrid": "HYBRID_SHARD"}[fsdp]
    assert kwargs["cpu_offload"] is (offload == "cpu")
    assert kwargs["auto_wrap_policy"] == ["Block"]
    assert kwargs.get("activation_checkpointing_policy") == (["Block"] if checkpointing == "full" else None)
    assert kwargs.get("device_mesh") == ([nodes, 8] if fsdp == "hybrid" else None)


def test_fsdp_strategy_object_is_what_the_plan_says() -> None:
    """The real loader: the helper builds FSDPStrategy from the file with the model's own Block class."""
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    plan = make_plan(engine="torch", fsdp="hybrid", offload_params="cpu", checkpointing="full", dp=16)
    model = tiny_model()
    block = type(model.h[0])
    kwargs = lightning_trainer_kwargs(json.loads(render_lightning_json(plan)), model)
    strategy = kwargs["strategy"]
    assert type(strategy).__name__ == "FSDPStrategy"
    assert strategy.sharding_strategy is ShardingStrategy.HYBRID_SHARD
    assert strategy.cpu_offload.offload_params is True
    assert isinstance(strategy.kwargs["auto_wrap_policy"], ModuleWrapPolicy)
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {block}
    assert strategy.kwargs["device_mesh"] == (2, 8)
    assert strategy._activation_checkpointing_kwargs["auto_wrap_policy"]._module_classes == {block}
    assert {k: kwargs[k] for k in ("devices", "num_nodes", "precision", "accumulate_grad_batches")} == {
        "devices": 8, "num_nodes": 2, "precision": "bf16-mixed", "accumulate_grad_batches": 1}
    with pytest.raises(OptplanError, match="model"):
        lightning_trainer_kwargs(json.loads(render_lightning_json(plan)))


def test_helper_names_a_block_class_the_model_lacks() -> None:
    import torch.nn as nn

    spec = json.loads(render_lightning_json(make_plan(engine="torch", fsdp="full", dp=8)))
    with pytest.raises(OptplanError, match="'Block', which the model has no module of"):
        lightning_trainer_kwargs(spec, nn.Sequential(nn.Linear(2, 2)))


def test_deepspeed_strategy_object_takes_the_config() -> None:
    plan = make_plan(engine="deepspeed", zero=3, offload_optimizer="cpu", offload_params="cpu", dp=16)
    spec = json.loads(render_lightning_json(plan))
    strategy = lightning_trainer_kwargs(spec)["strategy"]
    assert type(strategy).__name__ == "DeepSpeedStrategy"
    assert strategy.config == spec["_strategy_kwargs"]["config"]
    assert strategy.zero_stage_3


def test_cpu_trainer_from_the_helper() -> None:
    """A DDP file applied the documented way, with only the accelerator swapped for this CPU machine."""
    from lightning.pytorch import Trainer

    plan = make_plan(engine="torch", dp=1, mbs=4, grad_accum=8, precision="fp32")
    kwargs = lightning_trainer_kwargs(json.loads(render_lightning_json(plan)))
    trainer = Trainer(**{**kwargs, "accelerator": "cpu"}, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    assert trainer.accumulate_grad_batches == 8 and trainer.gradient_clip_val == 1.0
    assert trainer.gradient_clip_algorithm == "norm"


@pytest.mark.parametrize("engine, precision, expected", [
    ("torch", "fp32", "32-true"), ("torch", "amp-bf16", "bf16-mixed"), ("torch", "bf16", "bf16-mixed"),
    ("torch", "amp-fp16", "16-mixed"), ("torch", "fp16", "16-mixed"), ("torch", "bf16-pure", "bf16-true"),
    ("torch", "fp8", "transformer-engine"),
    ("deepspeed", "fp32", "32-true"), ("deepspeed", "amp-bf16", "32-true"), ("deepspeed", "amp-fp16", "32-true"),
    ("deepspeed", "bf16", "bf16-mixed"), ("deepspeed", "fp16", "16-mixed"), ("deepspeed", "bf16-pure", "bf16-true"),
])
def test_precisions(engine: str, precision: str, expected: str) -> None:
    fsdp = "full" if (engine, precision) in (("torch", "bf16"), ("torch", "fp16")) else "none"  # DDP: refused
    plan = make_plan(engine=engine, zero=2 if engine == "deepspeed" else 0, precision=precision, dp=8, fsdp=fsdp)
    assert check(plan)["precision"] == expected


@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adafactor", "sgd"])
def test_every_optimizer(engine: str, optimizer: str) -> None:
    plan = make_plan(engine=engine, zero=2 if engine == "deepspeed" else 0, optimizer=optimizer, dp=8)
    spec = check(plan)
    opt = spec["_optplan"]["optimizer"]
    if engine == "deepspeed" and optimizer in ("adamw", "sgd"):
        assert opt["built_by"] == "deepspeed" and "optimizer" in spec["_strategy_kwargs"]["config"]
    else:
        assert opt["built_by"] == "configure_optimizers"
        assert opt["class"] == {"adamw": "torch.optim.AdamW", "adamw8bit": "bitsandbytes.optim.AdamW8bit",
                                "adafactor": "torch.optim.Adafactor", "sgd": "torch.optim.SGD"}[optimizer]


def test_single_gpu_and_ddp() -> None:
    single = check(make_plan(engine="torch", dp=1))
    assert single["strategy"] == "auto" and "_strategy_kwargs" not in single and single["devices"] == 1
    ddp = check(make_plan(engine="torch", dp=32))
    assert (ddp["strategy"], ddp["devices"], ddp["num_nodes"]) == ("ddp", 8, 4)
    small_nodes = check(make_plan(engine="torch", dp=8, gpus_per_node=4))
    assert (small_nodes["devices"], small_nodes["num_nodes"]) == (4, 2)


def test_schema_keys() -> None:
    spec = lightning_spec(make_plan(engine="torch", fsdp="full", dp=8))
    assert [k for k in spec if k.startswith("_")] == list(RESERVED_KEYS)
    assert spec["_optplan"]["module_class_args"] == ["auto_wrap_policy"]
    assert spec["_optplan"]["batch_size"] == 1 and spec["_optplan"]["world_size"] == 8


def test_validation_leaves_no_global_state() -> None:
    import torch

    env = dict(os.environ)
    levels = {name: logging.getLogger(name).level for name in ("lightning.pytorch", "lightning.fabric", "DeepSpeed")}
    benchmark = torch.backends.cudnn.benchmark
    for plan in (make_plan(engine="torch", fsdp="full", dp=8), make_plan(engine="deepspeed", zero=3, dp=8)):
        check(plan)
    spec = json.loads(render_lightning_json(make_plan(engine="torch", dp=8)))
    validate_lightning_json(text_of({**spec, "deterministic": True, "benchmark": True}),
                            make_plan(engine="torch", dp=8))
    assert dict(os.environ) == env
    assert {name: logging.getLogger(name).level for name in levels} == levels
    assert torch.backends.cudnn.benchmark == benchmark and not torch.are_deterministic_algorithms_enabled()


def test_renderer_imports_neither_lightning_nor_torch() -> None:
    code = (
        "import sys\n"
        "from optplan.estimators.buckets import DeepSpeedBuckets\n"
        "from optplan.estimators.strategy import Strategy\n"
        "from optplan.planner.export.context import ExportPlan\n"
        "from optplan.planner.export.lightning import render_lightning_json\n"
        "b = DeepSpeedBuckets(reduce_bucket_size=10**6, allgather_bucket_size=10**6,"
        " stage3_prefetch_bucket_size=9*10**5, stage3_param_persistence_threshold=10**4,"
        " stage3_max_live_parameters=10**9)\n"
        "for s in (Strategy(engine='torch', fsdp='hybrid', dp=16), Strategy(zero=3, dp=8)):\n"
        "    render_lightning_json(ExportPlan(strategy=s, model='m', model_path='', block_class='Block', params=10,"
        " buckets=b, gpu='H100-SXM', gpus_per_node=8))\n"
        "heavy = ('lightning', 'pytorch_lightning', 'transformers', 'deepspeed', 'torch')\n"
        "bad = [m for m in heavy if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_notes() -> None:
    notes = lightning_notes(make_plan(engine="torch", dp=16, mbs=2, grad_accum=4))
    assert any("DataLoader(batch_size=2)" in n and "global batch 128" in n for n in notes)
    assert any("MASTER_ADDR" in n for n in notes)
    assert any("configure_optimizers" in n for n in lightning_notes(make_plan(engine="deepspeed", zero=2, dp=8)))
    assert any("torch_autocast" in n
               for n in lightning_notes(make_plan(engine="deepspeed", zero=2, dp=8, precision="amp-fp16")))
    assert any("transformer_engine" in n for n in lightning_notes(make_plan(engine="torch", dp=8, precision="fp8")))
    spec = lightning_spec(make_plan(engine="torch", dp=8, checkpointing="selective"))
    assert any("every other matmul" in n for n in spec["_optplan"]["notes"])


# --------------------------------------------------------------------------------------------------
# Plans the file cannot express
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, extra, match", [
    ({"engine": "megatron", "tp": 2, "dp": 4}, {}, "Megatron-LM"),
    ({"engine": "deepspeed", "zero": 1, "pp": 2, "dp": 4}, {}, "pp=2"),
    ({"engine": "torch", "fsdp": "full", "tp": 2, "dp": 4}, {}, "tp=2"),
    ({"engine": "torch", "fsdp": "full", "dp": 8, "precision": "fp8"}, {}, "transformer-engine"),
    ({"engine": "deepspeed", "zero": 2, "dp": 8, "precision": "fp8"}, {}, "fp8"),
    ({"engine": "torch", "fsdp": "grad_op", "dp": 8}, {"block_class": None}, "repeated block"),
    ({"engine": "torch", "fsdp": "full", "dp": 8, "grad_accum": 4, "fsdp_grad_sync": "step"}, {},
     "fsdp-grad-sync micro_batch"),
    ({"engine": "torch", "dp": 12}, {}, "whole number of 8-GPU nodes"),
    ({"engine": "deepspeed", "zero": 0, "dp": 8, "precision": "bf16-pure"}, {}, "ZeRO stage 1-3"),
    # NVMe optimizer offload below ZeRO-3 is refused by Strategy itself (tests/estimators/test_memory.py)
    ({"engine": "deepspeed", "zero": 2, "dp": 8, "offload_optimizer": "cpu", "optimizer": "adafactor"}, {},
     "offload"),
])
def test_unexportable_plans_are_refused(strategy: dict[str, Any], extra: dict[str, Any], match: str) -> None:
    plan = make_plan(**extra, **strategy)
    with pytest.raises(NotExportable, match=match) as err:
        render_lightning_json(plan)
    assert "\n" not in str(err.value)
    with pytest.raises(ExportValidationError, match="no Lightning export"):
        validate_lightning_json(text_of({"accelerator": "gpu", "devices": 8}), plan)


@pytest.mark.parametrize("kw, match", [({"gradient_clip_val": -1.0}, "gradient_clip_val"),
                                       ({"nvme_path": " "}, "--nvme-path")])
def test_bad_render_options(kw: dict[str, Any], match: str) -> None:
    plan = make_plan(engine="deepspeed", zero=3, dp=8, offload_params="nvme")
    with pytest.raises(OptplanError, match=match):
        render_lightning_json(plan, **kw)


# --------------------------------------------------------------------------------------------------
# Files the validator must reject
# --------------------------------------------------------------------------------------------------

DDP = make_plan(engine="torch", dp=16, mbs=2, grad_accum=4)
HYBRID = make_plan(engine="torch", fsdp="hybrid", dp=16, checkpointing="full")
ZERO3 = make_plan(engine="deepspeed", zero=3, offload_optimizer="cpu", offload_params="cpu", dp=8)


def edited(plan: ExportPlan, *path: str, value: Any) -> str:
    """The plan's file with the value at ``path`` replaced (``KeyError`` removes the key)."""
    spec = json.loads(render_lightning_json(plan))
    node = spec
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        node.pop(path[-1])
    else:
        node[path[-1]] = copy.deepcopy(value)
    return text_of(spec)


REJECTED: dict[str, tuple[ExportPlan, str, str]] = {
    "not_json": (DDP, "{", "not JSON"),
    "not_object": (DDP, "[]", "JSON object"),
    "unknown_trainer_key": (DDP, edited(DDP, "accumulate_grad_batch", value=4),
                            "'accumulate_grad_batch' \\(did you mean 'accumulate_grad_batches'"),
    "unknown_underscore_key": (DDP, edited(DDP, "_strategy_kwarg", value={}), "'_strategy_kwarg'"),
    "devices_as_str": (DDP, edited(DDP, "num_nodes", value="2"), "num_nodes='2' has the wrong type"),
    "accumulate_as_float": (DDP, edited(DDP, "accumulate_grad_batches", value=4.0), "accumulate_grad_batches=4.0"),
    "precision_not_lightning": (DDP, edited(DDP, "precision", value="bf16-amp"), "precision='bf16-amp'"),
    "strategy_not_registered": (DDP, edited(DDP, "strategy", value="dpp"), "'dpp' \\(did you mean 'ddp'"),
    "cpu_accelerator": (DDP, edited(DDP, "accelerator", value="cpu"), "accelerator='cpu'"),
    "devices_mismatch": (DDP, edited(DDP, "devices", value=4), "devices=4 x num_nodes=2 must be the plan's 16"),
    "nodes_mismatch": (DDP, edited(DDP, "devices", value=16, ).replace('"num_nodes": 2', '"num_nodes": 1'),
                       "devices=16 but the plan needs 8"),
    "accumulate_mismatch": (DDP, edited(DDP, "accumulate_grad_batches", value=KeyError),
                            "accumulate_grad_batches=1 but the plan needs 4"),
    "precision_mismatch": (DDP, edited(DDP, "precision", value="16-mixed"), "precision='16-mixed' but the plan"),
    "strategy_mismatch": (DDP, edited(DDP, "strategy", value="fsdp"), "strategy='fsdp' but the plan needs 'ddp'"),
    "unknown_ddp_kwarg": (DDP, edited(DDP, "_strategy_kwargs", value={"static_grpah": True}),
                          "not DDPStrategy arguments: 'static_grpah' \\(did you mean 'static_graph'"),
    "batch_size_mismatch": (DDP, edited(DDP, "_optplan", "batch_size", value=4), "_optplan.batch_size=4"),
    "sharding_mismatch": (HYBRID, edited(HYBRID, "_strategy_kwargs", "sharding_strategy", value="FULL_SHARD"),
                          "sharding_strategy='FULL_SHARD' but the plan needs 'HYBRID_SHARD'"),
    "offload_mismatch": (HYBRID, edited(HYBRID, "strategy", value="fsdp_cpu_offload").replace(
        '"cpu_offload": false,', ""), "cpu_offload=True but the plan needs False"),  # the preset's init_params
    "wrap_mismatch": (HYBRID, edited(HYBRID, "_strategy_kwargs", "auto_wrap_policy", value=["GPT2Block"]),
                      "auto_wrap_policy=\\['GPT2Block'\\]"),
    "no_checkpointing": (HYBRID, edited(HYBRID, "_strategy_kwargs", "activation_checkpointing_policy",
                                        value=KeyError),
                         "activation_checkpointing_policy=None"),
    "mesh_mismatch": (HYBRID, edited(HYBRID, "_strategy_kwargs", "device_mesh", value=[1, 16]),
                      "device_mesh=\\[1, 16\\]"),
    "unknown_strategy_kwarg": (HYBRID, edited(HYBRID, "_strategy_kwargs", "sharding_strategi", value="HYBRID_SHARD"),
                               "'sharding_strategi' \\(did you mean 'sharding_strategy'"),
    "strategy_rejects_kwargs": (HYBRID, edited(HYBRID, "_strategy_kwargs", "process_group", value=[1, 2]),
                                "Lightning rejects _strategy_kwargs.*mutually exclusive"),
    "kwargs_without_strategy": (HYBRID, edited(HYBRID, "strategy", value=KeyError), "not 'auto'"),
    "ds_stage_mismatch": (ZERO3, edited(ZERO3, "_strategy_kwargs", "config", "zero_optimization", "stage", value=2),
                          "zero_optimization.stage=2 but the plan needs 3"),
    "ds_precision_mismatch": (ZERO3, edited(ZERO3, "_strategy_kwargs", "config", "bf16", value={"enabled": False}),
                              "bf16.enabled=False"),
    "ds_preset_mismatch": (ZERO3, edited(ZERO3, "strategy", value="deepspeed_stage_3"),
                           "'deepspeed_stage_3' stands for ZeRO-3 with optimizer/parameter offload none/none"),
    "ds_accumulation_in_config": (ZERO3, edited(ZERO3, "_strategy_kwargs", "config", "gradient_accumulation_steps",
                                                value=1), "gradient_accumulation_steps, which Lightning refuses"),
    "ds_clip_by_value": (ZERO3, edited(ZERO3, "gradient_clip_algorithm", value="value"), "by norm only"),
    "ds_unknown_config_key": (ZERO3, edited(ZERO3, "_strategy_kwargs", "config", "zero_optimisation", value={}),
                              "DeepSpeed does not know"),
    "ds_bad_config_value": (ZERO3, edited(ZERO3, "_strategy_kwargs", "config", "zero_optimization",
                                          "reduce_bucket_size", value=-5), "DeepSpeed rejects ds_config"),
    "ds_config_path": (ZERO3, edited(ZERO3, "_strategy_kwargs", "config", value="ds_config.json"),
                       "a path cannot be checked|needs _strategy_kwargs.config"),
    "trainer_rejects": (DDP, edited(DDP, "gradient_clip_algorithm", value="clip"),
                        "Trainer rejects lightning.json.*clip"),
}


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_rejected_files(name: str) -> None:
    plan, text, match = REJECTED[name]
    with pytest.raises(ExportValidationError, match=match) as err:
        validate_lightning_json(text, plan)
    assert "\n" not in str(err.value)


def test_equivalent_spellings_are_accepted() -> None:
    """Registry presets, lower-case sharding names and a bare class name mean the same to Lightning."""
    spec = json.loads(render_lightning_json(HYBRID))
    spec["_strategy_kwargs"]["sharding_strategy"] = "hybrid_shard"
    spec["_strategy_kwargs"]["auto_wrap_policy"] = "Block"
    validate_lightning_json(text_of(spec), HYBRID)
    ddp = json.loads(render_lightning_json(DDP))
    ddp["strategy"] = "ddp_find_unused_parameters_false"
    ddp["_strategy_kwargs"] = {"static_graph": True, "bucket_cap_mb": 50}  # torch DDP arguments
    validate_lightning_json(text_of(ddp), DDP)
    assert lightning_trainer_kwargs(ddp)["strategy"]._ddp_kwargs == {
        "find_unused_parameters": False, "static_graph": True, "bucket_cap_mb": 50}
    zero = json.loads(render_lightning_json(ZERO3))
    zero["strategy"] = "deepspeed"
    validate_lightning_json(text_of(zero), ZERO3)


def test_compile_plans_say_how_to_compile_under_lightning() -> None:
    assert any("block.compile()" in n for n in lightning_notes(make_plan(engine="torch", dp=8, compile=True)))
    assert not any("torch.compile" in n for n in lightning_notes(make_plan(engine="torch", dp=8)))


def test_a_compiled_plan_says_to_compile_the_loss_function_too() -> None:
    compiled = lightning_notes(make_plan(engine="torch", dp=8, compile=True))
    assert any("torch.compile(loss_fn)" in n and "--eager-loss" in n for n in compiled)
    blocks_only = lightning_notes(make_plan(engine="torch", dp=8, compile=True, compile_loss=False))
    assert not any("torch.compile(loss_fn)" in n for n in blocks_only)


def test_lightnings_16_bit_reduction_is_named_when_the_plan_reduces_in_fp32() -> None:
    # FSDPPrecision.mixed_precision_config: reduce_dtype = param_dtype (bf16 under bf16-mixed, fp16 under 16-mixed)
    fp32 = lightning_notes(make_plan(engine="torch", fsdp="full", dp=8, precision="fp16"))
    assert any("reduces gradients in fp16" in n and "--fsdp-reduce-dtype fp16" in n for n in fp32)
    for kw in ({"fsdp_reduce_dtype": "bf16"}, {"precision": "bf16-pure"}, {"fsdp": "none"}):
        plan = make_plan(**{"engine": "torch", "fsdp": "full", "dp": 8, **kw})
        assert not any("reduces gradients in" in n for n in lightning_notes(plan))
    # bf16-mixed over fp32 weights (amp-bf16) reduces in bf16 too: a mix no recipe prices, said so
    amp = lightning_notes(make_plan(engine="torch", fsdp="full", dp=8, precision="amp-bf16"))
    assert any("reduces gradients in bf16" in n and "no optplan recipe" in n for n in amp)
