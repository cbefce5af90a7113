"""The live table of priced candidates (trials): appended while the search runs, ranked when it is done."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import DataTable

from optplan.estimators.estimate import Estimate
from optplan.estimators.strategy import Strategy
from optplan.tui.fmt import gib_text, si

COLUMNS: tuple[tuple[str, int], ...] = (("#", 4), ("strategy", 30), ("GPUs", 4), ("GiB/GPU", 7), ("step ms", 8),
                                        ("throughput", 12), ("fits", 4), ("probe", 8))
"""(header, width): the label is cut at 30 cells; the Plan screen shows it whole."""
MAX_ROWS = 5000


def _row(number: int, e: Estimate, *, pick: bool, probe: str) -> tuple[object, ...]:
    label = Text(("★ " if pick else "") + e.strategy.label(), style="bold green" if pick else "")
    fits = Text("yes", style="green") if e.fits else Text("no", style="red")
    rate = f"{si(e.tokens_per_s)} tok/s" if e.tokens_per_s else f"{si(e.samples_per_s)} smp/s"
    return (str(number), label, str(e.gpus), gib_text(e.memory.total_bytes), f"{e.time.step_s * 1e3:,.1f}",
            Text(rate, justify="right"), fits, probe)


class TrialsTable(DataTable[object]):
    """Rows keyed by trial number; ``estimate_at`` maps the cursor back to the Estimate."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self._by_key: dict[str, Estimate] = {}
        self._numbers: dict[Strategy, int] = {}

    def on_mount(self) -> None:
        for header, width in COLUMNS:
            self.add_column(header, width=width)

    def reset(self) -> None:
        self.clear()
        self._by_key.clear()
        self._numbers.clear()

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
                rows.append((_row(number, e, pick=False, probe=""), key))
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
            self.add_row(*_row(number, e, pick=e.strategy == pick, probe=probes.get(e.strategy, "")), key=key)
        if self.row_count:
            self.move_cursor(row=0)

    def estimate_at(self, key: str | None) -> Estimate | None:
        return self._by_key.get(key) if key is not None else None
