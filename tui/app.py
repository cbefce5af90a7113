"""The Textual dashboard: ``optplan dashboard`` runs recommend's pipeline in a thread worker and shows it live.

Built only by :func:`create_app` (the CLI and the tests use the same factory). The planner is reached
through its public API (``tui.session`` -> ``tui.recommend_run`` -> ``optplan.planner``); this module
holds the run state the screens watch and nothing that decides anything.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal

from pydantic import BaseModel, ConfigDict
from textual.app import App
from textual.binding import Binding
from textual.reactive import var
from textual.worker import Worker, get_current_worker

from optplan.estimators.errors import Cancelled, OptplanError
from optplan.estimators.estimate import Estimate
from optplan.estimators.profile import ModelProfile
from optplan.planner.events import ProgressEvent
from optplan.probes.hardware import NvmlApi
from optplan.tui.messages import PlanFailed, Planned, Profiled, Progressed, TrialsPriced
from optplan.tui.recommend_args import RecommendArgs
from optplan.tui.recommend_run import PreparedRecommend, gpu_present, prepare_recommend
from optplan.tui.screens.export import ExportScreen
from optplan.tui.screens.hardware import HardwareScreen
from optplan.tui.screens.help import HelpScreen
from optplan.tui.screens.overview import OverviewScreen
from optplan.tui.screens.plan import PlanScreen
from optplan.tui.screens.search import SearchScreen
from optplan.tui.session import PlanResult, run_session

Phase = Literal["starting", "profiling", "searching", "probing", "done", "failed", "cancelled"]


class RunStatus(BaseModel):
    """Where the current planning run is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    phase: Phase = "starting"
    done: int = 0
    total: int = 0
    message: str = ""


class DashboardOutcome(BaseModel):
    """What the app hands back to the CLI when it exits: an error (a bad first run: exit 2) or nothing."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    error: str | None = None
    storage: str | None = None
    finished: bool = False


class _PostingSink:
    """A session Sink that posts each report to the app as a message (thread-safe)."""

    def __init__(self, app: DashboardApp, run_id: int) -> None:
        self._app = app
        self._run_id = run_id

    def profiled(self, profile: ModelProfile) -> None:
        self._app.post_message(Profiled(self._run_id, profile))

    def progress(self, event: ProgressEvent) -> None:
        self._app.post_message(Progressed(self._run_id, event))

    def trials(self, estimates: tuple[Estimate, ...]) -> None:
        self._app.post_message(TrialsPriced(self._run_id, estimates))


class DashboardApp(App[DashboardOutcome]):
    """Overview, Search, Plan, Export and Hardware screens over one planning run (re-run with ``r``)."""

    CSS_PATH = "app.tcss"
    TITLE = "optplan dashboard"
    MODES = {"overview": OverviewScreen, "search": SearchScreen, "plan": PlanScreen, "export": ExportScreen,
             "hardware": HardwareScreen}
    DEFAULT_MODE = "overview"
    BINDINGS = [
        Binding("1", "switch_mode('overview')", "Overview"),
        Binding("2", "switch_mode('search')", "Search"),
        Binding("3", "switch_mode('plan')", "Plan"),
        Binding("4", "switch_mode('export')", "Export"),
        Binding("5", "switch_mode('hardware')", "Hardware"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
        # Ctrl-C quits too (Textual's default only says how to quit); ahead of any focused input's copy
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
    ]

    status: var[RunStatus] = var(RunStatus())
    profile: var[ModelProfile | None] = var(None)
    trials: var[tuple[Estimate, ...]] = var((), always_update=True)
    result: var[PlanResult | None] = var(None)
    selected: var[Estimate | None] = var(None)
    error: var[str | None] = var(None)

    def __init__(self, prepared: PreparedRecommend, *, profile: ModelProfile | None = None,
                 nvml: NvmlApi | None = None, hardware_interval_s: float = 1.0,
                 gpu_here: Callable[[], bool] = gpu_present) -> None:
        super().__init__()
        self.prepared = prepared
        self.nvml = nvml
        self.hardware_interval_s = hardware_interval_s
        self._given_profile = profile
        self._gpu_here = gpu_here
        self._run_id = 0
        self._ever_planned = False
        self.crash: Exception | None = None
        """The exception that ended the app, when one did (the CLI reports it as one line: tui/cli.py)."""
        self.show_tracebacks = False
        """Textual's own traceback on a crash (``optplan --debug dashboard``); else only the CLI's line."""

    def _handle_exception(self, error: Exception) -> None:
        """Textual's handling of an unhandled exception (the app exits), keeping it for the CLI and leaving out
        the traceback Textual prints on exit unless ``show_tracebacks`` (the CLI's one line says it is a bug)."""
        if self.crash is None:
            self.crash = error
        super()._handle_exception(error)
        if not self.show_tracebacks:
            renderables = getattr(self, "_exit_renderables", None)
            if isinstance(renderables, list):
                renderables.clear()

    # --- the planning run --------------------------------------------------------------------------

    def on_mount(self) -> None:
        self.start_run(self.prepared, profile=self._given_profile)

    def start_run(self, prepared: PreparedRecommend, *, profile: ModelProfile | None = None) -> None:
        """(Re-)plan with ``prepared`` in a thread worker; a run still going is cancelled."""
        self._run_id += 1
        self.prepared = prepared
        self.error = None
        self.selected = None
        self.result = None
        self.trials = ()
        self.status = RunStatus(phase="profiling" if profile is None else "searching",
                                message="profiling the model in a child process" if profile is None else "")
        self.run_worker(partial(self._plan_in_thread, self._run_id, prepared, profile), thread=True,
                        exclusive=True, group="plan", name="plan", exit_on_error=False)

    def _plan_in_thread(self, run_id: int, prepared: PreparedRecommend, profile: ModelProfile | None) -> None:
        worker = get_current_worker()
        try:
            result = run_session(prepared, _PostingSink(self, run_id), profile=profile,
                                 cancelled=lambda: worker.is_cancelled, gpu_here=self._gpu_here)
        except Cancelled:  # quit or a newer re-plan: every child process is already stopped
            return
        except OptplanError as err:
            self.post_message(PlanFailed(run_id, str(err)))
            return
        self.post_message(Planned(run_id, result))

    def on_profiled(self, message: Profiled) -> None:
        if message.run_id == self._run_id:
            self.profile = message.profile
            self.status = RunStatus(phase="searching", message="building the search space")

    def on_progressed(self, message: Progressed) -> None:
        if message.run_id != self._run_id:
            return
        e = message.event
        phase: Phase = "probing" if e.stage == "probe" else "profiling" if e.stage == "profile" else "searching"
        self.status = RunStatus(phase=phase, done=e.done, total=e.total, message=e.message)

    def on_trials_priced(self, message: TrialsPriced) -> None:
        if message.run_id == self._run_id:
            self.trials = self.trials + message.estimates

    def on_planned(self, message: Planned) -> None:
        if message.run_id != self._run_id:
            return
        self._ever_planned = True
        self.profile = message.result.profile
        self.result = message.result
        rec = message.result.recommendation
        verdict = f"chose {rec.plan.label()}" if rec.plan is not None else "no plan fits"
        total = max(self.status.total, 1)
        self.status = RunStatus(phase="done", done=total, total=total,
                                message=f"{rec.search.evaluated + rec.search.resumed} candidates priced; {verdict}")

    def on_plan_failed(self, message: PlanFailed) -> None:
        if message.run_id != self._run_id:
            return
        if not self._ever_planned:
            # the first run failed on bad input (a broken model file, a batch no layout splits): like
            # recommend, one line on stderr and exit 2 (re-plans show the error here instead)
            self.exit(DashboardOutcome(error=message.error), return_code=2)
            return
        self.error = message.error
        self.status = RunStatus(phase="failed", message=message.error)
        self.notify(message.error, title="planning failed", severity="error", timeout=8)

    # --- what the screens ask for --------------------------------------------------------------------

    def select_trial(self, estimate: Estimate | None) -> None:
        """Show ``estimate`` on the Plan screen ("what if"); None goes back to the chosen plan."""
        self.selected = estimate

    def replan(self, args: RecommendArgs) -> None:
        """Check edited options (OptplanError: one line) and plan again; the profile is kept unless the
        model or its sequence length changed."""
        prepared = prepare_recommend(args, check_out=False)
        old = self.prepared.args
        same_model = (args.model, args.arch, args.params, args.seq_len, args.model_name) == (
            old.model, old.arch, old.params, old.seq_len, old.model_name)
        self.start_run(prepared, profile=self.profile if same_model else None)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        """Stop the search between two candidates (the study keeps what it recorded) and leave."""
        self.workers.cancel_group(self, "plan")
        stopped_search = self.status.phase in ("starting", "profiling", "searching", "probing")
        self.exit(DashboardOutcome(storage=self.prepared.storage, finished=not stopped_search))

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A worker that died of a bug (not bad input) is shown, not swallowed."""
        if event.worker.name == "plan" and event.worker.error is not None:
            self.error = f"{type(event.worker.error).__name__}: {event.worker.error}"
            self.status = RunStatus(phase="failed", message=self.error)


def create_app(args: RecommendArgs, *, prepared: PreparedRecommend | None = None,
               profile: ModelProfile | None = None, nvml: NvmlApi | None = None,
               hardware_interval_s: float = 1.0, gpu_here: Callable[[], bool] = gpu_present) -> DashboardApp:
    """The dashboard for ``args`` (recommend's options). ``prepared``: the options already checked (the CLI
    checks them before the app starts); ``profile``: skip profiling (tests); ``nvml``: the NVML adapter of
    the Hardware screen (tests pass ``FakeNvml``); ``gpu_here``: whether probes run by default."""
    ready = prepared if prepared is not None else prepare_recommend(args, check_out=False)
    return DashboardApp(ready, profile=profile, nvml=nvml, hardware_interval_s=hardware_interval_s,
                        gpu_here=gpu_here)
