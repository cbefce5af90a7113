"""hf_training_args.json export, checked by transformers' own TrainingArguments and DeepSpeed integration (no GPU).

Golden files live in tests/planner/golden/hf/; after a reviewed change regenerate them with
``OPTPLAN_UPDATE_GOLDEN=1 python -m pytest tests/planner/test_export_hf.py`` and review the diff.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from optplan.estimators.buckets import DeepSpeedBuckets
from optplan.estimators.errors import OptplanError
from optplan.estimators.strategy import Strategy
from optplan.planner.export.context import ExportPlan, NotExportable
from optplan.planner.export.deepspeed import ADAMW_PARAMS, render_ds_config
from optplan.planner.export.hf import OPTIM_NAMES, hf_notes, hf_training_args, render_hf_training_args
from optplan.planner.export.hf_check import validate_hf_training_args
from optplan.planner.export.json_types import json_value_fits
from optplan.planner.validate import ExportValidationError

GOLDEN = Path(__file__).parent / "golden" / "hf"
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
    """The DeepSpeed export's ds_config for ``plan``."""
    return render_ds_config(plan.strategy, plan.buckets, **kw)


def args_of(plan: ExportPlan, **kw: Any) -> dict[str, Any]:
    return json.loads(render_hf_training_args(plan, **kw))


def text_of(args: dict[str, Any]) -> str:
    return json.dumps(args, indent=2) + "\n"


def check(plan: ExportPlan, **kw: Any) -> dict[str, Any]:
    """Render, then validate with the ds_config of the same plan (DeepSpeed plans)."""
    text = render_hf_training_args(plan, **kw)
    ds = ds_config_for(plan) if plan.strategy.engine == "deepspeed" else None
    validate_hf_training_args(text, plan, ds_config=ds)
    return json.loads(text)


# --------------------------------------------------------------------------------------------------
# Golden files
# --------------------------------------------------------------------------------------------------

GOLDEN_CASES: dict[str, dict[str, Any]] = {
    "single_gpu_bf16": {"engine": "torch", "dp": 1, "mbs": 8},
    "ddp_8gpu_amp_fp16": {"engine": "torch", "dp": 8, "mbs": 4, "grad_accum": 4, "precision": "amp-fp16"},
    "ddp_2x8_fp32_sgd_ckpt": {"engine": "torch", "dp": 16, "mbs": 4, "precision": "fp32", "optimizer": "sgd",
                              "checkpointing": "full"},
    "fsdp_full_2x8_ckpt": {"engine": "torch", "fsdp": "full", "dp": 16, "mbs": 2, "grad_accum": 4,
                           "checkpointing": "full"},
    "fsdp_grad_op_offload_selective": {"engine": "torch", "fsdp": "grad_op", "dp": 8, "mbs": 4,
                                       "offload_params": "cpu", "checkpointing": "selective"},
    "zero1_adamw8bit": {"engine": "deepspeed", "zero": 1, "dp": 8, "mbs": 4, "optimizer": "adamw8bit"},
    "zero2_offload_fp16_sgd": {"engine": "deepspeed", "zero": 2, "dp": 8, "mbs": 4, "precision": "fp16",
                               "optimizer": "sgd", "offload_optimizer": "cpu"},
    "zero2_amp_bf16_adafactor": {"engine": "deepspeed", "zero": 2, "dp": 8, "mbs": 2, "grad_accum": 8,
                                 "precision": "amp-bf16", "optimizer": "adafactor"},
    "zero3_nvme_2x8_ckpt": {"engine": "deepspeed", "zero": 3, "dp": 16, "mbs": 2, "grad_accum": 2,
                            "offload_optimizer": "nvme", "offload_params": "nvme", "checkpointing": "full"},
    "zero3_bf16_pure": {"engine": "deepspeed", "zero": 3, "dp": 8, "mbs": 2, "precision": "bf16-pure"},
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden(name: str) -> None:
    plan = make_plan(**GOLDEN_CASES[name])
    text = render_hf_training_args(plan)
    path = GOLDEN / f"{name}.json"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"missing golden {path}: run with OPTPLAN_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(encoding="utf-8"), \
        f"{name} differs from {path} (OPTPLAN_UPDATE_GOLDEN=1 updates it)"
    ds = ds_config_for(plan) if plan.strategy.engine == "deepspeed" else None
    validate_hf_training_args(text, plan, ds_config=ds)


def test_golden_files_have_no_strays() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.json")) == sorted(GOLDEN_CASES)


# --------------------------------------------------------------------------------------------------
# Round trips through transformers (TrainingArguments, HF's DeepSpeed integration, HfArgumentParser)
# --------------------------------------------------------------------------------------------------

ZERO_OFFLOADS = [  # (stage, optimizer offload, parameter offload): every form ds_config.json takes
    (0, "none", "none"), (1, "none", "none"), (1, "cpu", "none"), (2, "none", "none"), (2, "cpu", "none"),
    (3, "none", "none"), (3, "cpu", "none"), (3, "cpu", "cpu"), (3, "nvme", "none"), (3, "none", "nvme"),
    (3, "nvme", "nvme"),
]


@pytest.mark.parametrize("dp", [1, 8, 32])
@pytest.mark.parametrize("zero, opt, params", ZERO_OFFLOADS)
def test_every_zero_stage_and_offload_round_trips(zero: int, opt: str, params: str, dp: int) -> None:
    plan = make_plan(engine="deepspeed", zero=zero, offload_optimizer=opt, offload_params=params, dp=dp, mbs=2,
                     grad_accum=3)
    args = check(plan)
    assert args["deepspeed"] == "ds_config.json"
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (2, 3)
    assert "fsdp" not in args and "ddp_find_unused_parameters" not in args


@pytest.mark.parametrize("dp", [1, 8, 16])
@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
@pytest.mark.parametrize("offload", ["none", "cpu"])
@pytest.mark.parametrize("fsdp", ["full", "grad_op"])
def test_every_fsdp_form_round_trips(fsdp: str, offload: str, checkpointing: str, dp: int) -> None:
    plan = make_plan(engine="torch", fsdp=fsdp, offload_params=offload, checkpointing=checkpointing, dp=dp)
    args = check(plan)
    assert args["fsdp"] is True
    assert args["fsdp_config"] == {
        "version": 2, "reshard_after_forward": fsdp == "full", "cpu_offload": offload == "cpu",
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_layer_cls_to_wrap": ["Block"],
        "activation_checkpointing": checkpointing == "full",
    }
    assert args["activation_checkpointing"] is False  # FSDP's own checkpointing instead (the Trainer refuses both)


def test_fsdp_plugin_args_are_what_the_plan_says() -> None:
    """TrainingArguments turns fsdp_config into accelerate's FSDP plugin arguments as planned."""
    from transformers import TrainingArguments

    plan = make_plan(engine="torch", fsdp="grad_op", offload_params="cpu", checkpointing="full", dp=16)
    args = TrainingArguments(**args_of(plan), use_cpu=True)
    assert args.fsdp_plugin_args == {
        "fsdp_version": 2, "cpu_offload": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_cls_names_to_wrap": "Block", "cpu_ram_efficient_loading": False,
        "state_dict_type": "FULL_STATE_DICT", "activation_checkpointing": True, "reshard_after_forward": False,
    }
    assert args.mixed_precision == "bf16"


@pytest.mark.parametrize("engine, precision, bf16, fp16", [
    ("torch", "fp32", False, False), ("torch", "amp-bf16", True, False), ("torch", "bf16", True, False),  # FSDP
    ("torch", "amp-fp16", False, True), ("torch", "fp16", False, True),
    ("deepspeed", "fp32", False, False), ("deepspeed", "amp-bf16", False, False), ("deepspeed", "bf16", True, False),
    ("deepspeed", "amp-fp16", False, False), ("deepspeed", "fp16", False, True),
    ("deepspeed", "bf16-pure", True, False),
])
def test_precision_flags(engine: str, precision: str, bf16: bool, fp16: bool) -> None:
    plan = make_plan(engine=engine, zero=2 if engine == "deepspeed" else 0, precision=precision, dp=8,
                     fsdp="full" if (engine, precision) in (("torch", "bf16"), ("torch", "fp16")) else "none")
    args = check(plan)
    assert (args["bf16"], args["fp16"]) == (bf16, fp16)


@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adafactor", "sgd"])
def test_every_optimizer_round_trips(engine: str, optimizer: str) -> None:
    from transformers.training_args import OptimizerNames

    plan = make_plan(engine=engine, zero=1 if engine == "deepspeed" else 0, optimizer=optimizer, dp=8)
    args = check(plan)
    assert args["optim"] == OPTIM_NAMES[optimizer]
    assert OptimizerNames(args["optim"])  # a name transformers 5 knows
    if optimizer in ("adamw", "adamw8bit"):
        assert (args["learning_rate"], [args["adam_beta1"], args["adam_beta2"]], args["adam_epsilon"],
                args["weight_decay"]) == (ADAMW_PARAMS["lr"], ADAMW_PARAMS["betas"], ADAMW_PARAMS["eps"],
                                          ADAMW_PARAMS["weight_decay"])
    if optimizer == "sgd":
        assert args["optim_args"] == "momentum=0.9" and args["weight_decay"] == 0.0


def test_trainer_builds_the_planned_optimizer() -> None:
    """transformers' own optimizer lookup gives the planned class and hyper-parameters (torch engine)."""
    import torch
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(**args_of(make_plan(engine="torch", dp=8)), use_cpu=True)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls is torch.optim.AdamW
    assert kwargs == {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "fused": True}
    args = TrainingArguments(**args_of(make_plan(engine="torch", dp=8, optimizer="sgd")), use_cpu=True)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls is torch.optim.SGD and kwargs == {"lr": 3e-4, "momentum": 0.9}


def test_ddp_and_single_gpu_settings() -> None:
    assert check(make_plan(engine="torch", dp=16))["ddp_find_unused_parameters"] is False
    single = check(make_plan(engine="torch", dp=1))
    assert "ddp_find_unused_parameters" not in single and "fsdp" not in single and "deepspeed" not in single


def test_checkpointing_outside_fsdp_uses_non_reentrant_kwargs() -> None:
    for plan in (make_plan(engine="torch", dp=8, checkpointing="full"),
                 make_plan(engine="deepspeed", zero=2, dp=8, checkpointing="full")):
        args = check(plan)
        assert args["activation_checkpointing"] is True
        assert args["activation_checkpointing_kwargs"] == {"use_reentrant": False}
    assert check(make_plan(engine="torch", dp=8, checkpointing="selective"))["activation_checkpointing"] is False


def test_hf_argument_parser_reads_the_file_next_to_ds_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real loaders: HfArgumentParser parses the JSON, TrainingArguments opens ds_config.json by its name."""
    from transformers import HfArgumentParser, TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    plan = make_plan(engine="deepspeed", zero=3, dp=1, mbs=4, grad_accum=2, offload_optimizer="cpu")
    (tmp_path / "ds_config.json").write_text(json.dumps(ds_config_for(plan)), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    args = json.loads(render_hf_training_args(plan, output_dir=str(tmp_path / "out")))
    try:
        (parsed,) = HfArgumentParser(TrainingArguments).parse_dict({**args, "use_cpu": True})
        assert parsed.hf_deepspeed_config.is_zero3() and parsed.hf_deepspeed_config.is_offload()
        assert parsed.hf_deepspeed_config.mismatches == []  # one process: world size 1 = the plan's
        assert parsed.per_device_train_batch_size == 4 and parsed.gradient_accumulation_steps == 2
    finally:
        unset_hf_deepspeed_config()
    (tmp_path / "args.json").write_text(render_hf_training_args(plan), encoding="utf-8")
    raw = json.loads((tmp_path / "args.json").read_text(encoding="utf-8"))
    assert set(raw) <= {f.name for f in dataclasses.fields(TrainingArguments)}


def test_max_grad_norm_follows_ds_gradient_clipping() -> None:
    plan = make_plan(engine="deepspeed", zero=2, dp=8)
    text = render_hf_training_args(plan, max_grad_norm=0.5)
    validate_hf_training_args(text, plan, ds_config=ds_config_for(plan, gradient_clipping=0.5))
    with pytest.raises(ExportValidationError, match="gradient_clipping=1.0 vs hf max_grad_norm=0.5"):
        validate_hf_training_args(text, plan, ds_config=ds_config_for(plan))


def test_inline_deepspeed_dict_is_checked() -> None:
    plan = make_plan(engine="deepspeed", zero=2, dp=8)
    args = args_of(plan)
    args["deepspeed"] = ds_config_for(plan)
    validate_hf_training_args(text_of(args), plan)
    args["deepspeed"]["train_batch_size"] = 1
    with pytest.raises(ExportValidationError, match="train_batch_size"):
        validate_hf_training_args(text_of(args), plan)


def test_validation_leaves_no_global_state() -> None:
    import torch
    import transformers.integrations.deepspeed as hf_ds
    from accelerate.state import AcceleratorState, PartialState

    env = dict(os.environ)
    partial, accel = dict(PartialState._shared_state), dict(AcceleratorState._shared_state)
    ref = hf_ds._hf_deepspeed_config_weak_ref
    precision = getattr(torch.backends, "fp32_precision", None)
    for plan in (make_plan(engine="torch", fsdp="full", dp=8), make_plan(engine="deepspeed", zero=3, dp=8)):
        check(plan)
    assert dict(os.environ) == env
    assert dict(PartialState._shared_state) == partial and dict(AcceleratorState._shared_state) == accel
    assert hf_ds._hf_deepspeed_config_weak_ref is ref
    assert getattr(torch.backends, "fp32_precision", None) == precision


def test_renderer_imports_neither_transformers_nor_lightning() -> None:
    code = (
        "import sys\n"
        "from optplan.estimators.buckets import DeepSpeedBuckets\n"
        "from optplan.estimators.strategy import Strategy\n"
        "from optplan.planner.export.context import ExportPlan\n"
        "from optplan.planner.export.hf import render_hf_training_args, hf_notes\n"
        "b = DeepSpeedBuckets(reduce_bucket_size=10**6, allgather_bucket_size=10**6,"
        " stage3_prefetch_bucket_size=9*10**5, stage3_param_persistence_threshold=10**4,"
        " stage3_max_live_parameters=10**9)\n"
        "for s in (Strategy(engine='torch', fsdp='full', dp=8), Strategy(zero=3, dp=8)):\n"
        "    p = ExportPlan(strategy=s, model='m', model_path='', block_class='Block', params=10, buckets=b,"
        " gpu='H100-SXM', gpus_per_node=8)\n"
        "    render_hf_training_args(p); hf_notes(p)\n"
        "bad = [m for m in ('transformers', 'lightning', 'accelerate', 'deepspeed') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------------------------------
# Notes
# --------------------------------------------------------------------------------------------------


def test_notes() -> None:
    assert any("CUDA_VISIBLE_DEVICES" in n for n in hf_notes(make_plan(engine="torch", dp=1)))
    assert any("2 node(s) x 8" in n for n in hf_notes(make_plan(engine="torch", dp=16)))
    amp = hf_notes(make_plan(engine="deepspeed", zero=2, dp=8, precision="amp-bf16", optimizer="adafactor"))
    assert any("torch_autocast" in n for n in amp) and any("optim=adafactor" in n for n in amp)
    assert any("bitsandbytes" in n for n in hf_notes(make_plan(engine="torch", dp=8, optimizer="adamw8bit")))
    assert any("every other matmul" in n for n in hf_notes(make_plan(engine="torch", dp=8, checkpointing="selective")))
    assert any("activation_checkpointing_enable" in n
               for n in hf_notes(make_plan(engine="torch", dp=8, checkpointing="full")))


# --------------------------------------------------------------------------------------------------
# Plans the file cannot express
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, extra, match", [
    ({"engine": "megatron", "tp": 2, "dp": 4}, {}, "Megatron-LM"),
    ({"engine": "deepspeed", "zero": 1, "tp": 2, "dp": 4}, {}, "tp=2"),
    ({"engine": "torch", "fsdp": "full", "cp": 2, "dp": 4}, {}, "cp=2"),
    ({"engine": "torch", "dp": 8, "precision": "fp8"}, {}, "fp8"),
    ({"engine": "torch", "dp": 8, "precision": "bf16-pure"}, {}, "bf16-true"),
    ({"engine": "torch", "fsdp": "hybrid", "dp": 16}, {}, "ParallelismConfig"),
    ({"engine": "torch", "fsdp": "full", "dp": 8}, {"block_class": None}, "repeated block"),
    ({"engine": "deepspeed", "zero": 0, "dp": 8, "precision": "bf16-pure"}, {}, "ZeRO stage 1-3"),
    # NVMe optimizer offload below ZeRO-3 is refused by Strategy itself (tests/estimators/test_memory.py)
    ({"engine": "deepspeed", "zero": 2, "dp": 8, "offload_optimizer": "cpu", "optimizer": "adamw8bit"}, {},
     "offload"),
])
def test_unexportable_plans_are_refused(strategy: dict[str, Any], extra: dict[str, Any], match: str) -> None:
    plan = make_plan(**extra, **strategy)
    with pytest.raises(NotExportable, match=match) as err:
        render_hf_training_args(plan)
    assert "\n" not in str(err.value)
    with pytest.raises(ExportValidationError, match="no TrainingArguments export"):
        validate_hf_training_args(text_of({"output_dir": "out"}), plan)


@pytest.mark.parametrize("kw, match", [
    ({"ds_config_name": ""}, "ds_config name"),
    ({"output_dir": " "}, "output_dir"),
    ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"max_grad_norm": float("nan")}, "max_grad_norm"),
])
def test_bad_render_options(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(OptplanError, match=match):
        hf_training_args(make_plan(engine="torch", dp=8), **kw)


# --------------------------------------------------------------------------------------------------
# Files the validator must reject
# --------------------------------------------------------------------------------------------------

DDP = make_plan(engine="torch", dp=8, mbs=2, grad_accum=4)
FSDP = make_plan(engine="torch", fsdp="full", dp=8, checkpointing="full")
ZERO3 = make_plan(engine="deepspeed", zero=3, dp=8, mbs=2, grad_accum=4)


def edited(plan: ExportPlan, **changes: Any) -> str:
    args = args_of(plan)
    for key, value in changes.items():
        if value is KeyError:
            args.pop(key)
        else:
            args[key] = value
    return text_of(args)


REJECTED: dict[str, tuple[ExportPlan, str, str]] = {
    "not_json": (DDP, "not json", "not JSON"),
    "not_object": (DDP, "[1, 2]", "JSON object"),
    "unknown_key": (DDP, edited(DDP, gradient_accumulation_step=2),
                    "'gradient_accumulation_step' \\(did you mean 'gradient_accumulation_steps'"),
    "int_as_str": (DDP, edited(DDP, per_device_train_batch_size="2"),
                   "per_device_train_batch_size='2' has the wrong type \\(TrainingArguments takes int\\)"),
    "int_as_float": (DDP, edited(DDP, gradient_accumulation_steps=4.0),
                     "gradient_accumulation_steps=4.0 has the wrong type"),
    "bool_as_str": (DDP, edited(DDP, bf16="true"),
                    "bf16='true' has the wrong type \\(TrainingArguments takes bool\\)"),
    "float_as_bool": (DDP, edited(DDP, learning_rate=True), "learning_rate=True"),
    "mbs": (DDP, edited(DDP, per_device_train_batch_size=4), "per_device_train_batch_size=4 but the plan needs 2"),
    "accum_default": (DDP, edited(DDP, gradient_accumulation_steps=KeyError),
                      "gradient_accumulation_steps=1 but the plan needs 4"),
    "precision": (DDP, edited(DDP, bf16=False, fp16=True), "bf16=False but the plan needs True"),
    "optim": (DDP, edited(DDP, optim="adamw_torch"), "optim='adamw_torch' but the plan needs 'adamw_torch_fused'"),
    "checkpointing": (DDP, edited(DDP, activation_checkpointing=True),
                      "activation_checkpointing=True but the plan needs False"),
    "use_cpu": (DDP, edited(DDP, use_cpu=True), "use_cpu=true"),
    "fsdp_on_ddp": (DDP, edited(DDP, fsdp=True), "does not use FSDP"),
    "deepspeed_on_ddp": (DDP, edited(DDP, deepspeed="ds_config.json"), "no deepspeed key"),
    "bad_scheduler": (DDP, edited(DDP, lr_scheduler_type="cosine_typo"), "TrainingArguments rejects .*cosine_typo"),
    "bad_warmup": (DDP, edited(DDP, warmup_steps=-1), "TrainingArguments rejects .*warmup_steps"),
    "zero3_args_for_ddp": (DDP, edited(ZERO3), "no deepspeed key"),
    "no_deepspeed_key": (ZERO3, edited(ZERO3, deepspeed=KeyError), "needs a deepspeed key"),
    "no_fsdp_key": (FSDP, edited(FSDP, fsdp=KeyError), "shards with FSDP"),
    "fsdp_config_list": (FSDP, edited(FSDP, fsdp_config=["full_shard"]),
                         "fsdp_config=\\['full_shard'\\] has the wrong type"),
    "fsdp_config_path": (FSDP, edited(FSDP, fsdp_config="fsdp.json"), "fsdp_config must be an object"),
}


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_rejected_files(name: str) -> None:
    plan, text, match = REJECTED[name]
    with pytest.raises(ExportValidationError, match=match) as err:
        validate_hf_training_args(text, plan)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("key, value, match", [
    ("reshard_after_forward", False, "fsdp_config.reshard_after_forward=False but the plan needs True"),
    ("cpu_offload", True, "fsdp_config.cpu_offload=True"),
    ("transformer_layer_cls_to_wrap", ["GPT2Block"], "transformer_layer_cls_to_wrap=\\['GPT2Block'\\]"),
    ("activation_checkpointing", False, "fsdp_config.activation_checkpointing=False"),
    ("version", 1, "fsdp_config.version=1"),
])
def test_fsdp_config_must_match_the_plan(key: str, value: Any, match: str) -> None:
    args = args_of(FSDP)
    args["fsdp_config"][key] = value
    with pytest.raises(ExportValidationError, match=match):
        validate_hf_training_args(text_of(args), FSDP)


def test_fsdp_config_accepts_prefixed_keys_and_a_bare_class_name() -> None:
    args = args_of(FSDP)
    args["fsdp_config"] = {f"fsdp_{k}" if k != "transformer_layer_cls_to_wrap" else k: v
                           for k, v in args["fsdp_config"].items()}
    args["fsdp_config"]["transformer_layer_cls_to_wrap"] = "Block"
    validate_hf_training_args(text_of(args), FSDP)


def test_fsdp_and_trainer_checkpointing_together_are_rejected() -> None:
    args = args_of(FSDP)
    args["activation_checkpointing"] = True
    with pytest.raises(ExportValidationError, match="activation_checkpointing"):
        validate_hf_training_args(text_of(args), FSDP)


def test_deprecated_alias_is_rejected() -> None:
    plan = make_plan(engine="torch", dp=8, checkpointing="full")
    args = args_of(plan)
    args["gradient_checkpointing"] = args.pop("activation_checkpointing")
    args["gradient_checkpointing_kwargs"] = args.pop("activation_checkpointing_kwargs")
    with pytest.raises(ExportValidationError, match="deprecated"):
        validate_hf_training_args(text_of(args), plan)


def test_legacy_fsdp_string_is_rejected() -> None:
    args = args_of(FSDP)
    args["fsdp"] = "full_shard auto_wrap"
    with pytest.raises(ExportValidationError, match="deprecated"):
        validate_hf_training_args(text_of(args), FSDP)


def test_ds_config_of_another_precision_is_a_hf_mismatch() -> None:
    """The AMP plan's args (bf16 false) against a bf16 plan's ds_config: HF's own mismatch check says so."""
    amp = make_plan(engine="deepspeed", zero=2, dp=8, precision="amp-bf16")
    bf16 = make_plan(engine="deepspeed", zero=2, dp=8, precision="bf16")
    with pytest.raises(ExportValidationError, match="ds bf16.enabled=True vs hf bf16"):
        validate_hf_training_args(render_hf_training_args(amp), amp, ds_config=ds_config_for(bf16))


@pytest.mark.parametrize("edit, match", [
    (lambda ds: ds.update(train_batch_size=ds["train_batch_size"] * 2), "train_batch_size"),
    (lambda ds: ds.update(gradient_accumulation_steps=8, train_batch_size=128), "gradient_accumulation_steps"),
    (lambda ds: ds["optimizer"]["params"].update(lr=1e-3), "optimizer.params.lr"),
    (lambda ds: ds["optimizer"]["params"].update(betas=[0.9, 0.999]), "optimizer.params.betas"),
    (lambda ds: ds["optimizer"]["params"].update(weight_decay=0.0), "optimizer.params.weight_decay"),
    (lambda ds: ds.update(gradient_clipping=0.3), "gradient_clipping"),
    (lambda ds: ds.pop("zero_optimization"), "ZeRO optimization config"),
    (lambda ds: ds.update(train_micro_batch_size_per_gpu="auto"), "\"auto\" at train_micro_batch_size_per_gpu"),
])
def test_ds_config_mismatches(edit: Any, match: str) -> None:
    ds = copy.deepcopy(ds_config_for(ZERO3))
    edit(ds)
    with pytest.raises(ExportValidationError, match=match) as err:
        validate_hf_training_args(render_hf_training_args(ZERO3), ZERO3, ds_config=ds)
    assert "\n" not in str(err.value)


def test_ds_config_for_a_plan_at_another_world_size() -> None:
    """ds_config.json rendered for 16 GPUs with args for the same batch split on 8: HF's batch check fails."""
    other = make_plan(engine="deepspeed", zero=3, dp=16, mbs=2, grad_accum=4)
    with pytest.raises(ExportValidationError, match="world size 8.*train_batch_size"):
        validate_hf_training_args(render_hf_training_args(ZERO3), ZERO3, ds_config=ds_config_for(other))


def test_ds_config_for_a_torch_plan_is_rejected() -> None:
    with pytest.raises(ExportValidationError, match="torch engine"):
        validate_hf_training_args(render_hf_training_args(DDP), DDP, ds_config=ds_config_for(ZERO3))


def test_json_value_fits() -> None:
    from typing import Literal, Optional, Union

    assert json_value_fits(1, float) and not json_value_fits(True, float) and not json_value_fits(1.0, int)
    assert json_value_fits(None, Optional[int]) and json_value_fits("x", Union[int, str])  # noqa: UP007, UP045
    assert json_value_fits([1, 2], list[int]) and not json_value_fits([1, "a"], list[int])
    assert json_value_fits({"a": True}, dict[str, bool]) and not json_value_fits({"a": 1}, dict[str, bool])
    assert json_value_fits("bf16-mixed", Literal["bf16-mixed", "32-true"])
    assert not json_value_fits("bf16", Literal["x"])
    assert json_value_fits([2, 8], tuple[int, int]) and not json_value_fits([2], tuple[int, int])
    assert json_value_fits("anything", "ForwardRef") and not json_value_fits("x", type[int])


def test_fsdp_accumulation_keeps_gradients_sharded() -> None:
    """transformers' Trainer runs FSDP micro-batches under no_sync unless sync_each_batch: unsharded gradients."""
    from optplan.planner.validate import ExportValidationError

    plan = make_plan(engine="torch", fsdp="full", dp=8, mbs=2, grad_accum=4)
    args = check(plan)
    assert args["accelerator_config"] == {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    del args["accelerator_config"]
    with pytest.raises(ExportValidationError, match="sync_each_batch"):
        validate_hf_training_args(text_of(args), plan)
    # no accumulation, or DDP (whose gradients are whole anyway): nothing to add
    assert "accelerator_config" not in check(make_plan(engine="torch", fsdp="full", dp=8, mbs=2, grad_accum=1))
    assert "accelerator_config" not in check(make_plan(engine="torch", dp=8, mbs=2, grad_accum=4))


def test_a_plan_that_syncs_fsdp_gradients_once_per_step_exports_the_trainers_default() -> None:
    """fsdp_grad_sync step is what the Trainer does without sync_each_batch (estimators/fsdp_grad_sync.py): the
    export says so explicitly, and a hand edit back to per-micro-batch sync is refused in one line."""
    from optplan.planner.validate import ExportValidationError

    plan = make_plan(engine="torch", fsdp="full", dp=8, mbs=2, grad_accum=4, fsdp_grad_sync="step")
    args = check(plan)
    assert args["accelerator_config"] == {"gradient_accumulation_kwargs": {"sync_each_batch": False}}
    args["accelerator_config"]["gradient_accumulation_kwargs"]["sync_each_batch"] = True
    with pytest.raises(ExportValidationError, match="once per step"):
        validate_hf_training_args(text_of(args), plan)


@pytest.mark.parametrize("optimizer,name", [("paged_adamw", "paged_adamw_32bit"), ("paged_adamw8bit", "paged_adamw_8bit")])
def test_paged_optimizers_export_as_transformers_names(optimizer: str, name: str) -> None:
    plan = make_plan(engine="torch", dp=1, mbs=2, optimizer=optimizer)
    args = check(plan)  # TrainingArguments built for real
    assert args["optim"] == name and args["adam_beta2"] == 0.95
    assert any("needs bitsandbytes" in note for note in hf_notes(plan))


def test_checkpointing_field_follows_the_installed_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.17 (the GPU machine's, benchmarks/results/2026-11-26-H200) has only the old
    ``gradient_checkpointing`` names; the export must write what the installed release takes, and the plan
    check must read either name."""
    from transformers import TrainingArguments

    from optplan.planner.export import hf, hf_check

    assert hf.checkpointing_field((5, 17)) == hf.checkpointing_field((5, 22)) == "gradient_checkpointing"
    assert hf.checkpointing_field((5, 23)) == hf.checkpointing_field((6, 0)) == "activation_checkpointing"
    new = {"activation_checkpointing", "activation_checkpointing_kwargs"}
    hints = typing.get_type_hints(TrainingArguments)
    old_fields = [(f.name, hints[f.name], f) for f in dataclasses.fields(TrainingArguments)
                  if f.init and f.name not in new]
    assert len(old_fields) > 50
    OldArgs = dataclasses.make_dataclass("OldArgs", old_fields)  # 5.17's field set, as far as the export goes
    monkeypatch.setattr(hf, "installed_transformers_version", lambda: (5, 17))
    plan = make_plan(engine="torch", precision="amp-bf16", checkpointing="full")
    args = args_of(plan)
    assert args["gradient_checkpointing"] is True
    assert args["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert not new & set(args)
    hf_check._check_fields(args, OldArgs)
    hf_check._check_plan(args, plan, OldArgs)
    with pytest.raises(ExportValidationError, match="gradient_checkpointing|activation_checkpointing"):
        hf_check._check_plan({**args, "gradient_checkpointing": False}, plan, OldArgs)
    # the same plan under the installed release: the new names, and the old file is still read as planned
    monkeypatch.undo()
    assert "activation_checkpointing" in args_of(plan)
    hf_check._check_plan(args, plan, TrainingArguments)


def test_compile_plans_set_torch_compile() -> None:
    compiled = check(make_plan(engine="torch", fsdp="full", dp=8, mbs=2, compile=True))
    assert compiled["torch_compile"] is True  # TrainingArguments (validated above) takes it as it is
    assert "torch_compile" not in check(make_plan(engine="torch", fsdp="full", dp=8, mbs=2))
    assert any("torch_compile" in n for n in hf_notes(make_plan(engine="torch", dp=8, compile=True)))
    ds = check(make_plan(engine="deepspeed", zero=2, dp=8, mbs=2, compile=True))
    assert ds["torch_compile"] is True


def test_the_trainers_bf16_reduction_is_named_when_the_plan_reduces_in_fp32() -> None:
    # accelerate's FSDP plugin (the Trainer's) reduces in bf16 under bf16: a plan priced at fp32 says so
    fp32 = hf_notes(make_plan(engine="torch", fsdp="full", dp=8))
    assert any("reduces gradients in bf16" in n and "--fsdp-reduce-dtype bf16" in n for n in fp32)
    low = hf_notes(make_plan(engine="torch", fsdp="full", dp=8, fsdp_reduce_dtype="bf16"))
    assert not any("reduces gradients in" in n for n in low)
    # under amp-bf16 the plugin gathers bf16 weights as well: the run is the bf16 recipe, and the note says so
    amp = hf_notes(make_plan(engine="torch", fsdp="full", dp=8, precision="amp-bf16"))
    assert any("reduces gradients in bf16" in n and "--precision bf16 --fsdp-reduce-dtype bf16" in n for n in amp)
