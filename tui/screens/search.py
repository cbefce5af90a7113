"""Search: progress, the live table of trials, the best so far and the Pareto front."""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.widgets import DataTable, ProgressBar, Static

from optplan.estimators.estimate import Estimate
from optplan.estimators.strategy import Strategy
from optplan.planner.goal import pareto_front, rank
from optplan.tui.fmt import gib_text
from optplan.tui.screens.base import DashboardScreen
from optplan.tui.widgets.pareto_plot import ParetoPlot
from optplan.tui.widgets.trials_table import TrialsTable


def best_text(best: Estimate | None, count: int, *, final: bool) -> Text:
    if best is None:
        return Text(f"{count} candidates priced; none fits yet" if count else "waiting for the first candidates",
                    style="dim")
    rate = f"{best.tokens_per_s:,.0f} tokens/s" if best.tokens_per_s else f"{best.samples_per_s:,.1f} samples/s"
    head = "chosen" if final else "best so far"
    return Text.assemble((f"{head}: ", "bold"), (best.strategy.label(), "bold green"),
                         f" on {best.gpus} GPUs: {rate}, {gib_text(best.memory.total_bytes)} GiB per GPU, "
                         f"step {best.time.step_s * 1e3:,.1f} ms  ({count} priced)")


class SearchScreen(DashboardScreen):
    MODE = "search"

    def body(self) -> Iterable[Widget]:
        with Vertical(id="search-head"):
            yield ProgressBar(id="search-progress", show_eta=False)
            yield Static(id="search-best")
        with Horizontal(id="search-main"):
            yield TrialsTable(id="trials", show_gpus=self.dash.prepared.gpu_counts is not None)
            yield ParetoPlot(id="pareto")

    def on_mount(self) -> None:
        self._seen = 0
        self.watch(self.app, "status", self._status_changed)
        self.watch(self.app, "trials", self._trials_changed)
        self.watch(self.app, "result", self._result_changed)

    def _status_changed(self, _value: object = None) -> None:
        status = self.dash.status
        bar = self.query_one("#search-progress", ProgressBar)
        if status.phase in ("searching", "probing", "done") and status.total:
            bar.update(total=status.total, progress=status.done)
        elif status.phase == "profiling":
            bar.update(total=None, progress=0)

    def _trials_changed(self, _value: object = None) -> None:
        trials = self.dash.trials
        table = self.query_one(TrialsTable)
        if len(trials) < self._seen:  # a new run
            table.reset()
            self._seen = 0
        if self.dash.result is not None:
            return
        table.append(trials[self._seen:])
        self._seen = len(trials)
        goal = self.dash.prepared.goal
        ranked = rank(list(trials), goal)
        best = ranked[0] if ranked and ranked[0].fits else None
        self.query_one("#search-best", Static).update(best_text(best, len(trials), final=False))
        feasible = [e for e in trials if e.fits]
        self.query_one(ParetoPlot).show(feasible, pareto_front(feasible, goal), best, goal)

    def _result_changed(self, _value: object = None) -> None:
        result = self.dash.result
        if result is None:
            return
        rec = result.recommendation
        goal = result.prepared.goal
        trials = self.dash.trials
        ranked = rank(list(trials), goal)
        probes: dict[Strategy, str] = {}
        if rec.probes is not None:
            for c in rec.probes.probed:
                step = f" {c.result.step_s * 1e3:,.0f} ms" if c.result.step_s is not None else ""
                probes[c.candidate] = f"{c.result.status}{step}"
        pick = rec.estimate if isinstance(rec.estimate, Estimate) else None
        self.query_one(TrialsTable).show_ranked(ranked, pick=rec.plan, probes=probes)
        self._seen = len(trials)
        self.query_one("#search-best", Static).update(
            best_text(pick, len(trials), final=True) if pick is not None
            else Text(f"no plan fits ({len(trials)} priced): see the Plan screen for what would", style="bold red"))
        feasible = [e for e in trials if e.fits]
        self.query_one(ParetoPlot).show(feasible, pareto_front(feasible, goal), pick, goal)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a trial: show it on the Plan screen."""
        estimate = self.query_one(TrialsTable).estimate_at(event.row_key.value)
        if estimate is not None:
            self.dash.select_trial(estimate)
            self.app.switch_mode("plan")
