"""A horizontal stacked bar against a capacity: memory per GPU by category, or a step's time by part."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict
from rich.console import RenderableType
from rich.text import Text
from textual.geometry import Size
from textual.reactive import reactive
from textual.widget import Widget


class Segment(BaseModel):
    """One part of the bar."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str
    value: float
    color: str
    always: bool = False  # listed in the legend even when zero


class BarData(BaseModel):
    """What the bar shows: its parts, the capacity they are measured against (None: their sum) and how
    values read ('12.3 GiB')."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    title: str
    segments: tuple[Segment, ...]
    capacity: float | None = None
    capacity_label: str = "capacity"
    unit: Callable[[float], str]


def _cells(values: Sequence[float], scale: float, width: int) -> list[int]:
    """Integer cell counts for ``values`` on ``width`` cells per ``scale``, rounding so the total is right
    (largest remainders first) and every non-zero part gets at least one cell when there is room."""
    if scale <= 0 or width <= 0:
        return [0 for _ in values]
    exact = [v / scale * width for v in values]
    cells = [int(x) for x in exact]
    target = min(width, round(sum(exact)))
    order = sorted(range(len(values)), key=lambda i: exact[i] - cells[i], reverse=True)
    for i in order:
        if sum(cells) >= target:
            break
        cells[i] += 1
    for i, v in enumerate(values):  # a small but present part stays visible
        if v > 0 and cells[i] == 0 and sum(cells) < width:
            cells[i] = 1
    return cells


class StackedBar(Widget):
    """``data`` as a bar on the widget's width with a legend under it; the capacity is the full width
    (a total above it overflows, marked in red)."""

    DEFAULT_CSS = """
    StackedBar { height: auto; }
    """

    data: reactive[BarData | None] = reactive(None, layout=True)

    def render(self) -> RenderableType:
        return self._text(self.size.width)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._text(width).wrap(self.app.console, max(width, 1)))

    def _text(self, width_cells: int) -> Text:
        d = self.data
        if d is None:
            return Text("")
        width = max(10, width_cells)
        total = sum(s.value for s in d.segments)
        full = max(total, d.capacity or 0.0) or 1.0
        cells = _cells([s.value for s in d.segments], full, width)
        bar = Text()
        for seg, n in zip(d.segments, cells, strict=True):
            bar.append("█" * n, style=seg.color)
        free = width - sum(cells)
        if d.capacity is not None and total <= d.capacity:
            bar.append("░" * free, style="grey35")
        elif d.capacity is not None:
            cap_cell = int(d.capacity / full * width)
            bar = bar[:cap_cell] + Text("│", style="bold red") + bar[cap_cell + 1:]
        out = Text()
        out.append(d.title, style="bold")
        out.append("\n")
        out.append_text(bar)
        out.append("\n")
        listed = [seg for seg in d.segments if seg.value > 0 or seg.always]
        for i, seg in enumerate(listed):
            if i:
                out.append("  ")
            out.append("■ ", style=seg.color)
            out.append(f"{seg.label} {d.unit(seg.value)}")
        out.append("\n")
        if d.capacity is not None:
            share = total / d.capacity * 100 if d.capacity else 0.0
            over = total > d.capacity
            out.append(f"total {d.unit(total)} of {d.unit(d.capacity)} {d.capacity_label} ({share:.0f}%)",
                       style="bold red" if over else "bold")
        else:
            out.append(f"total {d.unit(total)}", style="bold")
        return out
