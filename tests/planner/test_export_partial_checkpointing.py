"""Partial checkpointing (``checkpoint_layers``) in every export: Megatron's block method (test_export_megatron.py),
and, where a trainer's own switch covers every block or none, that switch off and the first N blocks named for the
script (train.py checkpoints them itself) or, for TrainingArguments, a refusal naming the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from optplan.estimators.buckets import DeepSpeedBuckets
from optplan.estimators.strategy import Strategy
from optplan.planner.export.accelerate import render_accelerate_yaml
from optplan.planner.export.accelerate_check import validate_accelerate_yaml
from optplan.planner.export.context import ExportPlan, NotExportable
from optplan.planner.export.deepspeed import deepspeed_notes
from optplan.planner.export.hf import hf_training_args
from optplan.planner.export.lightning import lightning_notes, lightning_spec
from optplan.planner.validate import ExportValidationError

BUCKETS = DeepSpeedBuckets(
    reduce_bucket_size=589_824, allgather_bucket_size=589_824, stage3_prefetch_bucket_size=530_841,
    stage3_param_persistence_threshold=7_680, stage3_max_live_parameters=1_000_000_000,
)


def make_plan(**strategy: Any) -> ExportPlan:
    fields: dict[str, Any] = dict(engine="torch", fsdp="full", dp=8, mbs=2, checkpointing="full", checkpoint_layers=6)
    fields.update(strategy)
    return ExportPlan(strategy=Strategy(**fields), model="gpt2", model_path="examples/gpt2.py", block_class="Block",
                      params=124_439_808, transformer=None, seq_len=1024, buckets=BUCKETS, gpu="H100-SXM",
                      gpus_per_node=8)


def test_accelerate_fsdp_leaves_checkpointing_to_the_script(tmp_path: Path) -> None:
    plan = make_plan()
    text = render_accelerate_yaml(plan)
    validate_accelerate_yaml(text, plan)
    doc = yaml.safe_load(text)
    assert doc["fsdp_config"]["fsdp_activation_checkpointing"] is False
    assert "partial checkpointing" in text and "6 repeated blocks in torch.utils.checkpoint" in text
    every = yaml.safe_load(render_accelerate_yaml(make_plan(checkpoint_layers=None)))
    assert every["fsdp_config"]["fsdp_activation_checkpointing"] is True


def test_lightning_fsdp_drops_the_class_policy_and_names_the_blocks() -> None:
    plan = make_plan()
    spec = lightning_spec(plan)
    assert spec["_strategy_kwargs"]["auto_wrap_policy"] == ["Block"]
    assert "activation_checkpointing_policy" not in spec["_strategy_kwargs"]
    assert any("the first 6 blocks" in n for n in lightning_notes(plan))
    every = lightning_spec(make_plan(checkpoint_layers=None))
    assert every["_strategy_kwargs"]["activation_checkpointing_policy"] == ["Block"]


def test_deepspeed_note_names_the_first_blocks() -> None:
    notes = deepspeed_notes(make_plan(engine="deepspeed", fsdp="none", zero=2).strategy)
    assert any("the first 6 repeated blocks" in n for n in notes)


@pytest.mark.parametrize("extra", [{}, {"engine": "deepspeed", "fsdp": "none", "zero": 2},
                                   {"fsdp": "none", "precision": "amp-bf16"}])
def test_training_arguments_refuse_partial_checkpointing(extra: dict[str, Any]) -> None:
    with pytest.raises(NotExportable, match="checkpoint every layer or none.*first 6 blocks"):
        hf_training_args(make_plan(**extra))
    hf_training_args(make_plan(checkpoint_layers=None, **extra))  # every block: exportable


def test_accelerate_megatron_recomputes_the_first_blocks_by_megatrons_block_method() -> None:
    """Megatron through accelerate: uniform groups of one layer recompute every block, so a partial plan writes
    --recompute-method block with its N (what launch.sh passes); the validator catches the uniform default."""
    megatron = dict(engine="megatron", fsdp="none", zero=1, dp=2, tp=2, pp=2, sp=True, precision="bf16")
    plan = make_plan(**megatron, checkpoint_layers=3)
    text = render_accelerate_yaml(plan)
    validate_accelerate_yaml(text, plan)
    section = yaml.safe_load(text)["megatron_lm_config"]
    assert section["megatron_lm_recompute_method"] == "block" and section["megatron_lm_recompute_num_layers"] == 3
    every = yaml.safe_load(render_accelerate_yaml(make_plan(**megatron, checkpoint_layers=None)))["megatron_lm_config"]
    assert every["megatron_lm_recompute_method"] == "uniform" and every["megatron_lm_recompute_num_layers"] == 1
    wrong = text.replace("megatron_lm_recompute_method: block", "megatron_lm_recompute_method: uniform")
    with pytest.raises(ExportValidationError, match="recompute_method=uniform, but the plan recomputes the first 3 blocks"):
        validate_accelerate_yaml(wrong, plan)
    with pytest.raises(NotExportable, match="no keys for Megatron's tensor/data-parallel communication overlap"):
        render_accelerate_yaml(make_plan(**megatron, checkpoint_layers=None, comm_overlap=True))
