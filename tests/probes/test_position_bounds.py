"""A sequence longer than a model's position table fails the profile with one line (fake tensors would not), and
the tracker's bookkeeping by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from typer.testing import CliRunner

from optplan.probes.position_bounds import PositionTracker
from optplan.tui.cli import app

runner = CliRunner()

MODEL = """
import torch, torch.nn as nn
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(1000, 32)
        self.where = nn.Embedding(128, 32)  # no config names it: only the lookup shows the limit
        self.out = nn.Linear(32, 1000)
    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        return self.out(self.tok(ids) + self.where(pos))
def build_model():
    return M()
"""


def test_a_sequence_past_the_position_table_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "short.py"
    f.write_text(MODEL)
    long = runner.invoke(app, ["profile", str(f), "--seq-len", "512"])
    assert long.exit_code == 2, long.output
    assert "looks up position 511 in an embedding table of 128 rows" in long.output
    assert "use --seq-len 128 or less" in long.output and "Traceback" not in long.output
    fits = runner.invoke(app, ["profile", str(f), "--seq-len", "128", "--json"])
    assert fits.exit_code == 0, fits.output


def test_the_tracker_follows_arange_through_views_and_offsets() -> None:
    table = nn.Embedding(10, 4)
    with FakeTensorMode(allow_non_fake_inputs=True), PositionTracker() as tracker:  # fake: no IndexError
        table(torch.arange(10).unsqueeze(0))  # 0..9: inside
        table(torch.arange(2, 12, 2)[None, :])  # 2..10: past
        table(torch.arange(9) + 2)  # 2..10: past
        table(torch.randint(0, 10, (3,)))  # values from data: not tracked
    assert tracker.overruns == [(10, 10), (10, 10)]


@pytest.mark.parametrize("args,kwargs,top", [((5,), {}, 4), ((2, 7), {}, 6), ((0, 10, 3), {}, 9), ((), {"end": 4}, 3),
                                             ((3, 3), {}, None)])
def test_arange_bounds(args: tuple, kwargs: dict, top: int | None) -> None:
    from optplan.probes.position_bounds import _arange_max

    assert _arange_max(args, kwargs) == top
