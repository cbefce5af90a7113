"""The dashboard's plain-Python parts: the on_trial feed, batching, cancelling (study resumable), what-if,
live NVML sampling, and that the core packages never import textual."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from dashboard_helpers import tiny_args

from optplan.estimators.estimate import Estimate
from optplan.planner.api import resolve_cluster, resolve_model, sample_hardware
from optplan.planner.events import ProgressEvent
from optplan.planner.recommend import recommend
from optplan.planner.whatif import what_if
from optplan.probes.hardware_fake import FakeDevice, FakeNvml, nvml_error
from optplan.tui.recommend_run import prepare_recommend
from optplan.tui.session import SessionCancelled, TrialBatcher, run_session


class Recorder:
    """A session Sink that keeps what it is told."""

    def __init__(self) -> None:
        self.profiles: list[object] = []
        self.events: list[ProgressEvent] = []
        self.batches: list[tuple[Estimate, ...]] = []

    def profiled(self, profile: object) -> None:
        self.profiles.append(profile)

    def progress(self, event: ProgressEvent) -> None:
        self.events.append(event)

    def trials(self, estimates: tuple[Estimate, ...]) -> None:
        self.batches.append(estimates)


def test_on_trial_sees_every_priced_candidate_and_changes_nothing() -> None:
    prof = resolve_model(None, arch="layers=2,hidden=64,heads=4,vocab=1000,seq=128")
    cluster, _ = resolve_cluster(gpu="H100-SXM", gpus=8, gpus_per_node=None)
    seen: list[Estimate] = []
    with_feed = recommend(prof, cluster, global_batch=64, engines=("deepspeed", "torch"), on_trial=seen.append)
    without = recommend(prof, cluster, global_batch=64, engines=("deepspeed", "torch"))
    assert len(seen) == with_feed.search.evaluated == without.search.evaluated > 100
    assert len({e.strategy for e in seen}) == len(seen)
    assert with_feed.plan == without.plan and with_feed.rationale == without.rationale
    assert with_feed.plan in {e.strategy for e in seen}


def test_trial_batcher_batches_by_time_and_flushes_the_rest() -> None:
    now = [0.0]
    got: list[tuple[int, ...]] = []
    batcher = TrialBatcher(lambda b: got.append(tuple(b)), interval_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type]
    for i in range(5):
        batcher.add(i)  # type: ignore[arg-type]
    assert got == []
    now[0] = 1.5
    batcher.add(5)  # type: ignore[arg-type]
    batcher.add(6)  # type: ignore[arg-type]
    batcher.flush()
    assert got == [(0, 1, 2, 3, 4, 5), (6,)]


def test_run_session_reports_profile_progress_and_all_trials() -> None:
    sink = Recorder()
    result = run_session(prepare_recommend(tiny_args()), sink, gpu_here=lambda: False)
    rec = result.recommendation
    assert rec.fits and len(sink.profiles) == 1
    assert sink.events and sink.events[-1].done == sink.events[-1].total
    assert sum(len(b) for b in sink.batches) == rec.search.evaluated


def test_cancelled_session_stops_between_trials_and_the_study_resumes(tmp_path: Path) -> None:
    """What ``q`` does to a running search: stop at the next candidate; the rerun finishes the study."""
    storage = tmp_path / "study.log"
    args = tiny_args(storage=str(storage), method="nsga2", trials=60)
    sink = Recorder()
    with pytest.raises(SessionCancelled):
        run_session(prepare_recommend(args), sink, cancelled=lambda: len(sink.events) >= 5, gpu_here=lambda: False)
    journal = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(storage)))
    (name,) = optuna.study.get_all_study_names(storage=journal)
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    stopped = len(optuna.load_study(study_name=name, storage=journal).get_trials(states=done))
    # the fifth candidate's progress event raised the cancellation, so that trial failed: four or more finished
    # (illegal draws are repaired to legal plans, not pruned: every finished trial priced a plan)
    assert 4 <= stopped < 60
    again = run_session(prepare_recommend(args), Recorder(), gpu_here=lambda: False).recommendation
    assert again.search.study_name == name and again.search.resumed > 0 and again.fits
    assert len(optuna.load_study(study_name=name, storage=journal).get_trials(states=done)) == 60


def test_what_if_compares_a_trial_with_the_pick() -> None:
    sink = Recorder()
    prepared = prepare_recommend(tiny_args(tokens=1e9, price=2.0))
    rec = run_session(prepared, sink, gpu_here=lambda: False).recommendation
    trials = [e for b in sink.batches for e in b]
    pick = rec.estimate
    assert isinstance(pick, Estimate)
    other = next(e for e in trials if e.fits and e.strategy != pick.strategy)
    w = what_if(other, pick, goal=prepared.goal, cluster=prepared.cluster)
    assert w.estimate.cost is not None and w.estimate.cost.cost_usd is not None
    assert other.strategy.label() in w.lines[0] and pick.strategy.label() in w.lines[0]
    assert any(line.startswith("throughput") for line in w.lines)
    same = what_if(pick, pick, goal=prepared.goal, cluster=prepared.cluster)
    assert same.lines[0] == "this is the chosen plan"


def test_sample_hardware_reads_the_fake_gpus_and_survives_failures() -> None:
    nvml = FakeNvml([FakeDevice(name="NVIDIA A100-SXM4-80GB", memory_total=80 * 2**30, memory_used=2**30,
                                utilization_gpu=55, temperature_c=64, power_watts=300.0)],
                    errors={"power_usage_watts:0": nvml_error("NVML_ERROR_NOT_SUPPORTED")})
    report = sample_hardware(nvml)
    assert report.available and report.driver_version == "550.54.15"
    (s,) = report.samples
    assert (s.name, s.utilization_percent, s.temperature_c, s.power_watts) == ("NVIDIA A100-SXM4-80GB", 55, 64, None)
    assert nvml.shutdown_calls == 1
    missing = sample_hardware(FakeNvml.library_missing())
    assert not missing.available and "NVML Shared Library Not Found" in missing.reason


@pytest.mark.parametrize("modules", [
    "optplan.estimators.estimate, optplan.estimators.memory",
    "optplan.probes.hardware, optplan.probes.hardware_fake, optplan.probes.loader, optplan.probes.static",
    "optplan.planner.api, optplan.planner.recommend, optplan.planner.search, optplan.planner.whatif, "
    "optplan.planner.export.registry",
    "optplan.tui.cli, optplan.tui.recommend_args, optplan.tui.recommend_run, optplan.tui.session",
])
def test_core_packages_never_import_textual(modules: str) -> None:
    code = (f"import sys, {modules}; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'textual', 'textual_plotext', 'plotext'}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"
