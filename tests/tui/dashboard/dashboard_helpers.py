"""Dashboard test helpers: a tiny decoder by shape (profiled by formula, no child process), a fake NVML
with fixed readings, and a factory that builds the app the way the CLI does."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Awaitable, Callable
from typing import Any

from rich.console import Console
from textual.widget import Widget
from textual.widgets import Static

from optplan.probes.hardware_fake import FakeDevice, FakeNvml
from optplan.tui.app import DashboardApp, create_app
from optplan.tui.recommend_args import RecommendArgs

TINY_ARCH = "layers=2,hidden=64,heads=4,vocab=1000,seq=128"
SIZE = (120, 40)


def tiny_args(**update: Any) -> RecommendArgs:
    """A 2-layer decoder on 8 H100s, global batch 64, DeepSpeed and torch: ~430 candidates, 0.3 s."""
    base = dict(arch=TINY_ARCH, gpu="H100-SXM", gpus=8, global_batch=64, engine=("deepspeed", "torch"))
    return RecommendArgs(**{**base, **update})


def fake_gpus() -> FakeNvml:
    """Two H100s with fixed live readings (snapshots stay the same)."""
    return FakeNvml([
        FakeDevice(name="NVIDIA H100 80GB HBM3", memory_total=80 * 2**30, memory_used=61 * 2**30,
                   utilization_gpu=97, utilization_memory=71, temperature_c=71, power_watts=612.0),
        FakeDevice(name="NVIDIA H100 80GB HBM3", memory_total=80 * 2**30, memory_used=12 * 2**30,
                   utilization_gpu=8, utilization_memory=3, temperature_c=38, power_watts=95.0),
    ])


def make_app(args: RecommendArgs | None = None, **kwargs: Any) -> DashboardApp:
    """The app as the CLI builds it (the same factory); no GPU probing, the fake NVML unless given."""
    kwargs.setdefault("nvml", fake_gpus())
    kwargs.setdefault("gpu_here", lambda: False)
    return create_app(args or tiny_args(), **kwargs)


async def settle(pilot: Any) -> None:
    """Wait until every worker (search, export rendering) is done and the messages are handled."""
    for _ in range(3):
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()


def drive(app: DashboardApp, script: Callable[[Any], Awaitable[None]], size: tuple[int, int] = SIZE) -> None:
    """Run ``script(pilot)`` against the app headless (pytest-asyncio is not used: asyncio.run here)."""

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await settle(pilot)
            await script(pilot)

    asyncio.run(main())


def text_of(widget: Widget) -> str:
    """The plain text a widget shows: a Static's content, else what it renders (at 200 columns)."""
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(widget.content if isinstance(widget, Static) else widget.render())
    return console.export_text()
