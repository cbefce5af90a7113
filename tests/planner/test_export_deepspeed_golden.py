"""Golden ds_config.json files for representative plans (regenerate with OPTPLAN_UPDATE_GOLDEN=1, then review)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from optplan.estimators.buckets import DeepSpeedBuckets
from optplan.estimators.strategy import Strategy
from optplan.planner.export.context import ExportPlan
from optplan.planner.export.registry import render_targets

GOLDEN = Path(__file__).parent / "golden" / "deepspeed"
BUCKETS = DeepSpeedBuckets(reduce_bucket_size=589_824, allgather_bucket_size=589_824,
                           stage3_prefetch_bucket_size=530_841, stage3_param_persistence_threshold=7_680,
                           stage3_max_live_parameters=1_000_000_000)
CASES = {
    "zero0_bf16_1node": Strategy(zero=0, dp=8, mbs=8, grad_accum=2),
    "zero1_amp_bf16_sgd": Strategy(zero=1, dp=8, mbs=4, grad_accum=1, precision="amp-bf16", optimizer="sgd"),
    "zero2_fp16_ckpt_2nodes": Strategy(zero=2, dp=16, mbs=2, grad_accum=4, precision="fp16", checkpointing="full"),
    "zero3_offload_both_4nodes": Strategy(zero=3, dp=32, mbs=1, grad_accum=8, offload_optimizer="cpu",
                                          offload_params="cpu", checkpointing="full"),
    "zero3_nvme_bf16_pure": Strategy(zero=3, dp=8, mbs=1, grad_accum=1, precision="bf16-pure",
                                     offload_optimizer="nvme"),
    "zero2_adafactor": Strategy(zero=2, dp=8, mbs=4, grad_accum=1, optimizer="adafactor"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_ds_config_matches_golden(name: str) -> None:
    plan = ExportPlan(strategy=CASES[name], model="gpt2", model_path="examples/gpt2.py", block_class="Block",
                      params=124_439_808, buckets=BUCKETS, gpu="H100-SXM", gpus_per_node=8)
    files, _ = render_targets(plan, ["deepspeed"])  # rendered and validated by DeepSpeedConfig
    text = files["ds_config.json"]
    path = GOLDEN / f"{name}.json"
    if os.environ.get("OPTPLAN_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name}: ds_config.json changed; review and regenerate the golden"


def test_no_orphan_goldens() -> None:
    assert {p.stem for p in GOLDEN.glob("*.json")} == set(CASES)
