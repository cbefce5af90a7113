"""The CLI's recommend and estimate tables show each step time's band and the pick's out-of-domain note."""

from __future__ import annotations

import pytest
from factories import make_gpu, make_profile
from rich.console import Console

from optplan.estimators.estimate import Estimate, estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from optplan.planner.recommend import Recommendation, recommend
from optplan.tui.render import estimate_table, plans_table, print_recommendation


def _text(renderable: object, width: int = 80) -> str:
    console = Console(width=width, record=True, highlight=False, color_system=None)
    console.print(renderable)
    return console.export_text()


@pytest.fixture(scope="module")
def rec() -> Recommendation:
    return recommend(make_profile(), Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8), global_batch=256)


def _rows(rec: Recommendation) -> list[Estimate]:
    rows = [rec.estimate, *(a.estimate for a in rec.alternatives)]
    assert all(isinstance(e, Estimate) for e in rows)
    return rows  # type: ignore[return-value]


def test_plans_table_shows_every_step_band_and_fits_80_columns(rec: Recommendation) -> None:
    out = _text(plans_table(rec))
    assert max(len(line) for line in out.splitlines()) <= 80
    for e in _rows(rec):
        t = e.time
        assert t.step_s_low < t.step_s < t.step_s_high
        assert t.step_s < 1  # the cells are in ms here
        assert f"{t.step_s * 1e3:.0f} ms" in out
        assert f"[{t.step_s_low * 1e3:.0f}-{t.step_s_high * 1e3:.0f}]" in out
    assert "[band]" in out and "slow end" in out


def test_a_params_only_table_has_no_band_legend() -> None:
    """--params plans price memory only (no step time in any row): the band's legend and its "ranked by the band's
    slow end" would describe nothing shown."""
    from optplan.estimators.params_only import profile_from_params

    params_rec = recommend(profile_from_params(7e9), Cluster(gpu=find_gpu("H100-SXM"), gpus=16, gpus_per_node=8))
    out = _text(plans_table(params_rec))
    assert "bf16" in out and " - " in out  # rows, without step times
    assert "[band]" not in out and "slow end" not in out
    assert "without an [engine] tag runs on deepspeed" in " ".join(out.split())  # the tag's legend stays
    torch_lines = [line for line in params_rec.rationale if "[torch]" in line]
    assert torch_lines and not any("(torch)" in line for line in torch_lines)  # the engine said once


def test_the_legend_says_how_rows_are_ordered_and_what_an_untagged_label_runs_on(rec: Recommendation) -> None:
    """The rows are ranked by the band's slow end with the simplest tied plan first, so the first row's slow end
    need not be the smallest: the legend says so, and that a label without an engine tag is a DeepSpeed plan."""
    from optplan.planner.goal import TIE_TOLERANCE

    out = " ".join(_text(plans_table(rec), width=200).split())
    assert f"the simplest of the plans within {TIE_TOLERANCE:.0%} of the best first" in out
    assert "a plan without an [engine] tag runs on deepspeed" in out
    assert all(e.strategy.label().endswith(f"[{e.strategy.engine}]") == (e.strategy.engine != "deepspeed")
               for e in _rows(rec))


def test_plan_labels_keep_their_engine_tag(rec: Recommendation) -> None:
    torch_rows = [e for e in _rows(rec) if e.strategy.engine == "torch"]
    assert torch_rows, "expected a torch plan among the best on H100 (DDP/FSDP)"
    assert "[torch]" in _text(plans_table(rec), width=200)  # not swallowed as console markup


def test_recommend_report_prints_the_picks_out_of_domain_note_and_the_tie(rec: Recommendation) -> None:
    console = Console(width=100, record=True, highlight=False, color_system=None)
    print_recommendation(console, rec, make_profile())
    out = " ".join(console.export_text().replace("│", " ").split())  # the panel's borders out
    assert rec.estimate is not None and rec.estimate.time.outside_measured  # 124M parameters: out of domain
    assert "note (#1): time: outside the measured domain" in out
    assert rec.estimate.time.outside_measured[0] in out
    assert any(line.startswith("ties: ") for line in rec.rationale)
    for line in rec.rationale:
        assert " ".join(line.split()) in out


def test_estimate_table_shows_the_band_its_basis_and_the_rate_range() -> None:
    e = estimate(make_profile(), Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8),
                 Strategy(dp=8, mbs=8, engine="torch"))
    out = " ".join(_text(estimate_table(e), width=120).split())
    t = e.time
    assert f"│ band │ {t.step_s_low * 1e3:.1f}-{t.step_s_high * 1e3:.1f} │" in out
    assert f"time band: {' '.join(t.band_basis.split())}" in out
    slow, fast = e.tokens_per_s * t.step_s / t.step_s_high, e.tokens_per_s * t.step_s / t.step_s_low
    assert f"{e.tokens_per_s:,.0f} tokens/s [{slow:,.0f}-{fast:,.0f}]" in out


def test_a_step_over_a_second_shows_its_band_in_seconds() -> None:
    prof = make_profile(params=1_000_000_000, hidden=2048, layers=24)
    c = Cluster(gpu=make_gpu(80), gpus=8, gpus_per_node=8)
    rec = recommend(prof, c, global_batch=1024, engines=["deepspeed"])
    out = _text(plans_table(rec))
    for e in _rows(rec):
        t = e.time
        assert t.step_s >= 1
        digits = 1 if t.step_s_high < 10 else 0
        assert f"[{t.step_s_low:.{digits}f}-{t.step_s_high:.{digits}f}]" in out


def test_a_gpus_range_table_names_each_rows_gpu_count(rec: Recommendation) -> None:
    """Rows of a --gpus-range search are on several GPU counts: each plan says on how many (two rows read the same
    label with different memory and throughput before); one count says nothing extra."""
    from optplan.planner.goal import Goal
    from optplan.planner.space import parse_gpus_range

    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=32, gpus_per_node=8)
    prof = make_profile(params=1_000_000_000, hidden=2048, layers=24)
    counts = parse_gpus_range("8:32", 8)
    cheap = recommend(prof, cluster, global_batch=256, gpu_counts=counts,
                      goal=Goal(objective="cost", tokens=1e10, price_per_gpu_hour=2.0))  # fewest GPUs
    fast = recommend(prof, cluster, global_batch=256, gpu_counts=counts,
                     goal=Goal(objective="time", tokens=1e10))  # most GPUs
    # a table whose rows are on several GPU counts (which rows a search ranks first depends on the time model)
    ranged = cheap.model_copy(update={"alternatives": (*cheap.alternatives[:2], *fast.alternatives[:2])})
    rows = [ranged.estimate, *(a.estimate for a in ranged.alternatives)]
    assert len({e.gpus for e in rows}) > 1
    out = _text(plans_table(ranged), width=160)
    for e in rows:
        assert f"{e.gpus} GPUs: {e.strategy.label()}" in out
    assert "GPUs:" not in _text(plans_table(rec), width=160)


def test_the_cost_band_names_each_unit_once_and_prices_every_figure() -> None:
    """The band's ends of the time to train, GPU-hours, price and energy; a unit shared by both ends is named once,
    ends in different units keep theirs; no band (or one of no width) prints nothing."""
    from optplan.estimators.cost import training_cost
    from optplan.tui.fmt import cost_band_text, span

    assert span("101 days", "187 days") == "101-187 days"
    assert span("14 h", "2.1 days") == "14 h-2.1 days"
    assert span("$16", "$46") == "$16-$46"
    c = training_cost(tokens=2e9, tokens_per_s=2e5, gpus=8, gpu_power_w=700, price_per_gpu_hour=2.0,
                      step_band=(0.8, 1.4))
    assert cost_band_text(c) == " (over the step's band: 2.2-3.9 h, 18-31 GPU-hours, $36-$62, 12-22 kWh)"
    unpriced = training_cost(tokens=2e9, tokens_per_s=2e5, gpus=8, gpu_power_w=700, step_band=(0.8, 1.4))
    assert cost_band_text(unpriced) == " (over the step's band: 2.2-3.9 h, 18-31 GPU-hours, 12-22 kWh)"
    assert cost_band_text(training_cost(tokens=2e9, tokens_per_s=2e5, gpus=8, gpu_power_w=700)) == ""
    assert cost_band_text(training_cost(tokens=2e9, tokens_per_s=2e5, gpus=8, gpu_power_w=700,
                                        step_band=(1.0, 1.0))) == ""
