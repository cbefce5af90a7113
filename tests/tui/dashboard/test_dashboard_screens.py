"""Pilot-driven tests of each dashboard screen on a tiny decoder (profiled by formula: no child process)."""

from __future__ import annotations

from typing import Any

from dashboard_helpers import drive, fake_gpus, make_app, settle, text_of, tiny_args
from textual.widgets import Input, ProgressBar, Select, Static

from optplan.estimators.estimate import Estimate
from optplan.probes.hardware_fake import FakeNvml
from optplan.tui.fmt import band_text
from optplan.tui.screens.help import HelpScreen
from optplan.tui.widgets.gpu_table import GpuTable
from optplan.tui.widgets.key_values import KeyValues
from optplan.tui.widgets.stacked_bar import StackedBar
from optplan.tui.widgets.trials_table import TrialsTable


def test_overview_shows_model_cluster_objective_and_inputs() -> None:
    app = make_app()

    async def script(pilot: Any) -> None:
        screen = pilot.app.screen
        model = text_of(screen.query_one("#model-panel", KeyValues))
        assert "decoder" in model and "FLOPs/token" in model and "repeated block" in model
        assert "activations" in model and "MiB/sample" in model
        cluster = text_of(screen.query_one("#cluster-panel", KeyValues))
        assert "H100-SXM" in cluster and "8 (1 node(s) of 8)" in cluster and "NVLink" in cluster
        objective = text_of(screen.query_one("#objective-panel", KeyValues))
        assert "throughput" in objective and "64" in objective
        assert screen.query_one("#in-gpus", Input).value == "8"
        assert screen.query_one("#in-global-batch", Input).value == "64"
        assert pilot.app.focused is None  # keys switch screens until an input is chosen

    drive(app, script)


def test_overview_replans_with_edited_inputs_and_rejects_bad_ones() -> None:
    app = make_app()

    async def script(pilot: Any) -> None:
        first = pilot.app.result.recommendation
        assert first.cluster.gpus == 8
        screen = pilot.app.screen
        screen.query_one("#in-gpus", Input).value = "4"
        screen.query_one("#in-global-batch", Input).value = "32"
        screen.query_one("#in-objective", Select).value = "throughput"
        await pilot.press("r")
        await settle(pilot)
        rec = pilot.app.result.recommendation
        assert rec.cluster.gpus == 4 and rec.global_batch == 32
        assert pilot.app.prepared.args.gpus == 4
        assert "4 (1 node(s) of 4)" in text_of(screen.query_one("#cluster-panel", KeyValues))
        screen.query_one("#in-global-batch", Input).value = "30"  # not divisible by 4 GPUs
        screen.query_one("#in-objective", Select).value = "time"  # needs --tokens
        await pilot.press("r")
        await settle(pilot)
        error = text_of(screen.query_one("#input-error", Static))
        assert "--objective time needs --tokens" in error
        assert pilot.app.result.recommendation.cluster.gpus == 4  # the last good plan stays

    drive(app, script)


def test_search_fills_the_table_and_ranks_it_when_done() -> None:
    app = make_app()

    async def script(pilot: Any) -> None:
        await pilot.press("2")
        await settle(pilot)
        rec = pilot.app.result.recommendation
        screen = pilot.app.screen
        table = screen.query_one(TrialsTable)
        assert table.row_count == len(pilot.app.trials) == rec.search.evaluated > 100
        first = table.estimate_at(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)
        assert isinstance(first, Estimate) and first.strategy == rec.plan
        assert "★" in str(table.get_row_at(0)[1])
        band = str(table.get_row_at(0)[[h for h, _ in table.columns_shown].index("band %")])
        t = rec.estimate.time  # type: ignore[union-attr]
        assert band == f"{100 * (t.step_s_low / t.step_s - 1):+.0f}/{100 * (t.step_s_high / t.step_s - 1):+.0f}"
        # the column holds the widest band a step can have (fast end > -100 %, slow end up to +999 %): never cut
        column = table.ordered_columns[[h for h, _ in table.columns_shown].index("band %")]
        assert str(column.label) == "band %" and column.width >= len(band_text(1.0, 0.011, 10.99)) == len("-99/+999")
        bar = screen.query_one("#search-progress", ProgressBar)
        assert bar.percentage == 1.0
        best = text_of(screen.query_one("#search-best", Static))
        assert best.startswith("chosen: " + rec.plan.label())
        assert f"({rec.search.evaluated} priced)" in best

    drive(app, script)


def test_plan_shows_the_pick_and_selecting_a_trial_shows_what_if() -> None:
    app = make_app()

    async def script(pilot: Any) -> None:
        rec = pilot.app.result.recommendation
        await pilot.press("3")
        await settle(pilot)
        title = text_of(pilot.app.screen.query_one("#ev-title", Static))
        assert title.strip() == f"chosen plan: {rec.plan.label()}"
        bars = pilot.app.screen.query(StackedBar)
        memory = text_of(bars[0])
        assert "weights" in memory and "optimizer" in memory and "activations" in memory and "usable" in memory
        assert "exposed comm" in text_of(bars[1]) and "bubble" in text_of(bars[1])
        lines = text_of(pilot.app.screen.query_one("#ev-lines", Static))
        assert rec.rationale[0][:40] in lines
        # pick the third-ranked trial on the Search screen
        await pilot.press("2")
        await pilot.pause()
        table = pilot.app.screen.query_one(TrialsTable)
        table.focus()
        await pilot.press("down", "down", "enter")
        await settle(pilot)
        assert pilot.app.current_mode == "plan"
        chosen = pilot.app.selected
        assert chosen is not None and chosen.strategy != rec.plan
        title = text_of(pilot.app.screen.query_one("#ev-title", Static))
        assert title.startswith(f"what if: {chosen.strategy.label()}")
        lines = text_of(pilot.app.screen.query_one("#ev-lines", Static))
        assert "instead of the chosen" in lines and "throughput" in lines
        await pilot.press("c")
        await pilot.pause()
        assert pilot.app.selected is None
        assert text_of(pilot.app.screen.query_one("#ev-title", Static)).startswith("chosen plan:")

    drive(app, script)


def test_plan_says_why_nothing_fits() -> None:
    app = make_app(tiny_args(arch="layers=16,hidden=8192,heads=64,vocab=32000,seq=2048", gpus=1, global_batch=None,
                             offload=False))

    async def script(pilot: Any) -> None:
        assert not pilot.app.result.recommendation.fits
        await pilot.press("3")
        await pilot.pause()
        assert "NO PLAN FITS" in text_of(pilot.app.screen.query_one("#ev-title", Static))
        assert "no searched plan fits" in text_of(pilot.app.screen.query_one("#ev-lines", Static))
        await pilot.press("4")
        await pilot.pause()
        assert "nothing to export" in text_of(pilot.app.screen.query_one("#export-plan", Static))

    drive(app, script)


def test_hardware_shows_the_fake_gpus_live() -> None:
    nvml = fake_gpus()
    app = make_app(nvml=nvml, hardware_interval_s=0.05)

    async def script(pilot: Any) -> None:
        await pilot.press("5")
        await pilot.pause()
        table = pilot.app.screen.query_one(GpuTable)
        assert table.row_count == 2
        row = [str(c) for c in table.get_row_at(0)]
        assert row[1] == "NVIDIA H100 80GB HBM3" and "71 °C" in row[4] and "97%" in row[2] and "612/700 W" in row[5]
        head = text_of(pilot.app.screen.query_one("#hardware-head", Static))
        assert "2 x NVIDIA H100 80GB HBM3 via NVML, driver 550.54.15" in head
        nvml.devices[0].temperature_c = 88
        await pilot.pause(0.2)
        assert "88 °C" in str(table.get_row_at(0)[4])

    drive(app, script)


def test_hardware_empty_state_without_a_gpu() -> None:
    app = make_app(nvml=FakeNvml.library_missing())

    async def script(pilot: Any) -> None:
        await pilot.press("5")
        await pilot.pause()
        screen = pilot.app.screen
        assert not screen.query_one(GpuTable).display
        text = text_of(screen.query_one("#hardware-empty", Static))
        assert "No GPU on this machine" in text and "NVML Shared Library Not Found" in text
        assert "8 x H100-SXM" in text

    drive(app, script)


def test_help_and_quit() -> None:
    app = make_app()

    async def script(pilot: Any) -> None:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(pilot.app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(pilot.app.screen, HelpScreen)
        await pilot.press("q")
        await pilot.pause()

    drive(app, script)
    assert app.return_value is not None and app.return_value.error is None and app.return_value.finished
    assert not [w for w in app.workers if w.is_running]


def test_footer_lists_the_keys() -> None:
    app = make_app()

    async def script(pilot: Any) -> None:
        keys = {key for key, b in pilot.app.active_bindings.items() if b.binding.show}
        assert {"1", "2", "3", "4", "5", "question_mark", "q", "r"} <= keys

    drive(app, script)



def test_every_screen_gives_its_own_body() -> None:
    from optplan.tui.screens.base import DashboardScreen
    from optplan.tui.screens.export import ExportScreen
    from optplan.tui.screens.hardware import HardwareScreen
    from optplan.tui.screens.overview import OverviewScreen
    from optplan.tui.screens.plan import PlanScreen
    from optplan.tui.screens.search import SearchScreen

    for cls in (OverviewScreen, SearchScreen, PlanScreen, ExportScreen, HardwareScreen):
        assert cls.body is not DashboardScreen.body, cls.__name__
        assert cls.MODE, cls.__name__


def test_the_global_batch_input_says_an_empty_one_keeps_the_model_files() -> None:
    """OPTPLAN's global batch holds when the input is empty (the objective panel says so): the input's placeholder
    says it too, not 'free'."""
    from dashboard_helpers import TINY_ARCH

    from optplan.estimators.arch import parse_arch, profile_from_arch

    profile = profile_from_arch(parse_arch(TINY_ARCH))
    profile = profile.model_copy(update={"defaults": profile.defaults.model_copy(update={"global_batch": 32})})
    app = make_app(tiny_args(global_batch=None), profile=profile)

    async def script(pilot: Any) -> None:
        await settle(pilot)
        box = pilot.app.screen.query_one("#in-global-batch", Input)
        assert box.value == "" and box.placeholder == "32 (file)"
        assert "32 (model file's OPTPLAN)" in text_of(pilot.app.screen.query_one("#objective-panel", KeyValues))

    drive(app, script)
