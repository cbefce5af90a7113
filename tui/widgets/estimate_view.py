"""One plan in full: memory per GPU by category against capacity, the step-time breakdown, time to train
and cost, and the lines that explain it (the chosen plan's rationale, or a "what if" comparison)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from optplan.estimators.estimate import Estimate, StatesEstimate
from optplan.estimators.memory import MemoryBreakdown
from optplan.estimators.timing import TimeBreakdown
from optplan.estimators.units import gib
from optplan.tui.fmt import amount, cost_band_text, gpu_hours_text, long_duration, usd_text
from optplan.tui.widgets.stacked_bar import BarData, Segment, StackedBar

MEMORY_COLORS = ("dodger_blue2", "medium_purple", "dark_orange", "green3", "gold3", "grey58")
TIME_COLORS = ("green3", "dark_sea_green4", "cyan", "medium_purple", "red3", "dark_orange", "grey58")


def _gib(n: float) -> str:
    """Bytes readably: '61.5 GiB', or '31 MiB' below a GiB (a sharded category is often small)."""
    return f"{gib(n):.1f} GiB" if n >= 2**30 or n == 0 else f"{n / 2**20:,.0f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f} ms"


def memory_bar(m: MemoryBreakdown, gpu: str) -> BarData:
    """Memory per GPU (worst rank) by category, against the GPU's usable capacity."""
    parts = (("weights", m.params_bytes), ("grads", m.grads_bytes), ("optimizer", m.optimizer_bytes),
             ("activations", m.activations_bytes), ("buffers", m.buffers_bytes), ("overhead", m.overhead_bytes))
    title = f"memory per GPU ({gpu})" + ("" if m.rank == "every rank" else f", worst rank: {m.rank}")
    return BarData(title=title, segments=tuple(Segment(label=n, value=float(v), color=c, always=True)
                                               for (n, v), c in zip(parts, MEMORY_COLORS, strict=True)),
                   capacity=float(m.capacity_bytes), capacity_label="usable", unit=_gib)


def time_bar(t: TimeBreakdown) -> BarData:
    """One optimizer step: compute, recompute, memory-bound work, optimizer, exposed communication,
    pipeline bubble and host overhead."""
    parts = (("compute", t.compute_s), ("recompute", t.recompute_s), ("memory-bound", t.memory_bound_s),
             ("optimizer", t.optimizer_s), ("exposed comm", t.exposed_comm_s), ("bubble", t.bubble_s),
             ("host", t.host_overhead_s))
    always = ("compute", "exposed comm", "bubble")
    return BarData(title=f"step time {_ms(t.step_s)} (communication {_ms(t.comm_s)}, "
                         f"{_ms(t.exposed_comm_s)} exposed)",
                   segments=tuple(Segment(label=n, value=v, color=c, always=n in always)
                                  for (n, v), c in zip(parts, TIME_COLORS, strict=True)), unit=_ms)


def summary_text(e: Estimate | StatesEstimate) -> Text:
    if isinstance(e, StatesEstimate):
        text = Text(f"{e.gpus} x {e.gpu}, global batch {e.global_batch}: model states, buffers and overhead "
                    "only (--params has no step time)\n")
        text.append(e.reason, style="green" if e.fits else "bold red")
        return text
    rate = f"{e.tokens_per_s:,.0f} tokens/s" if e.tokens_per_s else f"{e.samples_per_s:,.1f} samples/s"
    text = Text()
    text.append(f"{e.gpus} x {e.gpu}, global batch {e.global_batch}, {rate}, MFU {e.mfu * 100:.1f}%, "
                f"{e.model_tflops_per_gpu:.0f} TFLOP/s per GPU\n")
    text.append(e.reason, style="green" if e.fits else "bold red")
    return text


def cost_text(e: Estimate | StatesEstimate) -> Text:
    c = e.cost if isinstance(e, Estimate) else None
    if c is None:
        return Text("time to train and cost: give --tokens (and --price) to see them", style="dim")
    money = f", {usd_text(c.cost_usd)}" if c.cost_usd is not None else " (give --price for the cost)"
    return Text(f"time to train {c.tokens:.3g} tokens: {long_duration(c.train_time_s)}, "
                f"{gpu_hours_text(c.gpu_hours)}{money}, {amount(c.energy_kwh)} kWh{cost_band_text(c)}")


def bullets(heading: str, lines: Sequence[str]) -> Group:
    """A heading and one bullet per line, wrapped lines indented under their bullet."""
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True)
    table.add_column(ratio=1)
    for line in lines:
        table.add_row("•", Text(line))  # plain text: labels like "[torch]" are not markup
    return Group(Text(heading, style="bold"), table) if heading else Group(table)


class EstimateView(VerticalScroll):
    """``show`` fills it with one estimate and its explanation lines."""

    def compose(self) -> ComposeResult:
        yield Static(id="ev-title")
        yield Static(id="ev-summary")
        yield StackedBar(id="ev-memory")
        yield StackedBar(id="ev-time")
        yield Static(id="ev-cost")
        yield Static(id="ev-lines")

    def show(self, title: Text, e: Estimate | StatesEstimate, lines: Sequence[str], *, heading: str) -> None:
        self.query_one("#ev-title", Static).update(title)
        self.query_one("#ev-summary", Static).update(summary_text(e))
        self.query_one("#ev-memory", StackedBar).data = memory_bar(e.memory, e.gpu)
        self.query_one("#ev-time", StackedBar).data = time_bar(e.time) if e.time is not None else None
        self.query_one("#ev-cost", Static).update(cost_text(e))
        self.query_one("#ev-lines", Static).update(bullets(heading, lines))

    def show_message(self, title: Text, lines: Sequence[str], *, heading: str) -> None:
        """No estimate to show (nothing fits, or the run is still going)."""
        self.query_one("#ev-title", Static).update(title)
        self.query_one("#ev-summary", Static).update("")
        self.query_one("#ev-memory", StackedBar).data = None
        self.query_one("#ev-time", StackedBar).data = None
        self.query_one("#ev-cost", Static).update("")
        self.query_one("#ev-lines", Static).update(bullets(heading, lines))
