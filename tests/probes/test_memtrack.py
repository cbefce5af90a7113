"""MemTracker: live storage bytes and peak on real and fake CPU tensors."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from optplan.probes.memtrack import MemTracker

MB = 2**20


def sequence() -> tuple[int, int]:
    """Allocate, view, update in place and free; returns (peak, live) above the baseline."""
    kept = torch.ones(MB // 4)  # 1 MiB fp32
    tracker = MemTracker()
    tracker.track(kept)
    with tracker:
        a = torch.empty(MB // 4)  # +1 MiB
        view = a.view(2, -1)[0]  # a view: no new storage
        a.add_(1)  # in place: nothing new
        kept.mul_(2)  # in place on a registered tensor: nothing new
        b = a * 2  # +1 MiB (peak 2 MiB above baseline)
        del a, view
        c = b.to(torch.float16)  # +0.5 MiB (a still freed: 1.5 MiB)
        del b, c
        d = torch.zeros(MB // 8)  # +0.5 MiB
    return tracker.peak_above_baseline, tracker.live_bytes - tracker.baseline_bytes, d


def test_views_inplace_and_frees_are_counted_right():
    peak, live, d = sequence()
    assert peak == 2 * MB
    assert live == MB // 2 and d.numel() == MB // 8


def test_same_numbers_on_fake_tensors():
    with FakeTensorMode(allow_non_fake_inputs=True):
        peak, live, _ = sequence()
    assert (peak, live) == (2 * MB, MB // 2)


def test_register_and_param_copies_under_autocast():
    lin = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(4, 256)
    tracker = MemTracker()
    added = tracker.track(lin.parameters(), category="param")
    assert added == 256 * 256 * 4 and tracker.baseline_bytes == added
    with tracker, torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert tracker.peak_by_category.get("param_copy") == 256 * 256 * 2  # autocast's bf16 weight copy
    assert tracker.peak_without_copies - tracker.baseline_bytes < tracker.peak_above_baseline
    del y


def test_reset_peak_and_baseline():
    tracker = MemTracker()
    with tracker:
        a = torch.empty(1000, dtype=torch.uint8)
        del a
        tracker.reset_peak()
        assert tracker.peak_bytes == tracker.live_bytes
        b = torch.empty(10, dtype=torch.uint8)
    assert tracker.peak_above_baseline == pytest.approx(10)
    del b
    assert tracker.live_bytes == 0


def test_timeline_records_live_bytes_after_each_allocation_per_phase():
    lin = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(4, 256)
    tracker = MemTracker(record=True)
    tracker.track(lin.parameters(), category="param")
    with tracker:
        tracker.phase = "forward"
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(500, dtype=torch.uint8)
        del a
        view = b[:10]  # no new storage: no event
        tracker.phase = "amp"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
    timeline = tracker.timeline()
    assert list(timeline) == ["forward", "amp"]
    assert timeline["forward"] == [(1000, 1000), (1500, 1500)]
    copy = 256 * 256 * 2  # autocast's bf16 weight copy: in the first column only
    act = 4 * 256 * 2  # the bf16 copy of x, then the bf16 output
    assert timeline["amp"] == [(500 + copy, 500), (500 + copy + act, 500 + act),
                               (500 + copy + 2 * act, 500 + 2 * act)]
    assert timeline["amp"][-1][0] == tracker.peak_above_baseline
    assert not MemTracker().record and MemTracker().timeline() == {}
    del view, y
