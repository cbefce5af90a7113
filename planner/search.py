"""Search the space with Optuna: pruned enumeration when it is small enough, NSGA-II or TPE otherwise.

Every candidate is priced by the analytic estimators (well under a millisecond each).

- ``enumerate``: a plain loop over the space's groups (a plain loop is ~100x cheaper than Optuna's
  GridSampler, stack-notes), pricing each group's micro-batches in ascending order and stopping at the
  first that does not fit (per-GPU memory grows with the micro-batch). Each chunk of groups records its
  Pareto front and best candidates into the Optuna study as completed trials, with the study's
  ``groups_done`` mark, so a killed search resumes where it stopped and a finished one is not repeated.
- ``screen``: spaces above :data:`ENUMERATE_LIMIT` points with more layouts than the screen keeps (MoE spaces
  from a few tens of GPUs: DeepSeek-V2-Lite on 32 H100s has 191k points in 459 layouts; pipeline-parallel MoE
  layouts on thousands of GPUs: DeepSeek-V3 on 2,048 H100s has 733k in 2,517). A two-stage enumeration: every layout is first priced through
  one probe group (the most sharded setting of each engine that runs it, the first precision and optimizer,
  selective recomputation, or full where nothing else fits, and with the most offload where nothing fits
  without: its micro-batches ascending as above), the layouts are ranked by their best probe (by how near they
  come to fitting when no probe fits), and the :func:`screen_keep` best are then enumerated over every group. What
  was screened out is counted in the result; a layout that would win only under a setting its probe did not
  try can be missed (the coarse-to-fine pruning of, e.g., Galvatron and Alpa's stage pruning).
- ``nsga2`` / ``tpe``: Optuna's samplers over the same axes (layout, sharding, precision, optimizer,
  checkpointing, micro-batch, accumulation); ``trial.set_constraint`` carries the memory excess in GiB
  (> 0 = infeasible). The axes are drawn independently, so a draw is often no legal point (a sharding the
  layout's engine lacks, a micro-batch that does not divide its batch): it is repaired to the nearest legal one
  (the drawn layout's group agreeing with most other draws, the nearest micro-batch), the usual repair operator
  of constrained evolutionary search, instead of being pruned (pruned trials spend the trial budget: 16 legal
  plans of 3,000 trials on DeepSeek-V3 at 2,048 GPUs before). A study in shared storage can be optimised by
  several processes at once (Optuna's own mechanism) and resumes to the requested trial count. A fitting draw
  with full checkpointing also prices its partial-checkpointing plans (planner/partial.py), as the enumeration
  does; the trial records and returns the best of them, so the sampler learns where checkpointing fewer blocks
  wins, and every plan priced is ranked.

Objectives and ranking (``Goal``, ``rank``, ``pareto_front``) are planner/goal.py's: ``throughput`` maximises
samples/s and memory headroom; ``time`` and ``cost`` minimise the time to train the token budget and its cost,
every figure at the slow end of the time band. The search is deterministic for the same inputs and seed.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import optuna
from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.calibration import Calibration
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import Estimate, estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.profile import RUN_FIELDS, ModelProfile
from optplan.estimators.strategy import FSDP_STAGE, Strategy
from optplan.planner.events import ProgressEvent
from optplan.planner.goal import Goal, pareto_front, rank
from optplan.planner.partial import can_be_partial, fewest_checkpointed, fits_robustly
from optplan.planner.space import Group, Layout, SearchSpace, Sharding, strategy_of

SearchMethod = Literal["auto", "enumerate", "screen", "nsga2", "tpe"]
ENUMERATE_LIMIT = 20_000
"""Spaces up to this many points are enumerated; larger ones are screened (``auto``) when they have more layouts
than the screen keeps (:func:`auto_method`). Measured (benchmarks/bench_screen_agreement.py, 2026-11-29, 16
dense and MoE spaces of 7k-733k points on 8-2,048 GPUs, the three objectives): the screen's pick was the full
enumeration's in 16 of 16 (DeepSeek-V2-Lite on 32 H100: 191k points, 83 s enumerated, 11.5 s screened; see
:data:`SCREEN_KEEP_LAYOUTS`). Re-measured 2026-11-30 with a 17th space, Mixtral 8x7B on 8 H100s, which fits only
with CPU offload (the screen's probes then tried offload too; before, it kept 32 layouts by the speed of plans that
did not fit and answered "no plan fits"): the same pick in 16 of 17, and Mixtral on 32 H100s picked another plan at
99.0 % of the enumerated pick's robust figure (a tie under the ranking's 5 % tolerance; so before the change too).
Optuna's
samplers draw the axes independently, and on spaces this large most draws are illegal combinations (pruned trials
count against the trial budget: 16 legal plans of 3,000 trials on DeepSeek-V3 at 2,048 GPUs), so they are used
only when asked."""
SCREEN_KEEP_LAYOUTS = 32
"""The screen enumerates at least this many layouts in full (:func:`screen_keep`). Measured
(benchmarks/bench_screen_agreement.py, 2026-11-29): keeping 32 found the full enumeration's pick in 15 of 15 spaces
(dense and MoE, 8-4,096 GPUs, the three objectives, memory-tight ones whose picks offload or recompute included),
as keeping 96 did; on the spaces ``auto`` screens, at 2.5-11x less wall time than enumerating (96: 1.4-5.9x)."""
SCREEN_KEEP_SHARE = 0.04
DEFAULT_TRIALS = 3000
MEMORY_CONSTRAINT_KEY = "memory_excess_gib"
RECORDED_TOP_K = 12
CHUNK_GROUPS = 512
STUDY_FORMAT = 3
"""Part of every study's name: bump it when what a study stores changes meaning. 3: the objective values
are taken at the slow end of the time band (2: nominal). An older study then has another name, so a rerun
starts a new study beside it instead of resuming values of another meaning."""
class SearchResult(BaseModel):
    """The priced candidates, ranked by the goal (feasible first), and the study that holds them."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    ranked: tuple[Estimate, ...]
    method: Literal["enumerate", "screen", "nsga2", "tpe"]
    space_size: int
    evaluated: int
    resumed: int = Field(default=0, description="candidates taken from an earlier run in the same study")
    layouts_screened_out: int = Field(default=0, description="layouts the screen priced only through their probe")
    study: optuna.Study
    goal: Goal

    @property
    def feasible(self) -> tuple[Estimate, ...]:
        return tuple(e for e in self.ranked if e.fits)


# --- the study --------------------------------------------------------------------------------------

def _layout_key(group: Group) -> str:
    lay = group.layout
    return (f"g{lay.gpus}-dp{lay.dp}-tp{lay.tp}-pp{lay.pp}-v{lay.vpp}-cp{lay.cp}" + (f"-ep{lay.ep}" if lay.ep > 1 else "")
            + (f"-etp{lay.etp}" if lay.etp is not None else "") + (f"-{lay.dispatcher}" if lay.dispatcher != "alltoall" else "") + ("-ov" if lay.ep_overlap else ""))


def _distributions(space: SearchSpace) -> dict[str, optuna.distributions.BaseDistribution]:
    cat = optuna.distributions.CategoricalDistribution
    layouts = sorted({_layout_key(Group(lay, space.shardings[0], "", "", "none")) for lay in space.layouts})
    mbs = sorted({b for lay in space.layouts for b in space.micro_batches(lay)}) or [1]
    return {
        "layout": cat(layouts),
        "sharding": cat([s.label() for s in space.shardings]),
        "precision": cat(list(space.precisions)),
        "optimizer": cat(list(space.optimizers)),
        "checkpointing": cat(list(space.checkpointing)),
        "mbs": cat(mbs),
        "accum": cat([0, 1, 2]),
    }


def _params(group: Group, mbs: int, accum_index: int) -> dict[str, object]:
    return {"layout": _layout_key(group), "sharding": group.sharding.label(), "precision": group.precision,
            "optimizer": group.optimizer, "checkpointing": group.checkpointing, "mbs": mbs, "accum": accum_index}


def resolve_storage(storage: str | Path | None) -> optuna.storages.BaseStorage | str | None:
    """``--storage``: an RDB URL (``sqlite:///x.db``, ``postgresql://...``), a ``.db`` file (SQLite) or any
    other path (an Optuna journal file, safe for several processes on one machine or a shared filesystem)."""
    if storage is None:
        return None
    text = str(storage)
    if "://" in text:
        return text
    path = Path(text)
    if path.is_dir():
        raise OptplanError(f"--storage {text} is a folder: give a file (study.log or study.db) or a database URL")
    if not path.parent.exists():
        raise OptplanError(f"--storage {text}: folder {path.parent} does not exist; create it or choose another path")
    check_storage_file(path)
    if path.suffix in (".db", ".sqlite", ".sqlite3"):
        return f"sqlite:///{path.resolve()}"
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from optplan.planner.journal_lock import drop_torn_tail, journal_lock
    drop_torn_tail(str(path))  # a run killed mid-append
    return JournalStorage(JournalFileBackend(str(path), lock_obj=journal_lock(str(path))))


def check_storage_file(path: Path) -> None:
    """An existing ``--storage`` file that is plainly not a study (garbage, another program's file) is an
    OptplanError before anything runs or is written: a ``.db`` must be SQLite, a journal's first complete
    line a JSON object (an incomplete first line is left to Optuna, which repairs a torn write)."""
    if path.is_dir():
        raise OptplanError(f"--storage {path} is a folder: give a file in it, e.g. {path / 'study.log'}")
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        with path.open("rb") as f:
            head = f.read(1 << 16)
    except OSError as exc:
        raise OptplanError(f"cannot read --storage {path} ({exc.strerror or exc}): choose another --storage") from None
    fix = "choose another --storage or delete the file"
    if path.suffix in (".db", ".sqlite", ".sqlite3"):
        if not head.startswith(b"SQLite format 3\x00"):
            raise OptplanError(f"--storage {path} is not an SQLite database (corrupted or another program's "
                               f"file?): {fix}")
        return
    first, newline, _rest = head.lstrip().partition(b"\n")
    if not newline:
        return
    try:
        ok = isinstance(json.loads(first), dict)
    except ValueError:
        ok = False
    if not ok:
        raise OptplanError(f"--storage {path} is not an optplan study journal (corrupted or another program's "
                           f"file?): {fix}")


def study_name_for(profile: ModelProfile, cluster: Cluster, space: SearchSpace, goal: Goal, method: str,
                   seed: int, calibration: Calibration | None = None) -> str:
    """A name that is the same exactly when the inputs are: rerunning resumes the same study."""
    doc: dict[str, object] = {"v": STUDY_FORMAT, "profile": profile.model_dump(mode="json", exclude=set(RUN_FIELDS)),
           "cluster": cluster.model_dump(mode="json"), "space": space.model_dump(mode="json"),
           "goal": goal.model_dump(mode="json"), "method": method, "seed": seed}
    if calibration is not None:
        doc["calibration"] = calibration.model_dump(mode="json")
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"optplan-{profile.name}-{digest}"


def _open_study(storage: str | Path | None, name: str, goal: Goal,
                sampler: optuna.samplers.BaseSampler) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.create_study(directions=goal.directions, storage=resolve_storage(storage),  # type: ignore[arg-type]
                                   study_name=name, sampler=sampler, load_if_exists=True)
    except OSError as exc:  # the file cannot be created or opened (a read-only or pseudo file system, permissions)
        raise OptplanError(f"cannot open the study storage {storage} ({exc.strerror or _first_line(exc)}): "
                           "choose a writable folder for --out (or a writable --storage)") from exc
    except ValueError as exc:  # wrong URL, a journal of garbage
        raise OptplanError(f"cannot open the study storage {storage} ({_first_line(exc)}): it is not an optplan "
                           "study (corrupted or another program's file?); choose another --storage or delete "
                           "the file") from exc
    except Exception as exc:  # sqlalchemy errors: not importable here without sqlalchemy
        raise OptplanError(f"cannot open the study storage {storage} ({type(exc).__name__}: {_first_line(exc)}): "
                           "it is not an optplan study database (corrupted or another program's file?); "
                           "choose another --storage or delete the file") from exc


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (sqlalchemy appends the SQL and a link on more lines)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:240] if lines else type(exc).__name__


def _record(study: optuna.Study, dists: dict[str, optuna.distributions.BaseDistribution],
            entries: list[tuple[Estimate, dict[str, object]]], goal: Goal) -> None:
    study.add_trials([
        optuna.trial.create_trial(
            params=params, distributions=dists, values=goal.values(e),
            constraints={MEMORY_CONSTRAINT_KEY: -e.memory.headroom_bytes / 2**30},
            user_attrs={"label": e.strategy.label(), "strategy": e.strategy.model_dump(mode="json")})
        for e, params in entries
    ])


def _recorded(study: optuna.Study) -> list[Strategy]:
    out = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        doc = t.user_attrs.get("strategy")
        if isinstance(doc, dict):
            try:
                out.append(Strategy.model_validate(doc))
            except ValueError:
                continue
    return out


class Pricer:
    """Estimates with a cache, one Cluster per GPU count."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, calibration: Calibration | None = None, *,
                 on_priced: Callable[[Estimate], None] | None = None) -> None:
        self.profile = profile
        self.cluster = cluster
        self.calibration = calibration
        self.on_priced = on_priced
        self._clusters: dict[int, Cluster] = {}
        self.priced: dict[Strategy, Estimate] = {}

    def cluster_for(self, gpus: int) -> Cluster:
        if gpus not in self._clusters:
            self._clusters[gpus] = self.cluster if gpus == self.cluster.gpus else \
                self.cluster.model_copy(update={"gpus": gpus})
        return self._clusters[gpus]

    def __call__(self, strategy: Strategy) -> Estimate | None:
        if strategy in self.priced:
            return self.priced[strategy]
        try:
            est = estimate(self.profile, self.cluster_for(strategy.world_size), strategy,
                           calibration=self.calibration)
        except OptplanError:
            return None
        self.priced[strategy] = est
        if self.on_priced is not None:
            self.on_priced(est)
        return est


def _keep(entries: list[tuple[Estimate, dict[str, object]]], goal: Goal) -> list[tuple[Estimate, dict[str, object]]]:
    """The entries worth recording: the Pareto front, the best few, and the best infeasible few."""
    by_strategy = {e.strategy: (e, p) for e, p in entries}
    ests = [e for e, _ in entries]
    ranked = rank(ests, goal)
    keep = [*pareto_front(ests, goal), *ranked[:RECORDED_TOP_K],
            *[e for e in ranked if not e.fits][:RECORDED_TOP_K]]
    return list({e.strategy: by_strategy[e.strategy] for e in keep}.values())


def _block_count(profile: ModelProfile) -> int | None:
    """The repeated blocks partial checkpointing counts (None: the model has none)."""
    return profile.repeated_block.count if profile.repeated_block is not None else None


def _group_estimates(pricer: Pricer, space: SearchSpace, group: Group) -> Iterator[tuple[Estimate, int, int, bool]]:
    """``group``'s candidates priced in ascending micro-batch order, stopping after the first micro-batch none of
    whose accumulations fits (memory grows with the micro-batch: larger ones do not fit either): (estimate,
    micro-batch, accumulation index, whether it was newly priced). A fitting candidate with full checkpointing is
    followed by its partial-checkpointing one (the fewest first blocks checkpointed that still fits,
    planner/partial.py), under the same micro-batch and accumulation index."""
    blocks = _block_count(pricer.profile)
    for mbs in space.micro_batches(group.layout):
        any_fits = False
        for k, gas in enumerate(space.accumulations(group.layout, mbs)):
            s = strategy_of(group, mbs, gas)
            if s is None:
                continue
            new = s not in pricer.priced
            est = pricer(s)
            if est is None:
                continue
            any_fits = any_fits or est.fits
            yield est, mbs, k, new
            if space.partial_checkpointing and est.fits and can_be_partial(s, blocks):
                yield from _partial_estimates(pricer, s, blocks or 0, mbs, k, "none" in space.checkpointing)
        if not any_fits:
            return


def _partial_estimates(pricer: Pricer, strategy: Strategy, blocks: int, mbs: int, k: int,
                       none_searched: bool) -> Iterator[tuple[Estimate, int, int, bool]]:
    """The partial-checkpointing candidates of a fitting full-checkpointing ``strategy`` (planner/partial.py): the
    fewest first blocks checkpointed that fit at the median of the allocator margins, and at their 90th percentile;
    none of a class where the same plan without checkpointing, when the space searches it, already fits in it (it is
    faster still). The pricer's estimates are the candidates, so a mode the space leaves out is never priced."""
    plain = pricer(strategy.model_copy(update={"checkpointing": "none"})) if none_searched else None
    start = 1  # the robust class needs at least the blocks the median one does
    for ok in (lambda e: e.fits, fits_robustly):
        if plain is not None and ok(plain):
            continue
        before = len(pricer.priced)
        partial = fewest_checkpointed(pricer, strategy, blocks, ok, at_least=start)
        if partial is not None:
            start = partial.strategy.checkpoint_layers or start
            yield partial, mbs, k, len(pricer.priced) > before


def _enumerate(pricer: Pricer, space: SearchSpace, study: optuna.Study, goal: Goal,
               notify: Callable[[ProgressEvent], None], storage: str | Path | None = None) -> tuple[int, int]:
    """Price the space group by group, recording each chunk's keepers and then its done-mark. Recording
    holds a lock on the storage file and first re-reads what is recorded: a chunk recorded by a run that
    was killed before its done-mark, or by another process enumerating the same study, is never recorded
    twice."""
    from optplan.planner.journal_lock import storage_file_lock

    dists = _distributions(space)
    groups = list(space.groups())
    done = int(study.user_attrs.get("groups_done", 0))
    resumed = 0
    if done:
        for s in _recorded(study):
            if pricer(s) is not None:
                resumed += 1
    base = len(pricer.priced)  # every plan priced from here on counts, the partial search's probes too
    evaluated = 0
    chunk: list[tuple[Estimate, dict[str, object]]] = []
    for gi in range(done, len(groups)):
        group = groups[gi]
        for est, mbs, k, _new in _group_estimates(pricer, space, group):
            chunk.append((est, _params(group, mbs, k)))
        evaluated = len(pricer.priced) - base
        if (gi + 1) % CHUNK_GROUPS == 0 or gi + 1 == len(groups):
            with storage_file_lock(storage, "record"):
                recorded = set(_recorded(study))
                _record(study, dists, [(e, p) for e, p in _keep(chunk, goal) if e.strategy not in recorded], goal)
                study.set_user_attr("groups_done", max(gi + 1, int(study.user_attrs.get("groups_done", 0))))
            chunk = []
            notify(ProgressEvent(stage="search", done=gi + 1, total=len(groups),
                                 message=f"{evaluated} candidates priced"))
    return evaluated, resumed


def auto_method(space: SearchSpace, size: int | None = None) -> Literal["enumerate", "screen"]:
    """What ``auto`` runs on ``space`` (``size``: its point count, when already counted): the full enumeration up to
    :data:`ENUMERATE_LIMIT` points, and wherever the screen would keep every layout anyway (it would price each
    layout's probe and then enumerate them all); else the screen."""
    points = space.size if size is None else size
    layouts = len(space.layouts)
    return "enumerate" if points <= ENUMERATE_LIMIT or layouts <= screen_keep(layouts) else "screen"


def screen_keep(layouts: int) -> int:
    """How many layouts the screen enumerates in full: :data:`SCREEN_KEEP_LAYOUTS`, or
    :data:`SCREEN_KEEP_SHARE` of them when that is more (DeepSeek-V3 on 2,048 H100s keeps 100 of 2,517 layouts and
    its pick is the full enumeration's)."""
    return max(SCREEN_KEEP_LAYOUTS, int(SCREEN_KEEP_SHARE * layouts))


def _probe_groups(space: SearchSpace, layout: Layout) -> list[list[Group]]:
    """The screen's probe of ``layout``: per engine that runs it, its most sharded setting without offload, the
    first precision and optimizer, and the recomputation modes to try in order (selective, then full); then, for
    when none of those fits, the same modes with its most sharded setting that offloads the most (parameters and
    optimizer states, to the CPU before NVMe), so that a layout that fits only with offload is ranked as fitting."""
    plain: dict[str, Sharding] = {}
    offloaded: dict[str, Sharding] = {}
    for sh in space.shardings_for(layout):
        stage = (sh.zero, FSDP_STAGE[sh.fsdp])
        if sh.offload_optimizer == "none" and sh.offload_params == "none":
            best = plain.get(sh.engine)
            if best is None or stage > (best.zero, FSDP_STAGE[best.fsdp]):
                plain[sh.engine] = sh
        else:
            best = offloaded.get(sh.engine)
            if best is None or _offload_order(sh) > _offload_order(best):
                offloaded[sh.engine] = sh
    modes = [m for m in ("selective", "full", "none") if m in space.checkpointing]
    out = []
    for engine in dict.fromkeys((*plain, *offloaded)):
        tries = []
        for sh in (plain.get(engine), offloaded.get(engine)):
            precisions = space.precisions_for(sh) if sh is not None else []
            if sh is not None and precisions:
                tries.extend(Group(layout, sh, precisions[0], space.optimizer, m, space.quant,  # type: ignore[arg-type]
                                   space.compile_blocks, space.fsdp_reduce_dtype) for m in modes)
        if tries:
            out.append(tries)
    return out


def _offload_order(sh: Sharding) -> tuple[int, ...]:
    """How much an offloading setting relieves the GPU, for the screen's probe: the sharding stage, then
    parameters offloaded, then optimizer states, then the CPU before NVMe (the faster of two that fit alike)."""
    return (sh.zero, FSDP_STAGE[sh.fsdp], sh.offload_params != "none", sh.offload_optimizer != "none",
            -(sh.offload_params == "nvme") - (sh.offload_optimizer == "nvme"))


def _screen(pricer: Pricer, space: SearchSpace, goal: Goal,
            notify: Callable[[ProgressEvent], None]) -> tuple[Layout, ...]:
    """The layouts worth enumerating in full: each priced through its probe, ranked by its best probe
    (``goal.rank_key``), the :func:`screen_keep` best kept in the space's order."""
    best: dict[Layout, tuple[object, ...]] = {}
    for i, layout in enumerate(space.layouts):
        for tries in _probe_groups(space, layout):
            for group in tries:
                found = False
                for est, _mbs, _k, _new in _group_estimates(pricer, space, group):
                    # a layout none of whose probes fits ranks by how near it comes (its speed says nothing then)
                    key = (*goal.rank_key(est), est.strategy.label()) if est.fits else \
                        (*goal.class_key(est), -float(est.memory.headroom_bytes), est.strategy.label())
                    if layout not in best or key < best[layout]:
                        best[layout] = key
                    found = found or est.fits
                if found:
                    break  # the lighter recomputation fits: the heavier would not rank above it
        if (i + 1) % CHUNK_GROUPS == 0:
            notify(ProgressEvent(stage="search", done=i + 1, total=len(space.layouts),
                                 message=f"screening layouts ({i + 1} of {len(space.layouts)})"))
    ranked = sorted(best, key=lambda lay: best[lay])[:screen_keep(len(space.layouts))]
    keep = set(ranked)
    return tuple(lay for lay in space.layouts if lay in keep)


def _optimize(pricer: Pricer, space: SearchSpace, study: optuna.Study, goal: Goal, n_trials: int,
              notify: Callable[[ProgressEvent], None]) -> tuple[int, int]:
    dists = _distributions(space)
    groups_by_key: dict[tuple[str, str, str, str, str], Group] = {
        (_layout_key(g), g.sharding.label(), g.precision, g.optimizer, g.checkpointing): g for g in space.groups()}
    resumed = 0
    for s in _recorded(study):
        if pricer(s) is not None:
            resumed += 1
    finished = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,
                                                            optuna.trial.TrialState.PRUNED)))
    remaining = max(0, n_trials - finished)
    before = len(pricer.priced)

    blocks = _block_count(pricer.profile)
    by_layout: dict[str, list[tuple[tuple[str, str, str, str, str], Group]]] = defaultdict(list)
    for key, g in groups_by_key.items():
        by_layout[key[0]].append((key, g))

    def objective(trial: optuna.Trial) -> list[float]:
        p = {name: trial.suggest_categorical(name, list(dist.choices))  # type: ignore[attr-defined]
             for name, dist in dists.items()}
        drawn = (p["layout"], p["sharding"], p["precision"], p["optimizer"], p["checkpointing"])
        group = groups_by_key.get(drawn)  # type: ignore[arg-type]
        if group is None:  # repair: the drawn layout's group that agrees with most of the other draws
            options = by_layout.get(p["layout"], [])  # type: ignore[arg-type]
            if not options:
                raise optuna.TrialPruned()
            group = max(options, key=lambda kg: sum(a == b for a, b in zip(kg[0], drawn, strict=True)))[1]
            trial.set_user_attr("repaired", True)
        sizes = space.micro_batches(group.layout)
        if not sizes:
            raise optuna.TrialPruned()
        mbs = p["mbs"] if p["mbs"] in sizes else min(sizes, key=lambda b: (abs(b - p["mbs"]), b))  # type: ignore[operator]
        accums = space.accumulations(group.layout, mbs)
        s = strategy_of(group, mbs, accums[min(p["accum"], len(accums) - 1)])  # type: ignore[type-var]
        est = pricer(s) if s is not None else None
        if est is None:
            raise optuna.TrialPruned()
        if space.partial_checkpointing and est.fits and can_be_partial(est.strategy, blocks):
            family = [est, *(e for e, *_ in _partial_estimates(pricer, est.strategy, blocks or 0, mbs, 0,
                                                                "none" in space.checkpointing))]
            est = rank(family, goal)[0]  # the trial stands for its best: the sampler learns where partial wins
        trial.set_constraint(MEMORY_CONSTRAINT_KEY, -est.memory.headroom_bytes / 2**30)
        trial.set_user_attr("label", est.strategy.label())
        trial.set_user_attr("strategy", est.strategy.model_dump(mode="json"))
        notify(ProgressEvent(stage="search", done=trial.number + 1, total=n_trials, message=est.strategy.label()))
        return goal.values(est)

    if remaining:
        study.optimize(objective, n_trials=remaining)
    return len(pricer.priced) - before, resumed


def search(profile: ModelProfile, cluster: Cluster, space: SearchSpace, *, goal: Goal | None = None,
           method: SearchMethod = "auto", n_trials: int | None = None, seed: int = 0,
           storage: str | Path | None = None, study_name: str | None = None,
           on_progress: Callable[[ProgressEvent], None] | None = None,
           calibration: Calibration | None = None,
           on_trial: Callable[[Estimate], None] | None = None) -> SearchResult:
    """Price the space and rank it by ``goal``. Deterministic for the same inputs and seed.

    ``calibration`` (from earlier probe runs) corrects every estimate; it is part of the study's name.
    ``on_trial`` receives each newly priced candidate's Estimate (in pricing order, resumed ones included),
    from the thread that runs the search: a live view of the trials (the dashboard). An exception it
    raises stops the search; the study keeps what was recorded (a rerun with the same storage resumes)."""
    goal = goal or Goal()
    goal.check()
    notify = on_progress or (lambda _e: None)
    size = space.size
    chosen: Literal["enumerate", "screen", "nsga2", "tpe"] = auto_method(space, size) if method == "auto" \
        else method  # type: ignore[assignment]
    name = study_name or study_name_for(profile, cluster, space, goal, chosen, seed, calibration)
    pricer = Pricer(profile, cluster, calibration, on_priced=on_trial)
    screened_out = 0
    if chosen in ("enumerate", "screen"):
        study = _open_study(storage, name, goal, optuna.samplers.NSGAIISampler(seed=seed))
        full = space
        probed = 0
        if chosen == "screen":
            before = len(pricer.priced)
            full = space.model_copy(update={"layouts": _screen(pricer, space, goal, notify)})
            probed = len(pricer.priced) - before
            screened_out = len(space.layouts) - len(full.layouts)
        evaluated, resumed = _enumerate(pricer, full, study, goal, notify, storage)
        evaluated += probed
    else:
        sampler: optuna.samplers.BaseSampler = (
            optuna.samplers.TPESampler(seed=seed, multivariate=True)
            if chosen == "tpe" else optuna.samplers.NSGAIISampler(seed=seed))
        study = _open_study(storage, name, goal, sampler)
        evaluated, resumed = _optimize(pricer, space, study, goal, n_trials or min(size, DEFAULT_TRIALS), notify)
    ranked = rank(list(pricer.priced.values()), goal)
    return SearchResult(ranked=ranked, method=chosen, space_size=size, evaluated=evaluated, resumed=resumed,
                        layouts_screened_out=screened_out, study=study, goal=goal)

