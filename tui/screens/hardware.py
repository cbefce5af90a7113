"""Hardware: live utilisation, memory, temperature and power per GPU from NVML (nvitop-like), or a clear
empty state on a machine without a GPU."""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual.containers import Center, Vertical
from textual.widget import Widget
from textual.widgets import Static

from optplan.planner.api import sample_hardware
from optplan.probes.hardware import LiveReport
from optplan.tui.screens.base import DashboardScreen
from optplan.tui.widgets.gpu_table import GpuTable


def empty_text(report: LiveReport, target: str) -> Text:
    return Text.assemble(("No GPU on this machine\n\n", "bold"), (f"{report.reason}\n\n", "dim"),
                         "optplan plans for the target cluster instead: ", (target, "bold"),
                         "\nLive readings appear here when NVML sees a GPU (run the dashboard on the GPU box).")


class HardwareScreen(DashboardScreen):
    MODE = "hardware"

    def body(self) -> Iterable[Widget]:
        with Vertical(id="hardware-box"):
            yield Static(id="hardware-head")
            yield GpuTable(id="gpu-table")
            with Center(id="hardware-empty-box"):
                yield Static(id="hardware-empty")

    def on_mount(self) -> None:
        self.sample()
        self.set_interval(self.dash.hardware_interval_s, self.sample)

    def sample(self) -> None:
        """Read every GPU once (NVML calls take microseconds) and redraw."""
        report = sample_hardware(self.dash.nvml)
        table = self.query_one(GpuTable)
        empty = self.query_one("#hardware-empty-box")
        head = self.query_one("#hardware-head", Static)
        if not report.available:
            c = self.dash.prepared.cluster
            table.display = False
            empty.display = True
            head.update("")
            self.query_one("#hardware-empty", Static).update(empty_text(report, f"{c.gpus} x {c.gpu.name}"))
            return
        table.display = True
        empty.display = False
        driver = f", driver {report.driver_version}" if report.driver_version else ""
        head.update(Text(f"{report.reason}{driver}", style="bold"))
        table.show(report.samples)
