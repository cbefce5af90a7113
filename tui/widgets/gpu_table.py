"""Live per-GPU readings (utilisation, memory, temperature, power) as a table with small bars."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import DataTable

from optplan.probes.hardware import GpuSample
from optplan.tui.fmt import gib_text

COLUMNS = ("GPU", "name", "util", "memory", "temp", "power")
BAR = 10


def _bar(fraction: float | None, text: str) -> Text:
    if fraction is None:
        return Text("n/a", style="dim")
    filled = max(0, min(BAR, round(fraction * BAR)))
    color = "green" if fraction < 0.6 else "yellow" if fraction < 0.9 else "red"
    return Text.assemble(("█" * filled, color), ("░" * (BAR - filled), "grey35"), f" {text}")


def _cells(s: GpuSample) -> tuple[object, ...]:
    util = None if s.utilization_percent is None else s.utilization_percent / 100
    mem = s.memory_used_bytes / s.memory_total_bytes if s.memory_total_bytes else None
    temp = Text("n/a", style="dim") if s.temperature_c is None else Text(
        f"{s.temperature_c} °C", style="red" if s.temperature_c >= 85 else "yellow" if s.temperature_c >= 75 else "")
    power = None if s.power_watts is None or not s.power_limit_watts else s.power_watts / s.power_limit_watts
    power_text = "n/a" if s.power_watts is None else f"{s.power_watts:.0f}/{s.power_limit_watts or 0:.0f} W"
    return (str(s.index), s.name, _bar(util, f"{s.utilization_percent}%"),
            _bar(mem, f"{gib_text(s.memory_used_bytes)}/{gib_text(s.memory_total_bytes)} GiB"), temp,
            _bar(power, power_text))


class GpuTable(DataTable[object]):
    """One row per GPU, refreshed in place."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="none", zebra_stripes=True)

    def on_mount(self) -> None:
        self.add_columns(*COLUMNS)

    def show(self, samples: Sequence[GpuSample]) -> None:
        self.clear()
        for s in samples:
            self.add_row(*_cells(s), key=str(s.index))
