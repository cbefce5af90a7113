"""DualPipe plans are priced, never exported (no trainer optplan writes for runs it), and ``estimate
--pp-schedule`` takes the schedule with one-line errors (the schedule itself: tests/estimators/test_dualpipe.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from optplan.estimators.estimate import estimate
from optplan.planner.export.context import NotExportable, export_plan_for
from optplan.planner.export.registry import render_targets
from optplan.tui.cli import app
from tests.factories import DUALPIPE_MOE_ARCH, dualpipe_moe_plan


def test_priced_but_never_exported() -> None:
    prof, cluster, s = dualpipe_moe_plan()
    plan = export_plan_for(s, prof, cluster, shown=estimate(prof, cluster, s))
    files, skipped = render_targets(plan, ["all"])
    assert files == {} and skipped and all("DualPipe" in why for why in skipped)
    with pytest.raises(NotExportable, match="pp-schedule 1f1b"):
        render_targets(plan, ["torchrun"])


def test_cli_estimate_takes_the_schedule_and_refuses_bad_values() -> None:
    runner = CliRunner()
    args = ["estimate", "--arch", DUALPIPE_MOE_ARCH, "--gpu", "H100-SXM", "--gpus", "64", "--engine", "megatron",
            "--pp", "4", "--ep", "8", "--global-batch", "256"]
    out = runner.invoke(app, [*args, "--pp-schedule", "dualpipe", "--json"])
    assert out.exit_code == 0, out.stderr
    assert '"pp_schedule": "dualpipe"' in out.stdout
    bad = runner.invoke(app, [*args, "--pp-schedule", "zb1p"])
    assert bad.exit_code == 2 and "--pp-schedule" in bad.stderr and "1f1b" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    odd = runner.invoke(app, [*args, "--pp-schedule", "dualpipe", "--pp", "2", "--global-batch", "32"])
    assert odd.exit_code == 2 and "at least 2 x --pp" in odd.stderr
