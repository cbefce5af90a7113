"""The live table of priced candidates (trials): appended while the search runs, ranked when it is done."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import DataTable

from optplan.estimators.estimate import Estimate
from optplan.estimators.strategy import Strategy
from optplan.tui.fmt import band_text, duration, gib_text, si3

COLUMNS: tuple[tuple[str, int], ...] = (("#", 4), ("strategy", 30), ("GPUs", 4), ("GiB/GPU", 7), ("step", 7),
                                        ("band %", 9), ("throughput", 11), ("fits", 4), ("probe", 7))
"""(header, width); band: the step time's band around the estimate (fast/slow end, %, up to '-99/+999'; the ranking
uses the slow end); GPUs only when the GPU count is searched; the strategy column takes the width left over
(at least 16 cells: a longer label is
cut, the Plan screen shows it whole)."""
MIN_STRATEGY = 16
BESIDE = 36 + 4  # the Pareto plot beside the table (app.tcss) and both borders
MAX_ROWS = 5000


def _row(number: int, e: Estimate, *, pick: bool, probe: str, gpus: bool) -> tuple[object, ...]:
    label = Text(("★ " if pick else "") + e.strategy.label(), style="bold green" if pick else "")
    fits = Text("yes", style="green") if e.fits else Text("no", style="red")
    rate = f"{si3(e.tokens_per_s)} tok/s" if e.tokens_per_s else f"{si3(e.samples_per_s)} smp/s"
    head = (str(number), label, str(e.gpus)) if gpus else (str(number), label)
    band = band_text(e.time.step_s, e.time.step_s_low, e.time.step_s_high)
    return (*head, gib_text(e.memory.total_bytes), duration(e.time.step_s), band, Text(rate, justify="right"), fits,
            probe)


class TrialsTable(DataTable[object]):
    """Rows keyed by trial number; ``estimate_at`` maps the cursor back to the Estimate."""

    def __init__(self, *, show_gpus: bool = True, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self.columns_shown = tuple(c for c in COLUMNS if show_gpus or c[0] != "GPUs")
        self._by_key: dict[str, Estimate] = {}
        self._numbers: dict[Strategy, int] = {}

    def on_mount(self) -> None:
        fixed = sum(width for header, width in self.columns_shown if header != "strategy")
        spare = self.app.size.width - BESIDE - fixed - 2 * self.cell_padding * len(self.columns_shown) - 2  # scrollbar
        for header, width in self.columns_shown:
            self.add_column(header, width=max(MIN_STRATEGY, spare) if header == "strategy" else width)

    def reset(self) -> None:
        self.clear()
        self._by_key.clear()
        self._numbers.clear()

    @property
    def _gpus(self) -> bool:
        return any(header == "GPUs" for header, _ in self.columns_shown)

    @property
    def shown(self) -> int:
        """How many trials have been received (rows are capped at MAX_ROWS)."""
        return len(self._numbers)

    def append(self, estimates: Sequence[Estimate]) -> None:
        """Add trials in the order they were priced."""
        rows = []
        for e in estimates:
            number = len(self._numbers) + 1
            self._numbers[e.strategy] = number
            if len(self._by_key) < MAX_ROWS:
                key = str(number)
                self._by_key[key] = e
                rows.append((_row(number, e, pick=False, probe="", gpus=self._gpus), key))
        for row, key in rows:
            self.add_row(*row, key=key)

    def show_ranked(self, ranked: Sequence[Estimate], *, pick: Strategy | None,
                    probes: dict[Strategy, str]) -> None:
        """Replace the rows by ``ranked`` (best first), the pick starred, probe outcomes filled in."""
        self.clear()
        self._by_key.clear()
        for e in ranked[:MAX_ROWS]:
            number = self._numbers.setdefault(e.strategy, len(self._numbers) + 1)
            key = str(number)
            self._by_key[key] = e
            self.add_row(*_row(number, e, pick=e.strategy == pick, probe=probes.get(e.strategy, ""), gpus=self._gpus),
                         key=key)
        if self.row_count:
            self.move_cursor(row=0)

    def estimate_at(self, key: str | None) -> Estimate | None:
        return self._by_key.get(key) if key is not None else None
