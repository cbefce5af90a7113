"""benchmarks/data/moe_published.json (issue 19): every row is complete and cited, its measured figure converts to
tokens/s per GPU by the source's own definition, and the benchmark's prediction path (--arch profile -> closest
Megatron plan -> estimate) runs on a row."""

from __future__ import annotations

import math

from benchmarks import fidelity_moe as bench
from tests.published_data import citation_problems

SOURCES, ROWS, EXCLUDED = bench.load()


def test_every_row_is_complete_and_cited() -> None:
    assert citation_problems(ROWS, SOURCES, bench.check_row, ("title", "url", "licence", "quantity", "unit", "detail")) == []
    for row in ROWS:
        assert row["source"]["where"] and row["notes"]
        assert row["shape"]["shape_source"].startswith("https://")


def test_rows_come_from_independent_sources_and_exclusions_are_explained() -> None:
    assert len(ROWS) >= 15
    assert len({row["set"] for row in ROWS}) >= 4
    assert {row["model"] for row in ROWS} >= {"Mixtral-8x7B", "DeepSeek-V3", "Qwen3-235B-A22B"}
    assert all(ex["what"] and ex["reason"] for ex in EXCLUDED)


def test_measured_figures_convert_like_for_like() -> None:
    step = {"measured": {"metric": "step_s", "value": 2.0}, "global_batch": 8, "seq": 1000, "gpus": 4}
    assert bench.measured_tokens_per_s_per_gpu(step) == 1000.0
    hours = {"measured": {"metric": "gpu_hours_per_trillion_tokens", "value": 180000.0}, "seq": 4096, "gpus": 2048}
    assert math.isclose(bench.measured_tokens_per_s_per_gpu(hours), 1e12 / (180000 * 3600))
    mixtral = next(r for r in ROWS if r["model"] == "Mixtral-8x7B")
    # Megatron's 2024 count is the PaLM convention optplan's profile uses: per token they agree on Mixtral's shape
    assert math.isclose(bench.megatron_2024_flops_per_token(mixtral["shape"], 4096),
                        bench.exact_flops_per_token(mixtral["shape"], 4096), rel_tol=0.01)


def test_prediction_runs_on_one_row() -> None:
    row = next(r for r in ROWS if r["id"] == "mcore-readme-mixtral-8x7b-v0.8")
    result = bench.predict(row)
    strategy = result.plan.strategy
    assert strategy.world_size == row["gpus"]
    assert strategy.engine == "megatron" and strategy.ep == row["ep"]
    assert strategy.global_batch == row["global_batch"]
    assert result.predicted_tps > 0 and 0.2 < result.ratio < 5
    assert result.est.time.ep_comm_s > 0


def test_closest_plan_keeps_expert_sharding() -> None:
    row = next(r for r in ROWS if r["tp"] > 1 and r["etp"] == 1 and r["ep"] > 1)
    strategy = bench.plan(row).strategy
    assert strategy.ep * strategy.tp == row["ep"] * row["etp"]
    assert (strategy.dp * strategy.cp) % strategy.ep == 0
