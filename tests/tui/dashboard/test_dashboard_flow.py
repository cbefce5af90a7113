"""Whole flows: a real model file through profile -> search -> plan -> export, overwrite protection, and
the ``optplan dashboard`` command's handling of bad input (one line, exit 2, the app never starts)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from dashboard_helpers import drive, make_app, settle, text_of, tiny_args
from textual.app import App
from textual.widgets import OptionList, SelectionList
from typer.testing import CliRunner

from optplan.tui.app import DashboardApp
from optplan.tui.cli import app as cli_app
from optplan.tui.recommend_args import RecommendArgs
from optplan.tui.screens.confirm import ConfirmScreen

ROOT = Path(__file__).resolve().parents[3]
MLP = ROOT / "examples" / "mlp.py"


def test_real_model_file_plan_then_export(tmp_path: Path) -> None:
    """examples/mlp.py profiled in its child process, searched, planned, exported, files validated."""
    out = tmp_path / "plan"
    app = make_app(RecommendArgs(model=MLP, gpu="H100-SXM", gpus=8, out=out))
    expected = {"plan.json", "PLAN.md", "launch.sh", "train.py"}

    async def script(pilot: Any) -> None:
        rec = pilot.app.result.recommendation
        assert pilot.app.profile.name == "mlp" and rec.fits and rec.model_path == str(MLP)
        assert len(pilot.app.trials) == rec.search.evaluated
        if rec.plan.engine == "deepspeed":  # a torch DDP/FSDP plan has no DeepSpeed config to write
            expected.add("ds_config.json")
        s = rec.plan
        if not (s.engine == "torch" and s.fsdp == "none" and s.precision in ("bf16", "fp16")):
            expected.add("accelerate.yaml")  # else refused: accelerate's 16-bit switch is autocast without FSDP
        await pilot.press("4")
        await settle(pilot)
        screen = pilot.app.screen
        files = screen.query_one("#export-files", OptionList)
        names = [str(files.get_option_at_index(i).prompt) for i in range(files.option_count)]
        assert expected <= set(names)
        assert ("ds_config.json" in names) == ("ds_config.json" in expected)
        assert "launch config accepted" in str(screen.query_one("#export-status").content)
        await pilot.press("w")
        await settle(pilot)
        assert "wrote" in str(screen.query_one("#export-status").content)

    drive(app, script)
    for name in expected:
        assert (out / name).is_file(), name
    assert (out / "ds_config.json").is_file() == ("ds_config.json" in expected)
    assert "mlp" in (out / "plan.json").read_text()
    assert (out / "optplan-study.log").exists()  # --out keeps the study (resumable)


async def export_only_torchrun(pilot: Any) -> Any:
    """Open the Export screen with only the torchrun target picked; returns the screen."""
    await pilot.press("4")
    await settle(pilot)
    screen = pilot.app.screen
    targets = screen.query_one(SelectionList)
    targets.deselect_all()
    targets.select("torchrun")
    await settle(pilot)
    return screen


def test_second_export_asks_before_overwriting(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    out.mkdir()
    (out / "launch.sh").write_text("mine\n")
    app = make_app(tiny_args(out=out))

    async def script(pilot: Any) -> None:
        screen = await export_only_torchrun(pilot)
        assert set(screen.files) == {"plan.json", "PLAN.md", "launch.sh"}
        await pilot.press("w")
        await pilot.pause()
        assert isinstance(pilot.app.screen, ConfirmScreen)
        await pilot.press("n")
        await pilot.pause()
        assert (out / "launch.sh").read_text() == "mine\n"
        assert not (out / "plan.json").exists()  # all or nothing
        assert "nothing written" in str(screen.query_one("#export-status").content)
        await pilot.press("w")
        await pilot.pause()
        assert isinstance(pilot.app.screen, ConfirmScreen)
        await pilot.press("y")
        await pilot.pause()
        assert "torchrun" in (out / "launch.sh").read_text()
        assert (out / "plan.json").is_file()

    drive(app, script)


def test_force_writes_without_asking(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    out.mkdir()
    (out / "plan.json").write_text("old\n")
    app = make_app(tiny_args(out=out, force=True))

    async def script(pilot: Any) -> None:
        await export_only_torchrun(pilot)
        await pilot.press("w")
        await pilot.pause()
        assert not isinstance(pilot.app.screen, ConfirmScreen)

    drive(app, script)
    assert (out / "plan.json").read_text() != "old\n" and (out / "launch.sh").is_file()


runner = CliRunner()


@pytest.mark.parametrize(("argv", "message"), [
    (["--arch", "layers=2,hidden=64,heads=4", "--objective", "speed"], "unknown --objective 'speed'"),
    ([str(MLP), "--gpus", "8", "--global-batch", "12", "--gpu", "H100-SXM"], "global batch 12 is not divisible by 8"),
    (["--arch", "layers=2,hidden=64,heads=4", "--gpu", "NoSuchGPU"], "NoSuchGPU"),
    (["--arch", "layers=2,hidden=64,heads=4", "--objective", "time"], "--objective time needs --tokens"),
])
def test_dashboard_bad_options_exit_2_before_the_app_starts(argv: list[str], message: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[object] = []
    monkeypatch.setattr(DashboardApp, "run", lambda self, **kw: started.append(self))
    result = runner.invoke(cli_app, ["dashboard", *argv])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in result.output and not started


def test_dashboard_broken_model_file_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first profile fails inside the app: it exits at once and the CLI prints the reason."""
    bad = tmp_path / "broken.py"
    bad.write_text("import torch\nraise RuntimeError('boom in the model file')\n")
    monkeypatch.setattr(DashboardApp, "run", functools.partialmethod(App.run, headless=True))
    result = runner.invoke(cli_app, ["dashboard", str(bad), "--gpu", "H100-SXM", "--no-probe"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "boom in the model file" in lines[0]
    assert "Traceback" not in result.output


def test_dashboard_takes_recommends_options() -> None:
    def options(command: str) -> set[str]:
        help_text = runner.invoke(cli_app, [command, "--help"], env={"COLUMNS": "250"}).stdout
        return {w.strip("│,") for w in help_text.split() if w.startswith("--")}

    assert options("recommend") - options("dashboard") == {"--json", "--help"} - {"--help"}


def test_first_run_that_fails_in_the_search_exits_2_but_a_replan_failure_stays_in_the_app(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DashboardApp, "run", functools.partialmethod(App.run, headless=True))
    result = runner.invoke(cli_app, ["dashboard", "--arch", "layers=2,hidden=64,heads=4,seq=128", "--gpu", "H100-SXM",
                                     "--gpus", "8", "--global-batch", "12", "--engine", "deepspeed"])
    assert result.exit_code == 2, result.output
    assert "global batch 12 is not divisible" in result.stderr and len(result.stderr.strip().splitlines()) == 1

    app = make_app()

    async def script(pilot: Any) -> None:
        pilot.app.replan(tiny_args(global_batch=12))
        await settle(pilot)
        assert pilot.app.is_running and pilot.app.status.phase == "failed"
        assert "global batch 12 is not divisible" in (pilot.app.error or "")
        await pilot.press("3")
        await pilot.pause()
        assert "planning failed" in text_of(pilot.app.screen.query_one("#ev-title"))
        assert "global batch 12 is not divisible" in text_of(pilot.app.screen.query_one("#ev-lines"))

    drive(app, script)


def test_a_crash_inside_the_app_is_one_line_exit_3_without_textuals_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in a screen ends the app: the CLI says it is a bug in one line (exit 3), as every command does."""
    from optplan.tui.screens import overview

    def broken(*_args: object) -> list[tuple[str, str]]:
        raise ValueError("kaboom in a screen")

    monkeypatch.setattr(overview, "model_rows", broken)
    monkeypatch.setattr(DashboardApp, "run", functools.partialmethod(App.run, headless=True))
    result = runner.invoke(cli_app, ["dashboard", "--arch", "layers=2,hidden=64,heads=4,seq=128", "--gpu", "H100-SXM",
                                     "--no-probe"])
    assert result.exit_code == 3, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: internal error in optplan (ValueError: kaboom in a screen)")
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("args", "shown"), [
    (RecommendArgs(hf="/models/llama"), "--hf /models/llama"),
    (RecommendArgs(arch="layers=2,hidden=64,heads=4"), "--arch layers=2,hidden=64,heads=4"),
    (RecommendArgs(params=7e9), "--params 7e+09"),
    (RecommendArgs(model=MLP), str(MLP)),
])
def test_the_overview_names_the_model_source_while_it_profiles(args: RecommendArgs, shown: str) -> None:
    from optplan.tui.screens.overview import model_rows

    assert model_rows(None, args)[0] == ("model", shown)
