"""Search the space with Optuna: enumerate small spaces, NSGA-II with memory constraints otherwise.

Every candidate is priced by the analytic estimators (microseconds each). Small spaces are enumerated
(a plain loop is orders of magnitude cheaper than Optuna's GridSampler, see stack-notes) and the
feasible Pareto front and top-k are recorded into an Optuna study as completed trials; larger spaces
run ``NSGAIISampler`` over the categorical axes with ``trial.set_constraint`` carrying the memory
excess (> 0 = infeasible). Both objectives are maximised: samples/s and memory headroom.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import optuna
from pydantic import BaseModel, ConfigDict

from optplan.estimators.estimate import Estimate, estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.planner.events import ProgressEvent
from optplan.planner.space import SearchSpace, enumerate_space, strategy_for

SearchMethod = Literal["auto", "enumerate", "nsga2"]
ENUMERATE_LIMIT = 20_000
MEMORY_CONSTRAINT_KEY = "memory_excess_gib"
RECORDED_TOP_K = 20


class SearchResult(BaseModel):
    """All evaluated candidates, ranked (feasible first, fastest first) and the study that holds them."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    ranked: tuple[Estimate, ...]
    method: Literal["enumerate", "nsga2"]
    space_size: int
    evaluated: int
    study: optuna.Study

    @property
    def feasible(self) -> tuple[Estimate, ...]:
        return tuple(e for e in self.ranked if e.fits)


def rank_key(e: Estimate) -> tuple[bool, float, int]:
    """Sort key: feasible first, then faster, then more headroom (descending when negated)."""
    return (not e.fits, -e.samples_per_s, -e.memory.headroom_bytes)


def pareto_front(estimates: tuple[Estimate, ...] | list[Estimate]) -> list[Estimate]:
    """Feasible estimates not dominated in (samples/s, headroom bytes), fastest first."""
    feasible = sorted((e for e in estimates if e.fits), key=rank_key)
    front: list[Estimate] = []
    best_headroom = None
    for e in feasible:  # sorted by speed descending: keep those with strictly more headroom
        if best_headroom is None or e.memory.headroom_bytes > best_headroom:
            front.append(e)
            best_headroom = e.memory.headroom_bytes
    return front


def _distributions(space: SearchSpace) -> dict[str, optuna.distributions.BaseDistribution]:
    cat = optuna.distributions.CategoricalDistribution
    return {
        "precision": cat(list(space.precisions)),
        "zero": cat(list(space.zero_stages)),
        "mbs": cat(list(space.micro_batches)),
        "checkpointing": cat(list(space.checkpointing)),
    }


def _params(s: Strategy) -> dict[str, object]:
    return {"precision": s.precision, "zero": s.zero, "mbs": s.mbs, "checkpointing": s.checkpointing}


def _values(e: Estimate) -> list[float]:
    return [e.samples_per_s, e.memory.headroom_bytes / 2**30]


def _constraint(e: Estimate) -> float:
    return -e.memory.headroom_bytes / 2**30


def _new_study(seed: int, storage: str | None, study_name: str | None,
               sampler: optuna.samplers.BaseSampler | None) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(
        directions=["maximize", "maximize"], storage=storage, study_name=study_name,
        sampler=sampler or optuna.samplers.NSGAIISampler(seed=seed), load_if_exists=True,
    )


def search(profile: ModelProfile, cluster: Cluster, space: SearchSpace, *, method: SearchMethod = "auto",
           n_trials: int | None = None, seed: int = 0, storage: str | None = None,
           study_name: str | None = None,
           on_progress: Callable[[ProgressEvent], None] | None = None) -> SearchResult:
    """Price the space and rank it. Deterministic for the same inputs and seed."""
    notify = on_progress or (lambda _e: None)
    chosen: Literal["enumerate", "nsga2"] = (
        "enumerate" if method == "enumerate" or (method == "auto" and space.size <= ENUMERATE_LIMIT)
        else "nsga2")
    priced: dict[Strategy, Estimate] = {}
    if chosen == "enumerate":
        study = _new_study(seed, storage, study_name, None)
        for i, strategy in enumerate(enumerate_space(space), start=1):
            priced[strategy] = estimate(profile, cluster, strategy)
            if i % 64 == 0 or i == space.size:
                notify(ProgressEvent(stage="search", done=i, total=space.size, message=strategy.label()))
        ranked = tuple(sorted(priced.values(), key=rank_key))
        keep = {e.strategy: e for e in (*pareto_front(ranked), *ranked[:RECORDED_TOP_K])}
        dists = _distributions(space)
        study.add_trials([
            optuna.trial.create_trial(params=_params(e.strategy), distributions=dists, values=_values(e),
                                      constraints={MEMORY_CONSTRAINT_KEY: _constraint(e)},
                                      user_attrs={"label": e.strategy.label()})
            for e in keep.values()
        ])
    else:
        trials = n_trials or min(space.size, 2000)
        study = _new_study(seed, storage, study_name, optuna.samplers.NSGAIISampler(seed=seed))

        def objective(trial: optuna.Trial) -> list[float]:
            strategy = strategy_for(
                space, precision=trial.suggest_categorical("precision", list(space.precisions)),
                zero=trial.suggest_categorical("zero", list(space.zero_stages)),
                mbs=trial.suggest_categorical("mbs", list(space.micro_batches)),
                checkpointing=trial.suggest_categorical("checkpointing", list(space.checkpointing)))
            est = priced.get(strategy) or estimate(profile, cluster, strategy)
            priced[strategy] = est
            trial.set_constraint(MEMORY_CONSTRAINT_KEY, _constraint(est))
            trial.set_user_attr("label", strategy.label())
            notify(ProgressEvent(stage="search", done=trial.number + 1, total=trials, message=strategy.label()))
            return _values(est)

        study.optimize(objective, n_trials=trials)
        ranked = tuple(sorted(priced.values(), key=rank_key))
    return SearchResult(ranked=ranked, method=chosen, space_size=space.size, evaluated=len(priced), study=study)
