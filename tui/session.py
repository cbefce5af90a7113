"""One planning run for the dashboard, in plain Python (no textual): profile, search, explain.

The dashboard runs :func:`run_session` in a thread worker. What happens goes out through the ``Sink``
callbacks (which post messages to the UI); a ``cancelled`` check is made at every progress event and
every priced candidate, so quitting or re-planning stops the search within one candidate, and the
profiling child and probe processes poll it too, so they are stopped within about a second. The study is
only ever cut between Optuna writes: a rerun with the same ``--storage`` resumes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from optplan.estimators.errors import Cancelled
from optplan.estimators.estimate import Estimate
from optplan.estimators.profile import ModelProfile
from optplan.planner.events import ProgressEvent
from optplan.planner.recommend import Recommendation
from optplan.tui.recommend_run import PreparedRecommend, goal_for, gpu_present, profile_for, run_recommend

TRIAL_BATCH_S = 0.1


class SessionCancelled(Cancelled):
    """Raised inside the search when the run was cancelled (quit, or a newer re-plan)."""


class PlanResult(BaseModel):
    """What one run produced: the options it ran with, the profile and the recommendation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prepared: PreparedRecommend
    profile: ModelProfile
    recommendation: Recommendation


class Sink(Protocol):
    """Where a run reports (the dashboard posts each call to the UI thread as a message)."""

    def profiled(self, profile: ModelProfile) -> None: ...

    def progress(self, event: ProgressEvent) -> None: ...

    def trials(self, estimates: tuple[Estimate, ...]) -> None: ...


class TrialBatcher:
    """Collects priced candidates and hands them on in batches (at most one per ``interval_s``), so the
    UI is not asked to redraw for each of thousands of candidates."""

    def __init__(self, deliver: Callable[[tuple[Estimate, ...]], None], *, interval_s: float = TRIAL_BATCH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._deliver = deliver
        self._interval_s = interval_s
        self._clock = clock
        self._pending: list[Estimate] = []
        self._last = clock()

    def add(self, estimate: Estimate) -> None:
        self._pending.append(estimate)
        if self._clock() - self._last >= self._interval_s:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            batch, self._pending = tuple(self._pending), []
            self._deliver(batch)
        self._last = self._clock()


def run_session(prepared: PreparedRecommend, sink: Sink, *, profile: ModelProfile | None = None,
                cancelled: Callable[[], bool] = lambda: False,
                gpu_here: Callable[[], bool] = gpu_present) -> PlanResult:
    """Profile (unless ``profile`` is given), search and explain, reporting to ``sink`` as it goes.

    Raises OptplanError for bad input (a broken model file, a global batch the layouts cannot split) and
    Cancelled when ``cancelled()`` turns true: the profiling child or a running probe's processes are
    stopped within about a second (they are polled every ``probes.waiting.POLL_S``), the search within
    one candidate.
    """

    def check() -> None:
        if cancelled():
            raise SessionCancelled

    if profile is None:
        sink.progress(ProgressEvent(stage="profile", done=0, total=1,
                                    message="profiling the model in a child process"))
        profile = profile_for(prepared, cancelled=cancelled)
        check()
    sink.profiled(profile)
    batcher = TrialBatcher(sink.trials)

    def on_progress(event: ProgressEvent) -> None:
        check()
        batcher.flush()
        sink.progress(event)

    def on_trial(estimate: Estimate) -> None:
        check()
        batcher.add(estimate)

    rec = run_recommend(prepared, profile, on_progress=on_progress, on_trial=on_trial, gpu_here=gpu_here,
                        cancelled=cancelled)
    batcher.flush()
    # the goal the search ran (the model file's OPTPLAN["tokens"] may have given its budget): the screens rank with it
    prepared = prepared.model_copy(update={"goal": goal_for(prepared, profile)})
    return PlanResult(prepared=prepared, profile=profile, recommendation=rec)
