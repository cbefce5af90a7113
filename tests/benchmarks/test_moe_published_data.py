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


def test_expert_tensor_parallelism_is_planned_as_run() -> None:
    """Rows with expert-tp 1 beside tp > 1 (MoE parallel folding) keep their EP and ETP (Strategy.etp)."""
    rows = [r for r in ROWS if r["tp"] > 1 and r["etp"] == 1 and r["ep"] > 1]
    assert len(rows) >= 5
    for row in rows:
        p = bench.plan(row)
        assert (p.strategy.ep, p.strategy.expert_tp, p.strategy.tp) == (row["ep"], 1, row["tp"]), row["id"]
        assert "fold" not in p.flags
        assert p.strategy.expert_dp * p.strategy.ep * p.strategy.expert_tp == p.strategy.world_size // p.strategy.pp


def test_sources_interleaving_and_overlap_are_planned_as_run() -> None:
    """Uneven interleaved layouts (94 or 61 layers on pp 8 x vpp 4), Megatron's all-to-all overlap and DualPipe are
    priced as the sources ran them, not dropped (estimators/pipeline_layout.py, estimators/ep_overlap.py,
    estimators/pipeline.py)."""
    qwen = next(r for r in ROWS if r["id"] == "zoo-qwen3-235b-deepep-ep32-pp8-a2a-overlap")
    p = bench.plan(qwen)
    assert (p.strategy.pp, p.strategy.vpp) == (8, 4) and p.strategy.ep_overlap
    assert "vpp" not in p.flags and "ov" not in p.flags
    dualpipe = next(r for r in ROWS if "dualpipe" in r["features"])
    p = bench.plan(dualpipe)  # DualPipe is not Megatron's overlap: optplan's own schedule, its pairs hiding the a2a
    assert p.strategy.pp_schedule == "dualpipe" and not p.strategy.ep_overlap
    assert "ov" not in p.flags and "dual" not in p.flags


def test_the_committed_domain_holds_the_moe_sets_as_the_benchmark_writes_them() -> None:
    """estimators/data/time_domain.yaml's MoE sets (kind moe) are fidelity_published.py --write-domain's, from
    these published runs: the band of every MoE plan rests on them."""
    import sys
    from pathlib import Path

    import pytest
    import yaml

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "benchmarks"))
    import fidelity_published

    rows = bench.domain_rows()
    committed = {s["gpu"]: s for s in yaml.safe_load((root / "estimators" / "data" / "time_domain.yaml")
                                                     .read_text())["sets"] if s.get("kind") == "moe"}
    by_gpu: dict[str, list] = {}
    for r in rows:
        by_gpu.setdefault(r.gpu, []).append(r)
    assert set(by_gpu) == set(committed) and "H100-SXM" in committed
    for gpu, rs in by_gpu.items():
        fresh = fidelity_published._domain_entry("x", rs, rs)
        assert committed[gpu]["runs"] == fresh["runs"] == len(rs)
        assert committed[gpu]["ratio_low"] == pytest.approx(fresh["ratio_low"], abs=2e-3), gpu
        assert committed[gpu]["ratio_high"] == pytest.approx(fresh["ratio_high"], abs=2e-3), gpu
