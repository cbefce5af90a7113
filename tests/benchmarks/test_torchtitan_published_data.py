"""benchmarks/data/torchtitan_published.json: every row is complete and cited, the closest plan keeps the run's
layout and flags what optplan does not model, and the benchmark prints its figures."""

from __future__ import annotations

import io

from benchmarks import fidelity_torchtitan as bench
from tests.published_data import citation_problems

SOURCES, ROWS = bench.load()


def _row(row_id: str) -> dict:
    return next(r for r in ROWS if r["id"] == row_id)


def test_every_row_is_complete_and_cited() -> None:
    assert citation_problems(ROWS, SOURCES, bench.check_row, ("title", "url", "hardware", "software")) == []
    assert len(ROWS) >= 30 and len(SOURCES) == 3
    assert {r["gpu"] for r in ROWS} == {"H100-96GB-500W", "H200"}


def test_check_row_names_what_is_wrong() -> None:
    bad = dict(_row("t1-8b-fsdp8"), fsdp=4)
    assert bench.check_row(bad, SOURCES) == ["fsdp·tp·pp·cp must equal the GPUs"]
    assert bench.check_row({"id": "x"}, SOURCES)[0] == "missing source"


def test_closest_plan_keeps_the_layout_and_flags_the_rest() -> None:
    row = _row("t5-405b-3d-interleaved")
    strategy, flags = bench.plan(row)
    assert strategy.world_size == row["gpus"] and strategy.engine == "torch" and strategy.fsdp == "full"
    assert (strategy.tp, strategy.pp, strategy.vpp, strategy.dp) == (8, 8, 2, 8)
    assert strategy.mbs * strategy.grad_accum == row["local_batch"] and strategy.sp
    assert {"gpu", "fp8", "f8ag"} <= set(flags) and "compile" not in flags
    assert strategy.async_tp == row["async_tp"] and bench.plan(_row("atp-70b-bf16-async"))[0].async_tp  # priced
    assert strategy.compile and row["compile"]  # torch.compile is a plan choice now, priced as fused kernels
    assert not bench.plan(_row("t1-8b-fsdp8"))[0].compile  # the eager run stays eager
    eager = bench.plan(_row("t1-8b-fsdp8"))
    assert eager[1] == ("gpu",) and eager[0].checkpointing == "selective"  # per-op SAC is optplan's selective
    assert bench.plan(_row("h200-8b-32"))[1][0] == "f8sac"  # an H200 is in the catalogue: no gpu flag


def test_prediction_prices_the_pipelined_stage_once_per_step() -> None:
    result = bench.predict(_row("t5-405b-3d-1f1b"))
    detail = result.est.memory.detail_bytes
    assert detail["fsdp_pipeline_unsharded_params"] > 0 and detail["fsdp_pipeline_accumulated_grads"] > 0
    assert 0.5 < result.ratio < 2 and result.predicted_reserved_gib > 0
    assert result.memory_error is not None


def test_report_ends_with_its_figures() -> None:
    results = [bench.predict(r) for r in ROWS[:4]]
    out = io.StringIO()
    err, mem_median, mem_max, mem_n = bench.report(results, out)
    assert err == bench.mape([r.ratio for r in results])
    # every row that published its memory is scored, per-op selective AC included
    assert mem_n == sum(r.memory_error is not None for r in results) == 4 and mem_median <= mem_max
    assert "flags:" in out.getvalue() and "t1-8b-fsdp8" in out.getvalue()


def test_per_op_selective_ac_is_priced_as_run() -> None:
    """torchtitan's per-op selective AC is optplan's torch-engine selective policy (estimators/selective.py): the
    bf16 8B FSDP runs' peak memory is priced from what it keeps, not from Korthikanti's selective recomputation
    (which over-predicted them by 62-96 %)."""
    for run in ("t1-8b-fsdp8", "t3-8b-fsdp128"):
        result = bench.predict(_row(run))
        assert result.strategy.checkpointing == "selective"
        assert abs(result.memory_error) < 0.10, (run, result.memory_error)


def test_the_grand_teton_h100_is_priced_as_its_source_describes_it() -> None:
    gt = bench.grand_teton_h100()
    sxm = bench.find_gpu("H100-SXM")
    assert gt.name == "H100-SXM"  # the same die: the H100's fitted fractions and kernels apply
    assert gt.memory_bandwidth_bytes_per_s == 2.4e12 and gt.tdp_watts == 500
    # "between SXM and NVL": the midpoint of 989.5 and 835.5 dense BF16 TFLOP/s, every dtype scaled alike
    assert gt.peak_flops_for("bf16") == 912.5e12
    assert gt.peak_flops_for("fp8") / sxm.peak_flops_for("fp8") == gt.peak_flops_for("bf16") / sxm.peak_flops_for("bf16")
    result = bench.predict(_row("t1-8b-fsdp8"))
    assert result.est.memory.capacity_bytes < 96 * 2**30 and result.est.memory.capacity_bytes > 80 * 2**30
    cp_flags = bench.plan(_row("t2-8b-cp2-64k"))[1]
    assert "cp" in cp_flags and "cp" not in bench.plan(_row("t2-8b-cp1-32k"))[1]


def test_each_source_compiles_its_loss_as_its_torchtitan_commit_did() -> None:
    # 2024-12: train.py left torch.compile(loss_fn) commented out; 2025-06: components/loss.py compiles it
    assert {k: bench.source_compiles_loss({"source": k}) for k in SOURCES} == {
        "torchtitan-h100-2024-12": False, "torchtitan-asynctp-h100-2025-06": True, "trainy-h200-2025-06": True}
    assert all("compiles_loss_source" in s for s in SOURCES.values())
    blocks_only = bench.plan(_row("t1-8b-fsdp8-compile"))[0]
    assert blocks_only.compile and not blocks_only.loss_compiled
    both = bench.plan(_row("h200-8b-32"))[0]
    assert both.compile and both.loss_compiled
    # the compiled loss holds 8 bytes less per logit (2 x 8,192 tokens x 128,256): 15.7 GiB of the H200 run's peak
    eager = bench.estimate(bench.profile_for(_row("h200-8b-32")), bench.cluster_for(_row("h200-8b-32")),
                           both.model_copy(update={"compile_loss": False}))
    held = eager.memory.activations_bytes - bench.predict(_row("h200-8b-32")).est.memory.activations_bytes
    assert held == 8 * 2 * 8192 * 128256
