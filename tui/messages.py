"""Messages the planning worker (a thread) posts to the dashboard app; each carries its run's id so that
reports of a run that was superseded by a re-plan are ignored."""

from __future__ import annotations

from textual.message import Message

from optplan.estimators.estimate import Estimate
from optplan.estimators.profile import ModelProfile
from optplan.planner.events import ProgressEvent
from optplan.tui.session import PlanResult


class RunMessage(Message):
    """A report from planning run ``run_id``."""

    def __init__(self, run_id: int) -> None:
        super().__init__()
        self.run_id = run_id


class Profiled(RunMessage):
    def __init__(self, run_id: int, profile: ModelProfile) -> None:
        super().__init__(run_id)
        self.profile = profile


class Progressed(RunMessage):
    def __init__(self, run_id: int, event: ProgressEvent) -> None:
        super().__init__(run_id)
        self.event = event


class TrialsPriced(RunMessage):
    def __init__(self, run_id: int, estimates: tuple[Estimate, ...]) -> None:
        super().__init__(run_id)
        self.estimates = estimates


class Planned(RunMessage):
    def __init__(self, run_id: int, result: PlanResult) -> None:
        super().__init__(run_id)
        self.result = result


class PlanFailed(RunMessage):
    def __init__(self, run_id: int, error: str) -> None:
        super().__init__(run_id)
        self.error = error
