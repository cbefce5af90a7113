"""Faults and interruptions of the search: a SIGKILL at any point loses nothing and repeats nothing.

The search runs in a forked child (the parent has imported everything, so a run costs only the search)
and is killed at random points; a rerun with the same storage must find every trial the killed run
completed, record none twice, and pick what an uninterrupted run picks.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from optplan.planner import search as search_module
from optplan.planner.search import SearchResult, resolve_storage, search
from optplan.planner.space import SearchSpace, build_space

ARCH = "layers=12,hidden=768,heads=12,vocab=50257,seq=1024"
KILLS = 8
CHUNK = 8
"""Groups per recorded chunk in the killed runs (the default 512 would leave one chunk for this space)."""


@pytest.fixture(scope="module")
def setup() -> tuple:
    prof = profile_from_arch(parse_arch(ARCH))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=16, gpus_per_node=8)
    space = build_space(prof, cluster, global_batch=64)
    return prof, cluster, space


def _run_child(prof, cluster: Cluster, space: SearchSpace, store: str,  # noqa: ANN001
               chunk_times: str | None = None) -> int:
    """Fork a child that runs the search into ``store`` and exits; returns its pid. With ``chunk_times``
    the child appends the monotonic time (``time.perf_counter``, one clock for every process) at which
    each chunk was recorded."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            search_module.CHUNK_GROUPS = CHUNK

            def stamp(event) -> None:  # noqa: ANN001
                if chunk_times is not None and event.stage == "search":
                    with open(chunk_times, "a") as f:
                        f.write(f"{time.perf_counter()}\n")

            search(prof, cluster, space, storage=store, on_progress=stamp)
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code)
    return pid


def _completed(store: str) -> list[Strategy]:
    """The strategies of the completed trials in ``store``'s one study (none when nothing was written)."""
    storage = resolve_storage(store)
    summaries = optuna.get_all_study_summaries(storage)  # type: ignore[arg-type]
    if not summaries:
        return []
    assert len(summaries) == 1
    study = optuna.load_study(study_name=summaries[0].study_name, storage=storage)  # type: ignore[arg-type]
    return [Strategy.model_validate(t.user_attrs["strategy"])
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))]


def _top(result: SearchResult, k: int = 5) -> list[Strategy]:
    return [e.strategy for e in result.ranked[:k]]


def test_sigkill_at_random_points_loses_and_repeats_nothing(setup, tmp_path: Path) -> None:  # noqa: ANN001
    prof, cluster, space = setup
    reference = search(prof, cluster, space)
    times = tmp_path / "chunk_times.txt"
    started = time.perf_counter()
    pid = _run_child(prof, cluster, space, str(tmp_path / "timing.log"), str(times))
    assert os.waitpid(pid, 0)[1] == 0
    stamps = [float(x) - started for x in times.read_text().split()]
    assert len(stamps) >= 4, "the timing run recorded too few chunks to kill between"
    # kill between the first chunk's record and the last one's: each killed run stamps its own chunks, and the kill
    # comes a random part of a chunk's time after a random one of them was recorded, so it lands mid-search however
    # fast the machine runs this time (a kill anywhere else tests little: nothing or all recorded)
    gap_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    rng = random.Random(2026)
    landed = 0
    for i in range(KILLS):
        store = str(tmp_path / f"study{i}.log")
        own = tmp_path / f"chunk_times{i}.txt"
        pid = _run_child(prof, cluster, space, store, str(own))
        after_chunk = rng.randint(1, len(stamps) - 1)
        deadline = time.perf_counter() + 300
        while (len(own.read_text().split()) if own.exists() else 0) < after_chunk and time.perf_counter() < deadline:
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, gap_s / 2))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        before = _completed(store)
        landed += bool(before) and os.WIFSIGNALED(status)
        resumed = search(prof, cluster, space, storage=store)
        after = _completed(store)
        counts = Counter(after)
        assert not [s for s, n in counts.items() if n > 1], f"kill {i}: trials recorded twice"
        assert set(before) <= set(after), f"kill {i}: completed trials lost"
        assert _top(resumed) == _top(reference), f"kill {i}: a different plan after the kill"
        assert search(prof, cluster, space, storage=store).evaluated == 0  # finished: nothing left to price
    assert landed >= KILLS // 2, "too few kills landed mid-search to test anything"


def _nsga_worker(prof, cluster: Cluster, space: SearchSpace, store: str) -> int:  # noqa: ANN001
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            search(prof, cluster, space, method="nsga2", n_trials=25, storage=store, study_name="shared", seed=5)
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code)
    return pid


def test_four_processes_share_one_study(tmp_path: Path) -> None:
    """Four workers optimise one NSGA-II study in one journal file: every trial finishes exactly once under
    its own number, none is lost, and a rerun has nothing left and picks the best of what they priced."""
    prof = profile_from_arch(parse_arch("layers=24,hidden=2560,heads=20,vocab=50257,seq=1024"))  # 1.9 B
    cluster = Cluster(gpu=find_gpu("A100-40GB"), gpus=8, gpus_per_node=8)
    space = build_space(prof, cluster, global_batch=256, engines=["deepspeed"])
    store = str(tmp_path / "shared.log")
    pids = [_nsga_worker(prof, cluster, space, store) for _ in range(4)]
    assert all(os.waitpid(pid, 0)[1] == 0 for pid in pids)
    study = optuna.load_study(study_name="shared", storage=resolve_storage(store))  # type: ignore[arg-type]
    trials = study.get_trials(deepcopy=False)
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    assert all(t.state in finished for t in trials)  # none left RUNNING or lost
    assert sorted(t.number for t in trials) == list(range(len(trials)))
    assert 25 <= len(trials) <= 4 * 25
    after = search(prof, cluster, space, method="nsga2", n_trials=25, storage=store, study_name="shared", seed=5)
    assert after.evaluated == 0 and after.resumed > 0
    priced = {Strategy.model_validate(t.user_attrs["strategy"])
              for t in trials if t.state == optuna.trial.TrialState.COMPLETE}
    assert after.feasible and after.feasible[0].strategy in priced


def test_four_processes_enumerating_one_study_record_nothing_twice(setup, tmp_path: Path) -> None:  # noqa: ANN001
    """Four processes enumerate the same study at once: each prices the space, none records a trial another
    has recorded, every process's keepers are there, and the plan is an uninterrupted run's."""
    prof, cluster, space = setup
    reference = search(prof, cluster, space)
    store = str(tmp_path / "enum.log")
    pids = [_run_child(prof, cluster, space, store) for _ in range(4)]
    assert all(os.waitpid(pid, 0)[1] == 0 for pid in pids)
    recorded = _completed(store)
    assert recorded and len(recorded) == len(set(recorded))
    single = str(tmp_path / "single.log")
    search(prof, cluster, space, storage=single)
    assert set(_completed(single)) <= set(recorded)  # nothing lost
    again = search(prof, cluster, space, storage=store)
    assert again.evaluated == 0 and _top(again) == _top(reference)


def test_a_torn_last_record_is_dropped_before_the_study_is_used(setup, tmp_path: Path) -> None:  # noqa: ANN001
    """A run killed mid-append leaves a record without its newline; the next run cuts it off instead of
    burying it mid-file (after which every read of the journal fails)."""
    prof, cluster, space = setup
    store = tmp_path / "torn.log"
    search(prof, cluster, space, storage=str(store))
    whole = store.read_bytes()
    store.write_bytes(whole + b'{"op_code": 5, "worker_id": "x", "study_id": 0, "datetime_st')
    again = search(prof, cluster, space, storage=str(store))
    assert store.read_bytes().endswith(b"\n") and store.read_bytes().startswith(whole)
    assert again.evaluated == 0 and _top(again) == _top(search(prof, cluster, space))
    search(prof, cluster, space, storage=str(store))  # and the journal still reads
