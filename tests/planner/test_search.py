"""Search space, Optuna search, rationale and what-would-fit on hand-built profiles."""

from __future__ import annotations

import pytest
from conftest import make_gpu, make_profile

from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster
from optplan.planner.recommend import recommend
from optplan.planner.search import pareto_front, search
from optplan.planner.space import build_space, enumerate_space
from optplan.planner.suggest import fewest_gpus_zero3


def _cluster(gpus: int = 8, gib: float = 80.0) -> Cluster:
    return Cluster(gpu=make_gpu(gib), gpus=gpus, gpus_per_node=8)


def test_space_with_global_batch_holds_it_fixed() -> None:
    space = build_space(make_profile(), _cluster(), global_batch=96)
    assert space.micro_batches == (1, 2, 3, 4, 6, 12)
    assert {s.global_batch for s in enumerate_space(space)} == {96}
    assert space.size == len(list(enumerate_space(space)))


def test_space_errors_are_one_line_with_fix() -> None:
    with pytest.raises(OptplanError, match="not divisible by 8 GPUs.*multiple of 8"):
        build_space(make_profile(), _cluster(), global_batch=100)
    with pytest.raises(OptplanError, match="unknown precision"):
        build_space(make_profile(), _cluster(), precisions=["fp64"])


def test_space_without_bf16_searches_fp16() -> None:
    c = Cluster(gpu=make_gpu(bf16=False), gpus=4, gpus_per_node=4)
    assert build_space(make_profile(), c).precisions == ("fp16", "amp-fp16", "fp32")


def test_enumeration_picks_fastest_feasible() -> None:
    prof, c = make_profile(), _cluster()
    space = build_space(prof, c, global_batch=512)
    result = search(prof, c, space)
    assert result.method == "enumerate" and result.evaluated == space.size
    brute = [estimate(prof, c, s) for s in enumerate_space(space)]
    best = max((e for e in brute if e.fits), key=lambda e: e.samples_per_s)
    assert result.feasible[0].samples_per_s == pytest.approx(best.samples_per_s)
    # feasible first, sorted by speed
    flags = [e.fits for e in result.ranked]
    assert flags == sorted(flags, reverse=True)
    speeds = [e.samples_per_s for e in result.feasible]
    assert speeds == sorted(speeds, reverse=True)
    assert len(result.study.trials) > 0
    assert all(t.constraints for t in result.study.trials)


def test_nsga2_is_deterministic_and_near_the_enumerated_best() -> None:
    prof, c = make_profile(params=2_000_000_000), _cluster(gib=40)
    space = build_space(prof, c, global_batch=256)
    enum = search(prof, c, space, method="enumerate")
    a = search(prof, c, space, method="nsga2", n_trials=150, seed=7)
    b = search(prof, c, space, method="nsga2", n_trials=150, seed=7)
    assert a.method == "nsga2"
    assert [e.strategy for e in a.ranked] == [e.strategy for e in b.ranked]
    assert a.feasible[0].samples_per_s >= 0.95 * enum.feasible[0].samples_per_s
    assert not any(e.fits for e in a.ranked if e.memory.total_bytes > e.memory.capacity_bytes)


def test_pareto_front_is_non_dominated() -> None:
    prof, c = make_profile(), _cluster()
    result = search(prof, c, build_space(prof, c))
    front = pareto_front(result.ranked)
    assert front[0] == result.feasible[0]
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
    for word in ("precision", "ZeRO-", "micro-batch", "checkpointing", "gradient accumulation"):
        assert word in text
    assert any(ch.isdigit() for ch in rec.rationale[1])
    doc = rec.model_dump(mode="json")
    assert {"plan", "estimate", "alternatives", "rationale", "pareto"} <= doc.keys()
    assert doc["plan"]["zero"] == rec.plan.zero and "mbs" in doc["plan"]
    assert doc["estimate"]["memory"]["total_bytes"] == rec.estimate.memory.total_bytes


def test_memory_pressure_drives_zero_and_checkpointing() -> None:
    # 1.5B params on 16 GiB GPUs: unsharded states (24 GB) cannot fit, so ZeRO must shard.
    rec = recommend(make_profile(params=1_500_000_000, hidden=1600, layers=48), _cluster(gib=16),
                    global_batch=64)
    assert rec.fits and rec.plan is not None
    assert rec.plan.zero >= 1
    assert f"ZeRO-{rec.plan.zero}:" in rec.rationale[2]
    assert "do not fit" in rec.rationale[2] or "frees" in rec.rationale[2]


def test_nothing_fits_says_what_would() -> None:
    prof = make_profile(params=70_000_000_000, hidden=8192, layers=80, seq=4096)
    c = _cluster()
    rec = recommend(prof, c, global_batch=1024)
    assert not rec.fits and rec.plan is None
    assert "no searched plan fits 8 x TestGPU" in rec.rationale[0]
    fewest = fewest_gpus_zero3(prof, c, build_space(prof, c))
    assert fewest is not None and fewest.fits
    n = fewest.gpus
    assert n % 8 == 0  # whole nodes of 8
    below = estimate(prof, c.model_copy(update={"gpus": n - 8}),
                     fewest.strategy.model_copy(update={"dp": n - 8}))
    assert not below.fits
    assert any(f"--gpus {n}" in s for s in rec.suggestions)
    assert any("offload" in s for s in rec.suggestions)
    doc = rec.model_dump(mode="json")
    first = doc["suggested"][0]
    assert first["estimate"]["fits"] and first["estimate"]["gpus"] % 8 == 0
    assert first["plan"]["zero"] == 3 and f"--gpus {first['estimate']['gpus']}" in rec.suggestions[0]
    assert any(p["plan"]["offload_optimizer"] == "cpu" for p in doc["suggested"][1:])


def test_fewest_gpus_keeps_a_fixed_global_batch() -> None:
    prof = make_profile(params=70_000_000_000, hidden=8192, layers=80, seq=4096)
    c = _cluster()
    free = fewest_gpus_zero3(prof, c, build_space(prof, c))
    fixed = fewest_gpus_zero3(prof, c, build_space(prof, c, global_batch=1024))
    assert free is not None and fixed is not None
    assert 1024 % fixed.gpus == 0 and fixed.gpus >= free.gpus and fixed.fits
    assert fixed.strategy.global_batch == 1024
    assert not any(1024 % n == 0 and n % 8 == 0 for n in range(free.gpus, fixed.gpus))
