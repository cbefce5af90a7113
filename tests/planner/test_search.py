"""Search space, Optuna search, objectives, resume, rationale and what-would-fit on hand-built profiles."""

from __future__ import annotations

import math

import pytest
from conftest import make_gpu, make_profile

import optplan.planner.search as search_module
from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.validity import check_strategy
from optplan.planner.goal import Goal, pareto_front, rank, rank_by_figure
from optplan.planner.recommend import recommend
from optplan.planner.search import search
from optplan.planner.simplicity import simplicity_key
from optplan.planner.space import build_space, parse_gpus_range, strategy_of
from optplan.planner.suggest import fewest_gpus_zero3

GPT2_ARCH = "layers=12,hidden=768,heads=12,vocab=50257,seq=1024"


def _cluster(gpus: int = 8, gib: float = 80.0, gpn: int = 8) -> Cluster:
    return Cluster(gpu=make_gpu(gib), gpus=gpus, gpus_per_node=gpn)


def _all_strategies(space):  # type: ignore[no-untyped-def]
    for group in space.groups():
        for mbs in space.micro_batches(group.layout):
            for gas in space.accumulations(group.layout, mbs):
                s = strategy_of(group, mbs, gas)
                if s is not None:
                    yield s


def test_space_with_global_batch_holds_it_fixed() -> None:
    space = build_space(make_profile(), _cluster(), global_batch=96, engines=["deepspeed"])
    (layout,) = space.layouts
    assert space.micro_batches(layout) == (1, 2, 3, 4, 6, 12)
    strategies = list(_all_strategies(space))
    assert {s.global_batch for s in strategies} == {96}
    assert space.size == len(strategies)


def test_model_parallel_layouts_follow_megatron_rules() -> None:
    prof = profile_from_arch(parse_arch(GPT2_ARCH))
    c = _cluster(gpus=16)
    space = build_space(prof, c, global_batch=64)
    assert {lay.tp for lay in space.layouts} == {1, 2, 4}  # divides 12 heads, powers of two <= 8
    assert any(lay.pp > 1 for lay in space.layouts) and any(lay.vpp > 1 for lay in space.layouts)
    for lay in space.layouts:
        assert lay.dp * lay.tp * lay.pp * lay.cp == 16
        assert lay.pp * lay.vpp <= 12  # an uneven split is a custom pipeline layout, never an empty stage
        assert lay.cp == 1  # 1024 tokens cannot split into >= 1024-token CP ranks
    # splits 12 layers cannot take evenly are searched too (Megatron's --pipeline-model-parallel-layout)
    assert any(12 % (lay.pp * lay.vpp) for lay in space.layouts)
    strategies = list(_all_strategies(space))
    assert all(s.engine == "megatron" for s in strategies if s.model_parallel)
    assert any(s.engine == "torch" and s.fsdp == "hybrid" for s in strategies)  # 2 nodes: HSDP
    for s in strategies[::7]:
        check_strategy(prof, c, s)  # every candidate is legal


def test_model_file_defaults_to_engines_that_run_it() -> None:
    rec = recommend(make_profile(), _cluster(), global_batch=64)
    assert rec.plan is not None and rec.plan.engine in ("deepspeed", "torch")
    assert not any(a.plan.model_parallel for a in rec.alternatives)


def test_space_errors_are_one_line_with_fix() -> None:
    with pytest.raises(OptplanError, match="not divisible by any data-parallel degree.*multiple of 8"):
        recommend(make_profile(), _cluster(), global_batch=100)
    with pytest.raises(OptplanError, match="unknown precision"):
        build_space(make_profile(), _cluster(), precisions=["fp64"])
    with pytest.raises(OptplanError, match="unknown --engine"):
        build_space(make_profile(), _cluster(), engines=["jax"])
    moe = profile_from_arch(parse_arch("layers=2,hidden=256,heads=4,ffn=512,vocab=1000,experts=4,topk=2,seq=256"))
    with pytest.raises(OptplanError, match="--checkpointing moe is Megatron-LM's.*runs deepspeed: add --engine megatron"):
        build_space(moe, _cluster(), engines=["deepspeed"], checkpointing=["moe"])
    assert {s.checkpointing for s in _all_strategies(build_space(moe, _cluster(), checkpointing=["moe"]))} == {"moe"}


def test_space_without_bf16_searches_fp16() -> None:
    c = Cluster(gpu=make_gpu(bf16=False), gpus=4, gpus_per_node=4)
    assert build_space(make_profile(), c).precisions == ("fp16", "amp-fp16", "fp32")


def test_gpus_range_counts_launch() -> None:
    assert parse_gpus_range("8:64", 8) == (8, 16, 24, 32, 48, 64)
    assert parse_gpus_range("1:8", 8) == (1, 2, 4, 8)
    for bad in ("8", "64:8", "a:b", "0:8"):
        with pytest.raises(OptplanError, match="--gpus-range"):
            parse_gpus_range(bad, 8)


def test_pruned_enumeration_finds_the_brute_force_best() -> None:
    prof = profile_from_arch(parse_arch(GPT2_ARCH))
    c = _cluster(gpus=16, gib=24)
    space = build_space(prof, c, global_batch=128)
    result = search(prof, c, space)
    assert result.method == "enumerate" and 0 < result.evaluated < space.size  # pruning skipped some
    brute = [e for s in _all_strategies(space)
             if (e := _maybe(prof, c, s)) is not None and e.fits]
    goal = Goal()
    top = min(goal.class_key(e) for e in brute)  # the first class (fits at the 90th-percentile allocator margin)
    robust = max((e for e in brute if goal.class_key(e) == top), key=lambda e: -goal.figure(e))  # slow-end samples/s
    assert -goal.figure(result.feasible[0]) <= -goal.figure(robust)
    assert -goal.figure(rank_by_figure(result.feasible, goal)[0]) == pytest.approx(-goal.figure(robust))
    assert result.feasible[0].strategy == rank(brute, goal)[0].strategy  # pruning loses nothing the rule picks
    assert goal.ties(robust, result.feasible[0])
    assert simplicity_key(result.feasible[0].strategy) <= simplicity_key(robust.strategy)
    flags = [e.fits for e in result.ranked]
    assert flags == sorted(flags, reverse=True)
    keys = [(goal.class_key(e), goal.figure(e)) for e in result.feasible[1:]]  # after the pick: class, robust figure
    assert keys == sorted(keys)
    trials = result.study.trials
    assert trials and all(t.constraints for t in trials)
    assert result.study.trials[0].user_attrs["strategy"]["engine"] in ("deepspeed", "torch", "megatron")


def _maybe(prof, c, s):  # type: ignore[no-untyped-def]
    try:
        return estimate(prof, c, s)
    except OptplanError:
        return None


def test_nsga2_is_deterministic_and_near_the_enumerated_best() -> None:
    prof, c = make_profile(params=2_000_000_000), _cluster(gib=40)
    space = build_space(prof, c, global_batch=256, engines=["deepspeed"])
    enum = search(prof, c, space, method="enumerate")
    a = search(prof, c, space, method="nsga2", n_trials=150, seed=7)
    b = search(prof, c, space, method="nsga2", n_trials=150, seed=7)
    assert a.method == "nsga2"
    assert [e.strategy for e in a.ranked] == [e.strategy for e in b.ranked]
    best = max(-Goal().figure(e) for e in a.feasible)  # samples/s at the band's slow end
    assert best >= 0.95 * max(-Goal().figure(e) for e in enum.feasible)
    assert Goal().ties(rank_by_figure(a.feasible, Goal())[0], a.feasible[0])
    assert not any(e.fits for e in a.ranked if e.memory.total_bytes > e.memory.capacity_bytes)
    tpe = search(prof, c, space, method="tpe", n_trials=60, seed=1)
    assert tpe.method == "tpe" and tpe.feasible


def test_enumeration_resumes_from_storage(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    prof = profile_from_arch(parse_arch(GPT2_ARCH))
    c = _cluster(gpus=16)
    space = build_space(prof, c, global_batch=64)
    full = search(prof, c, space)
    monkeypatch.setattr(search_module, "CHUNK_GROUPS", 40)
    store = str(tmp_path / "study.log")
    seen = []

    def stop_after_first_chunk(event) -> None:  # type: ignore[no-untyped-def]
        seen.append(event)
        if len(seen) == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        search(prof, c, space, storage=store, on_progress=stop_after_first_chunk)
    resumed = search(prof, c, space, storage=store)
    assert resumed.resumed > 0 and resumed.evaluated < full.evaluated
    assert resumed.feasible[0].strategy == full.feasible[0].strategy
    again = search(prof, c, space, storage=store)  # finished: nothing repeated
    assert again.evaluated == 0 and again.feasible[0].strategy == full.feasible[0].strategy


def test_optuna_study_is_shared_and_resumed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    prof, c = make_profile(params=2_000_000_000), _cluster(gib=40)
    space = build_space(prof, c, global_batch=256, engines=["deepspeed"])
    store = str(tmp_path / "shared.db")
    first = search(prof, c, space, method="nsga2", n_trials=10, storage=store, study_name="s")
    second = search(prof, c, space, method="nsga2", n_trials=16, storage=store, study_name="s")
    assert len(second.study.trials) == 16  # resumed to 16, not 10 + 16
    assert second.resumed > 0 and first.feasible


def test_time_objective_with_deadline_takes_the_fewest_gpus() -> None:
    prof = make_profile(params=1_000_000_000, hidden=2048, layers=24)
    c = _cluster(gpus=64)
    counts = parse_gpus_range("8:64", 8)
    fastest = recommend(prof, c, global_batch=384, gpu_counts=counts, goal=Goal(objective="time", tokens=2e10))
    assert fastest.plan is not None and fastest.estimate is not None
    t_fast = fastest.estimate.cost.train_time_s
    goal = Goal(objective="time", tokens=2e10, deadline_s=2.5 * t_fast)
    rec = recommend(prof, c, global_batch=384, gpu_counts=counts, goal=goal)
    assert rec.estimate is not None and rec.estimate.cost is not None
    assert rec.estimate.cost.train_time_s <= goal.deadline_s
    assert rec.estimate.gpus < fastest.estimate.gpus
    # the pick meets the deadline even at its band's slow end, and every plan on fewer GPUs does not
    assert goal.meets_deadline(rec.estimate, "slow")
    space = build_space(prof, c, global_batch=384, gpu_counts=counts, engines=["deepspeed", "torch"])
    result = search(prof, c, space, goal=goal)
    assert all(not goal.meets_deadline(e, "slow") for e in result.feasible if e.gpus < rec.estimate.gpus)
    assert "deadline" in rec.rationale[0] and any("GPUs of the 8-64 searched" in line for line in rec.rationale)
    # the fewer-GPU plan the line names misses the deadline at least at the band's slow end, and says so
    line = next(x for x in rec.rationale if "GPUs of the 8-64 searched" in x)
    fewer = line.split(": ", 1)[1].split("; ")[0]
    assert "past the deadline at the band's slow end" in fewer or "misses the deadline" in fewer, line


def test_a_deadline_met_only_at_the_nominal_time_ranks_after_one_met_at_the_slow_end() -> None:
    """The deadline classes: met at the band's slow end, met at the nominal time only, missed; a pick of the middle
    class says so in the rationale and a note."""
    prof = make_profile(params=1_000_000_000, hidden=2048, layers=24)
    c = _cluster(gpus=64)
    counts = parse_gpus_range("8:64", 8)
    fastest = recommend(prof, c, global_batch=384, gpu_counts=counts, goal=Goal(objective="time", tokens=2e10))
    e = fastest.estimate
    assert e is not None and e.cost is not None
    nominal, slow = Goal(objective="time", tokens=2e10).train_time_s(e), Goal(objective="time", tokens=2e10).train_time_s(e, "slow")
    assert slow > nominal
    between = Goal(objective="time", tokens=2e10, deadline_s=(nominal + slow) / 2)
    assert between.deadline_class(e) == 1 and between.meets_deadline(e) and not between.meets_deadline(e, "slow")
    assert Goal(objective="time", tokens=2e10, deadline_s=slow * 1.01).deadline_class(e) == 0
    assert Goal(objective="time", tokens=2e10, deadline_s=nominal * 0.99).deadline_class(e) == 2
    assert between.class_key(e) > Goal(objective="time", tokens=2e10, deadline_s=slow * 1.01).class_key(e)
    rec = recommend(prof, c, global_batch=384, gpu_counts=counts, goal=between)
    assert rec.estimate is not None
    assert between.deadline_class(rec.estimate) == 1  # no plan meets it at its slow end: said, not hidden
    assert "nominal time only" in rec.rationale[0]
    assert any("band's slow end" in n for n in rec.notes)


def test_a_missed_deadline_says_by_how_much() -> None:
    """No plan meets the deadline: the headline names the deadline and how late the fastest plan is (it read
    "(misses 1.0 h)" when it missed a one-hour deadline by 165.8 days)."""
    prof = make_profile(params=1_000_000_000, hidden=2048, layers=24)
    c = _cluster(gpus=64)
    counts = parse_gpus_range("8:64", 8)
    fastest = recommend(prof, c, global_batch=384, gpu_counts=counts, goal=Goal(objective="time", tokens=2e10))
    assert fastest.estimate is not None and fastest.estimate.cost is not None
    goal = Goal(objective="time", tokens=2e10, deadline_s=fastest.estimate.cost.train_time_s / 4)
    rec = recommend(prof, c, global_batch=384, gpu_counts=counts, goal=goal)
    assert rec.estimate is not None and goal.deadline_class(rec.estimate) == 2
    late_h = (goal.train_time_s(rec.estimate) - goal.deadline_s) / 3600
    assert f"misses the {goal.deadline_s / 3600:.1f} h deadline by {late_h:.1f} h" in rec.rationale[0], rec.rationale[0]


def test_cost_objective_minimises_gpu_hours() -> None:
    prof = make_profile(params=1_000_000_000, hidden=2048, layers=24)
    c = _cluster(gpus=64)
    goal = Goal(objective="cost", tokens=2e10, price_per_gpu_hour=2.0)
    space = build_space(prof, c, global_batch=384, gpu_counts=(8, 16, 32, 64), engines=["deepspeed"])
    result = search(prof, c, space, goal=goal)
    pick = result.feasible[0]
    cheapest = min(result.feasible, key=lambda e: goal.gpu_hours(e, "slow"))  # at the band's slow end
    assert goal.rank_key(cheapest) == goal.rank_key(rank_by_figure(result.feasible, goal)[0])
    assert goal.gpu_hours(pick, "fast") <= goal.gpu_hours(cheapest, "slow")  # a tie, if not the cheapest itself
    assert simplicity_key(pick.strategy) <= simplicity_key(cheapest.strategy)
    front = pareto_front(result.ranked, goal)
    for e in front:
        for o in result.feasible:
            assert not (goal.train_time_s(o) < goal.train_time_s(e) and goal.gpu_hours(o) < goal.gpu_hours(e))
    rec = recommend(prof, c, global_batch=384, gpu_counts=(8, 16, 32, 64), goal=goal, engines=["deepspeed"])
    assert rec.estimate is not None and rec.estimate.cost is not None
    assert rec.estimate.cost.cost_usd == pytest.approx(2.0 * rec.estimate.cost.gpu_hours)
    assert "cheapest" in rec.rationale[0] and "$" in rec.rationale[0]


def test_time_and_cost_need_tokens() -> None:
    for objective in ("time", "cost"):
        with pytest.raises(OptplanError, match="needs --tokens"):
            recommend(make_profile(), _cluster(), goal=Goal(objective=objective))  # type: ignore[arg-type]


def test_pareto_front_is_non_dominated() -> None:
    prof, c = make_profile(), _cluster()
    result = search(prof, c, build_space(prof, c))
    front = pareto_front(result.ranked)  # nominal figures, not the ranking's robust ones
    assert front[0].samples_per_s == max(e.samples_per_s for e in result.feasible)
    for e in front:
        for other in result.feasible:
            dominates = (other.samples_per_s > e.samples_per_s
                         and other.memory.headroom_bytes > e.memory.headroom_bytes)
            assert not dominates


def test_recommend_explains_each_decision_with_numbers() -> None:
    rec = recommend(make_profile(), _cluster(), global_batch=512)
    assert rec.fits and rec.plan is not None and rec.estimate is not None
    assert rec.plan.global_batch == 512
    text = "\n".join(rec.rationale)
    for word in ("precision", "micro-batch", "checkpointing", "global batch 512", "optimizer adamw", "layout" if
                 rec.plan.model_parallel else "no model parallelism"):
        assert word in text
    assert all(any(ch.isdigit() for ch in line) for line in rec.rationale)
    doc = rec.model_dump(mode="json")
    assert {"plan", "estimate", "alternatives", "rationale", "pareto", "export"} <= doc.keys()
    assert doc["plan"]["zero"] == rec.plan.zero and "mbs" in doc["plan"]
    assert doc["estimate"]["memory"]["total_bytes"] == rec.estimate.memory.total_bytes
    assert doc["export"]["strategy"] == doc["plan"] and doc["export"]["block_class"] == "Block"


def test_memory_pressure_drives_sharding() -> None:
    # 1.5B params on 16 GiB GPUs: unsharded states (24 GB) cannot fit, so ZeRO/FSDP must shard.
    rec = recommend(make_profile(params=1_500_000_000, hidden=1600, layers=48), _cluster(gib=16),
                    global_batch=64, engines=["deepspeed"])
    assert rec.fits and rec.plan is not None
    assert rec.plan.zero >= 1
    line = next(r for r in rec.rationale if r.startswith(f"DeepSpeed ZeRO-{rec.plan.zero}:"))
    assert "do not fit" in line or "frees" in line or "as fast" in line or "costs" in line
    assert "frees -" not in line


def test_big_model_on_many_gpus_goes_model_parallel_and_says_why() -> None:
    # 22B parameters: Megatron's sharding stops at ZeRO-1, so its unsharded weights and gradients (88 GB)
    # need tensor or pipeline parallelism on 80 GiB GPUs (DeepSpeed ZeRO-1 over 64 GPUs would fit without)
    prof = profile_from_arch(parse_arch("layers=48,hidden=6144,heads=48,vocab=51200,seq=2048"))
    rec = recommend(prof, Cluster(gpu=make_gpu(80), gpus=64, gpus_per_node=8), global_batch=512,
                    engines=["megatron"])
    assert rec.plan is not None and rec.plan.model_parallel and rec.plan.engine == "megatron"
    layout = next(r for r in rec.rationale if r.startswith("layout "))
    assert f"tp {rec.plan.tp}, pp {rec.plan.pp}" in layout and "samples/s" in layout
    assert any(r.startswith("Megatron-LM") for r in rec.rationale)
    assert math.isclose(rec.plan.global_batch, 512)


def test_free_global_batch_states_the_lr_rule() -> None:
    rec = recommend(make_profile(), _cluster())
    assert any("square-root rule for Adam" in r for r in rec.rationale)


def test_nothing_fits_says_what_would() -> None:
    prof = make_profile(params=70_000_000_000, hidden=8192, layers=80, seq=4096)
    c = _cluster()
    rec = recommend(prof, c, global_batch=1024, offload=False)
    assert not rec.fits and rec.plan is None
    assert "no searched plan fits 8 x TestGPU" in rec.rationale[0]
    space = build_space(prof, c, global_batch=1024)
    fewest = fewest_gpus_zero3(prof, c, space)
    assert fewest is not None and fewest.fits
    n = fewest.gpus
    assert n % 8 == 0 and 1024 % n == 0  # whole nodes of 8 that divide the global batch
    launchable = max(m for m in range(8, n, 8) if 1024 % m == 0)  # the next count that can be launched
    below = estimate(prof, c.model_copy(update={"gpus": launchable}),
                     fewest.strategy.model_copy(update={"dp": launchable}))
    assert not below.fits
    assert any(f"--gpus {n}" in s for s in rec.suggestions)
    assert any("offload" in s for s in rec.suggestions)
    doc = rec.model_dump(mode="json")
    first = doc["suggested"][0]
    assert first["estimate"]["fits"] and first["estimate"]["gpus"] % 8 == 0
    assert first["plan"]["zero"] == 3 and f"--gpus {first['estimate']['gpus']}" in rec.suggestions[0]
    assert any(p["plan"]["offload_optimizer"] == "cpu" for p in doc["suggested"][1:])
    assert doc["export"] is None


def test_fewest_gpus_keeps_a_fixed_global_batch() -> None:
    prof = make_profile(params=70_000_000_000, hidden=8192, layers=80, seq=4096)
    c = _cluster()
    free = fewest_gpus_zero3(prof, c, build_space(prof, c))
    fixed = fewest_gpus_zero3(prof, c, build_space(prof, c, global_batch=1024))
    assert free is not None and fixed is not None
    assert 1024 % fixed.gpus == 0 and fixed.gpus >= free.gpus and fixed.fits
    assert fixed.strategy.global_batch == 1024
    assert not any(1024 % n == 0 and n % 8 == 0 for n in range(free.gpus, fixed.gpus))


def test_params_only_recommends_the_least_sharding_that_fits() -> None:
    from optplan.estimators.params_only import profile_from_params

    prof = profile_from_params(7e9)
    c = _cluster(gib=40)
    rec = recommend(prof, c)
    assert rec.fits and rec.plan is not None and rec.estimate is not None
    assert rec.estimate.time is None and rec.objective == "states"
    pick = rec.plan
    # every cheaper sharding (lower stage, no offload) of the same precision does not fit
    for stage in range(pick.shard_stage):
        cheaper = _maybe_states(prof, c, pick.model_copy(update={"zero": stage}))
        assert cheaper is not None and not cheaper.fits
    assert any("needs" in line and "> " in line for line in rec.rationale[1:])
    doc = rec.model_dump(mode="json")
    assert doc["estimate"]["time"] is None and doc["export"]["strategy"] == doc["plan"]
    with pytest.raises(OptplanError, match="--params gives model states only"):
        recommend(prof, c, goal=Goal(objective="time", tokens=1e9))
    none = recommend(profile_from_params(70e9), c, offload=False)
    assert not none.fits and any("--gpus" in s for s in none.suggestions)


def _maybe_states(prof, c, s):  # type: ignore[no-untyped-def]
    from optplan.estimators.estimate import estimate_states
    try:
        return estimate_states(prof, c, s)
    except OptplanError:
        return None


def _shared_worker(store: str) -> None:
    prof, c = make_profile(params=2_000_000_000), _cluster(gib=40)
    space = build_space(prof, c, global_batch=256, engines=["deepspeed"])
    search(prof, c, space, method="nsga2", n_trials=30, storage=store, study_name="shared", seed=3)


def test_two_processes_share_one_study(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import multiprocessing

    import optuna

    store = str(tmp_path / "shared.log")
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_shared_worker, args=(store,)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    study = optuna.load_study(study_name="shared", storage=search_module.resolve_storage(store))
    done = [t for t in study.trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
    assert 30 <= len(done) <= 60 and len(done) == len(study.trials)
    prof, c = make_profile(params=2_000_000_000), _cluster(gib=40)
    space = build_space(prof, c, global_batch=256, engines=["deepspeed"])
    after = search(prof, c, space, method="nsga2", n_trials=30, storage=store, study_name="shared", seed=3)
    assert after.evaluated == 0 and after.resumed > 0 and after.feasible  # nothing left to do, all reused


def test_study_values_are_robust_and_an_older_format_is_not_resumed(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    prof = profile_from_arch(parse_arch(GPT2_ARCH))
    c = _cluster(gpus=8)
    space = build_space(prof, c, global_batch=64, engines=["deepspeed"])
    store = str(tmp_path / "study.log")
    monkeypatch.setattr(search_module, "STUDY_FORMAT", search_module.STUDY_FORMAT - 1)
    old = search(prof, c, space, storage=store)  # recorded under the previous format's study name
    monkeypatch.undo()
    new = search(prof, c, space, storage=store)
    assert new.study.study_name != old.study.study_name
    assert new.resumed == 0 and new.evaluated == old.evaluated  # priced afresh, not resumed from old values
    by_label = {e.strategy.label(): e for e in new.ranked}
    for t in new.study.trials:
        e = by_label[t.user_attrs["label"]]
        assert t.values[0] == pytest.approx(e.samples_per_s * e.time.step_s / e.time.step_s_high)
        assert t.values[0] < e.samples_per_s  # the slow end of the band (the test GPU was never measured)


def test_screen_enumerates_the_best_layouts_and_finds_the_enumerated_pick(monkeypatch) -> None:
    """Above ENUMERATE_LIMIT the search screens layouts through one probe group each and enumerates the best in
    full: on an MoE space its pick is the full enumeration's, with far fewer candidates priced. One node of 8 GPUs
    (96 layouts, ep among them) keeps the full enumeration it is checked against cheap."""
    import optplan.planner.search as search_mod
    from optplan.estimators.hardware import find_gpu

    prof = profile_from_arch(parse_arch(
        "layers=13,hidden=2048,heads=16,ffn=8192,vocab=32000,gated=1,tied=0,experts=64,topk=8,moe_ffn=512,seq=4096"))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8)
    space = build_space(prof, cluster, global_batch=512, engines=("megatron",))
    full = search(prof, cluster, space, method="enumerate")
    monkeypatch.setattr(search_mod, "SCREEN_KEEP_LAYOUTS", 12)
    monkeypatch.setattr(search_mod, "ENUMERATE_LIMIT", space.size - 1)
    screened = search(prof, cluster, space)  # auto: above the limit -> screen
    assert screened.method == "screen"
    kept = search_mod.screen_keep(len(space.layouts))
    assert 12 <= kept < len(space.layouts) and screened.layouts_screened_out == len(space.layouts) - kept
    assert screened.evaluated < full.evaluated
    assert screened.ranked[0].strategy == full.ranked[0].strategy


def test_screen_keeps_layouts_that_fit_only_with_offload() -> None:
    """A Mixtral-8x7B shape on 8 H100s fits only with CPU offload. The screen's probes once tried no offload, so every
    layout's probe failed, the layouts were kept by the speed of plans that do not fit, and the search answered
    "no plan fits" (0 of 2,023 plans) where the full enumeration found 161. Now a layout whose plain probe does not
    fit is probed with offload too, and one that fits nowhere ranks by how near it comes."""
    from optplan.estimators.hardware import find_gpu

    prof = profile_from_arch(parse_arch("layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000,gated=1,"
                                        "tied=0,experts=8,topk=2,seq=4096"))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8)
    space = build_space(prof, cluster)
    screened = search(prof, cluster, space)
    assert screened.method == "screen" and screened.layouts_screened_out > 0
    fitting = [e for e in screened.ranked if e.fits]
    assert fitting and all(e.strategy.offload_params != "none" or e.strategy.offload_optimizer != "none"
                           for e in fitting)
    full = search(prof, cluster, space, method="enumerate")
    assert screened.ranked[0].strategy == full.ranked[0].strategy


def test_auto_screens_only_where_the_screen_would_drop_layouts(monkeypatch) -> None:
    """``auto`` enumerates up to ENUMERATE_LIMIT points, and above it still enumerates a space whose layouts the
    screen would all keep (probing them first would only add work); above the limit with more layouts than the
    screen keeps, it screens."""
    import optplan.planner.search as search_mod
    from optplan.estimators.hardware import find_gpu

    prof = profile_from_arch(parse_arch(
        "layers=13,hidden=2048,heads=16,ffn=8192,vocab=32000,gated=1,tied=0,experts=64,topk=8,moe_ffn=512,seq=4096"))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8)
    space = build_space(prof, cluster, global_batch=512, engines=("megatron",))
    layouts = len(space.layouts)
    assert search_mod.auto_method(space) == ("enumerate" if space.size <= search_mod.ENUMERATE_LIMIT else "screen")
    monkeypatch.setattr(search_mod, "ENUMERATE_LIMIT", space.size - 1)
    monkeypatch.setattr(search_mod, "SCREEN_KEEP_LAYOUTS", layouts)  # the screen would keep every layout
    assert search_mod.auto_method(space) == "enumerate"
    monkeypatch.setattr(search_mod, "SCREEN_KEEP_LAYOUTS", layouts - 1)
    assert search_mod.auto_method(space) == "screen"
    monkeypatch.setattr(search_mod, "ENUMERATE_LIMIT", space.size)
    assert search_mod.auto_method(space) == "enumerate"


def test_nsga2_repairs_illegal_draws_instead_of_wasting_trials() -> None:
    """Optuna draws the axes independently; a draw that is no legal point (a sharding the layout's engine lacks, a
    micro-batch that does not divide its batch) is repaired to the nearest legal one, so most trials price a
    plan (before: most were pruned, 16 legal plans of 3,000 trials on DeepSeek-V3 at 2,048 GPUs)."""
    from optplan.estimators.hardware import find_gpu

    prof = profile_from_arch(parse_arch(
        "layers=13,hidden=2048,heads=16,ffn=8192,vocab=32000,gated=1,tied=0,experts=64,topk=8,moe_ffn=512,seq=4096"))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8)
    space = build_space(prof, cluster, global_batch=512)  # deepspeed, torch and megatron shardings
    result = search(prof, cluster, space, method="nsga2", n_trials=80)
    repaired = [t for t in result.study.trials if t.user_attrs.get("repaired")]
    assert repaired  # illegal draws happened and were priced, not pruned
    assert result.evaluated >= 40
    for e in result.ranked:
        check_strategy(prof, cluster, e.strategy)  # every priced plan is legal


def test_the_users_fsdp_reduce_dtype_prices_the_torch_fsdp_plans_that_take_it() -> None:
    """--fsdp-reduce-dtype bf16 (a trainer that reduces in bf16: accelerate, the HF Trainer, Lightning): every torch
    FSDP plan over bf16 weights reduces in bf16, the other plans as before; and the pick is priced with it."""
    prof = profile_from_arch(parse_arch(GPT2_ARCH))
    cluster = _cluster(gpus=16)
    space = build_space(prof, cluster, engines=("torch", "deepspeed"), precisions=("bf16", "amp-bf16"),
                        fsdp_reduce_dtype="bf16")
    plans = list(_all_strategies(space))
    takes = [s.engine == "torch" and s.fsdp != "none" and s.precision == "bf16" for s in plans]
    assert any(takes) and not all(takes)
    assert [s.fsdp_reduce_dtype for s in plans] == ["bf16" if t else "auto" for t in takes]
    default = list(_all_strategies(build_space(prof, cluster, engines=("torch", "deepspeed"),
                                               precisions=("bf16", "amp-bf16"))))
    assert [s.model_copy(update={"fsdp_reduce_dtype": "auto"}) for s in plans] == default
    rec = recommend(prof, cluster, engines=("torch",), precisions=("bf16",), fsdp_reduce_dtype="bf16")
    assert rec.plan is not None
    assert rec.plan.fsdp_reduce_dtype == ("bf16" if rec.plan.fsdp != "none" else "auto")
