"""Plan: the chosen strategy (or the selected trial: "what if") in full, and why."""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual.binding import Binding
from textual.widget import Widget

from optplan.estimators.estimate import Estimate
from optplan.planner.whatif import what_if
from optplan.tui.screens.base import DashboardScreen
from optplan.tui.widgets.estimate_view import EstimateView


class PlanScreen(DashboardScreen):
    MODE = "plan"
    BINDINGS = [Binding("c", "chosen", "Chosen plan")]

    def body(self) -> Iterable[Widget]:
        yield EstimateView(id="plan-view")

    def on_mount(self) -> None:
        self.watch(self.app, "result", self._refresh_plan)
        self.watch(self.app, "selected", self._refresh_plan)
        self.watch(self.app, "error", self._refresh_plan)

    def _refresh_plan(self, _value: object = None) -> None:
        view = self.query_one(EstimateView)
        result = self.dash.result
        selected = self.dash.selected
        if result is None and self.dash.error:
            view.show_message(Text("planning failed", style="bold red"),
                              [self.dash.error, "fix the input on the Overview (1) and re-plan (r)"], heading="")
            return
        if result is None:
            view.show_message(Text("no plan yet", style="bold"),
                              ["the search is running: watch it on the Search screen (2)"], heading="")
            return
        rec = result.recommendation
        pick = rec.estimate if isinstance(rec.estimate, Estimate) else None
        if rec.estimate is not None and pick is None:  # --params: model states only
            view.show(Text.assemble(("chosen plan: ", "bold"), (rec.estimate.strategy.label(), "bold green")),
                      rec.estimate, [*rec.rationale, *(f"note: {n}" for n in rec.notes)], heading="why")
            return
        if selected is not None and (pick is None or selected.strategy != pick.strategy):
            w = what_if(selected, pick, goal=result.prepared.goal, cluster=result.prepared.cluster)
            title = Text.assemble(("what if: ", "bold yellow"), (selected.strategy.label(), "bold"),
                                  ("   (c: back to the chosen plan)", "dim"))
            view.show(title, w.estimate, w.lines, heading="compared with the chosen plan")
            return
        if pick is None:
            view.show_message(Text("NO PLAN FITS", style="bold red"), [*rec.rationale, *rec.suggestions],
                              heading="why, and what would fit")
            return
        title = Text.assemble(("chosen plan: ", "bold"), (pick.strategy.label(), "bold green"))
        view.show(title, pick, [*rec.rationale, *(f"note: {n}" for n in rec.notes)], heading="why")

    def action_chosen(self) -> None:
        self.dash.select_trial(None)
