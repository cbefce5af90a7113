"""Snapshots of every screen at 120x40 (pytest-textual-snapshot; ``--snapshot-update`` regenerates them).

Deterministic by construction: a decoder by shape (no profiling time), a fixed seed, the fake NVML with
fixed readings, no clock in the header, no elapsed time or ETA anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from dashboard_helpers import SIZE, make_app, settle

from optplan.probes.hardware_fake import FakeNvml
from optplan.tui.widgets.trials_table import TrialsTable


def _keys(*keys: str) -> Callable[[Any], Any]:
    async def run_before(pilot: Any) -> None:
        await settle(pilot)
        for key in keys:
            await pilot.press(key)
            await settle(pilot)

    return run_before


@pytest.mark.parametrize(("name", "keys"), [
    ("overview", ()),
    ("search", ("2",)),
    ("plan", ("3",)),
    ("export", ("4",)),
    ("hardware", ("5",)),
    ("help", ("question_mark",)),
])
def test_screen_snapshot(name: str, keys: tuple[str, ...], snap_compare: Any) -> None:
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=_keys(*keys))


def test_what_if_snapshot(snap_compare: Any) -> None:
    async def run_before(pilot: Any) -> None:
        await settle(pilot)
        await pilot.press("2")
        await settle(pilot)
        pilot.app.screen.query_one(TrialsTable).focus()
        await pilot.press("down", "down", "down", "enter")
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=run_before)


def test_hardware_empty_snapshot(snap_compare: Any) -> None:
    assert snap_compare(make_app(nvml=FakeNvml.library_missing()), terminal_size=SIZE, run_before=_keys("5"))
