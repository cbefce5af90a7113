"""A scatter of the priced candidates with the Pareto front and the pick (textual-plotext)."""

from __future__ import annotations

from collections.abc import Sequence

from textual_plotext import PlotextPlot

from optplan.estimators.estimate import Estimate
from optplan.estimators.units import gib
from optplan.planner.goal import Goal


def _axes(e: Estimate, goal: Goal) -> tuple[float, float]:
    """(x, y) of one candidate: memory per GPU vs samples/s, or GPU-hours vs days to train."""
    if goal.objective == "throughput" or goal.tokens is None:
        return gib(e.memory.total_bytes), e.samples_per_s
    return goal.gpu_hours(e), goal.train_time_s(e) / 86400


class ParetoPlot(PlotextPlot):
    """``show`` redraws: feasible candidates as dots, the front as a line, the pick as a star."""

    def show(self, feasible: Sequence[Estimate], front: Sequence[Estimate], pick: Estimate | None,
             goal: Goal) -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        throughput = goal.objective == "throughput" or goal.tokens is None
        plt.title("Pareto front")
        plt.xlabel("GiB per GPU" if throughput else "GPU-hours")
        plt.ylabel("samples/s" if throughput else "days")
        if feasible:
            xs, ys = zip(*(_axes(e, goal) for e in feasible), strict=True)
            plt.scatter(list(xs), list(ys), marker="dot", color="gray", label="feasible")
        if front:
            fx, fy = zip(*sorted(_axes(e, goal) for e in front), strict=True)
            plt.plot(list(fx), list(fy), marker="braille", color="cyan", label="Pareto front")
        if pick is not None:
            px, py = _axes(pick, goal)
            plt.scatter([px], [py], marker="*", color="green", label="pick")
        self.refresh()
