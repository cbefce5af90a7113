"""benchmarks/data/finetune_memory_published.json (issue 18): every row is complete and cited, and the benchmark's
prediction path (config.json -> generated --hf model file -> LoRA profile -> estimate) runs on a small model."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import fidelity_finetune_published as bench
from tests.published_data import citation_problems

SOURCES, ROWS = bench.load_rows()
ROWS_BY_ID = {row["id"]: row for row in ROWS}


def test_every_row_is_complete_and_cited() -> None:
    assert citation_problems(ROWS, SOURCES, bench.check_row, ("title", "url", "licence", "quantity", "unit")) == []


def test_enough_scored_rows_from_independent_sources() -> None:
    scored = [row for row in ROWS if row["status"] == "scored"]
    assert len(scored) >= 12
    assert len({row["source"] for row in scored}) >= 3
    assert {row["method"] for row in scored} >= {"full", "lora", "qlora"}


def test_rows_build_valid_strategies() -> None:
    for row in ROWS:
        if row["status"] == "scored":
            strategy = bench.strategy_for(row)
            assert strategy.world_size == row["gpus"]
            assert strategy.quant == row["quant"]
            if row["parallelism"].startswith("fsdp"):  # when its framework reduces (estimators/fsdp_grad_sync.py)
                assert strategy.fsdp_grad_sync == row["fsdp_grad_sync"]
    assert bench.check_row({k: v for k, v in ROWS_BY_ID["litgpt-gemma-2b-full-4gpu"].items() if k != "fsdp_grad_sync"},
                           SOURCES) == ["an FSDP row without fsdp_grad_sync (micro_batch or step: when its framework "
                                        "reduces)"]


def test_unit_conversion() -> None:
    row = {"measured_value": 1.5, "measured_unit": "GB"}
    assert bench.measured_bytes(row) == 1.5e9
    assert bench.measured_bytes({**row, "measured_unit": "GiB"}) == 1.5 * 2**30


@pytest.mark.slow
@pytest.mark.full
def test_prediction_path_on_a_small_llama(tmp_path: Path) -> None:
    """A synthetic row (a 4-block Llama with LoRA on q/v) through the benchmark's own profile and estimate."""
    row = {
        "id": "synthetic", "model": "tiny", "architecture": "LlamaForCausalLM", "model_type": "llama", "hidden": 128,
        "intermediate": 344, "layers": 4, "heads": 4, "kv_heads": 2, "vocab": 1024, "tie_word_embeddings": False,
        "extra_config": {"max_position_embeddings": 256}, "method": "qlora", "lora_rank": 4, "lora_alpha": 8,
        "hf_lora_targets": ["q_proj", "v_proj"], "quant": "nf4", "optplan_precision": "bf16-pure",
        "optplan_optimizer": "adamw", "micro_batch": 2, "grad_accum": 1, "seq_len": 64, "checkpointing": False,
        "parallelism": "single", "gpu": "A10G", "gpus": 1, "compare": "allocated", "lora_dropout": 0.05,
        "bnb_version": "0.42.0", "loop_holds_last_loss": True, "checkpoint_reentrant": False,
    }
    profile = bench.profile_row(row, tmp_path / "m")
    assert profile.adapter is not None and profile.adapter.rank == 4
    assert profile.trainable_params == 4 * 4 * (128 + 128) + 4 * 4 * (128 + 64)  # r·(in+out) on q and v, 4 blocks
    predicted, memory = bench.predict(row, profile)
    assert predicted == memory.total_bytes - memory.overhead_bytes > 0
    # bitsandbytes 0.42 under LitGPT's loop: this step's unkept inputs and the last step's (estimators/finetune.py)
    adapter = profile.adapter
    per_token = adapter.quant_input_unkept_elements + adapter.quant_input_elements
    assert memory.detail_bytes["bnb_kept_inputs"] == 2 * per_token * 64 * 2 * 4
    _, current = bench.predict({**row, "bnb_version": "0.43.2"}, profile)
    assert "bnb_kept_inputs" not in current.detail_bytes
    assert bench.compared_bytes(memory, "device") == memory.total_bytes
    assert bench.compared_bytes(memory, "reserved") == memory.total_bytes - memory.detail_bytes["cuda_context"]
    result = bench.Result(row, predicted, 1.1 * predicted, memory)
    assert result.error_pct == pytest.approx(100 * (1 / 1.1 - 1))


def test_bound_rows_are_checked_not_scored() -> None:
    """A ``bound`` row's figure bounds the quantity from above: the report checks predicted <= measured and leaves
    it out of the median and max (the torchtune QLoRA figure holds the model init's cached 9.13 GB)."""
    bound = [row for row in ROWS if row["status"] == "bound"]
    assert [row["id"] for row in bound] == ["torchtune-llama-2-7b-qlora"]
    assert "9.13 GB reserved after model init" in bound[0]["exclude_reason"]
    base = {**ROWS_BY_ID["torchtune-llama-2-7b-lora-qv-r8"]}
    rows = [base, {**base, "id": "b-ok", "status": "bound", "exclude_reason": "init cache"},
            {**base, "id": "b-bad", "status": "bound", "exclude_reason": "init cache"}]
    results = [bench.Result(rows[0], 105, 100.0, None),  # type: ignore[arg-type]
               bench.Result(rows[1], 50, 100.0, None),  # type: ignore[arg-type]
               bench.Result(rows[2], 150, 100.0, None)]  # type: ignore[arg-type]
    lines: list[str] = []
    median, worst = bench.report(results, rows, lines.append)
    assert (median, worst) == pytest.approx((5.0, 5.0))
    assert lines[-1].endswith("over 1 runs")
    assert any(line.startswith("bound (not scored): b-ok") and ": consistent;" in line for line in lines)
    assert any(line.startswith("bound (not scored): b-bad") and "> measured" in line and "INCONSISTENT" in line
               for line in lines)
    assert not any(line.startswith("not scored") and "b-ok" in line for line in lines)
