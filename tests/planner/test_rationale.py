"""Rationale lines about how sure the pick is: the tie-break, the MFU envelope, and sharding that costs memory."""

from __future__ import annotations

import re

import pytest
from conftest import make_gpu, make_profile

from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from optplan.estimators.uncertainty import mfu_envelope
from optplan.planner.goal import Goal
from optplan.planner.rationale import _envelope_line, _sharding_line, _ties_line
from optplan.planner.recommend import recommend
from optplan.planner.simplicity import CRITERIA, simplicity_key


def _cluster(gpu=None, gpus: int = 8) -> Cluster:  # type: ignore[no-untyped-def]
    return Cluster(gpu=gpu or make_gpu(80), gpus=gpus, gpus_per_node=8)


def test_a_tie_break_pick_says_which_plans_tied_and_which_criterion_decided() -> None:
    # a batch of 512 on 8 GPUs: DDP and FSDP grad-op at micro-batch 64 within 5 % of each other (at 256 the DeepSpeed
    # plans that tied there are host-paced since DeepSpeed's host multiplier, and one plan leads alone)
    rec = recommend(make_profile(), _cluster(), global_batch=512)
    assert rec.estimate is not None and rec.alternatives
    ties = [r for r in rec.rationale if r.startswith("ties: ")]
    assert len(ties) == 1
    m = re.match(r"ties: (\d+) plans? within 5% \(the time model's typical error\) of the fastest at the band's "
                 r"slow end \((.+) at ([\d,.]+) samples/s \[([\d,.]+)-([\d,.]+)\]\); "
                 r"picked the simplest: (.+) \((\d+) vs (\d+)\)$", ties[0])
    assert m, ties[0]
    best = next(a.estimate for a in rec.alternatives if a.plan.label() == m.group(2))
    assert best.samples_per_s > rec.estimate.samples_per_s  # the pick is not the fastest...
    goal = Goal()
    assert goal.ties(best, rec.estimate)  # ...but within the model's typical error of it
    assert float(m.group(4).replace(",", "")) == pytest.approx(-goal.figure(best), rel=1e-3)
    criterion = m.group(6)
    i = CRITERIA.index(criterion)
    mine, theirs = simplicity_key(rec.plan), simplicity_key(best.strategy)
    assert mine[:i] == theirs[:i] and mine[i] < theirs[i] == int(m.group(8))
    assert int(m.group(1)) >= 1
    assert rec.rationale[0].startswith("simplest of the plans tied with the fastest feasible")


def test_no_ties_line_when_the_best_is_also_the_simplest() -> None:
    e = estimate(make_profile(), _cluster(), Strategy(dp=8, mbs=8))
    assert _ties_line(e, [e], Goal()) is None


def test_mfu_above_the_measured_envelope_is_said_with_both_numbers() -> None:
    prof = make_profile(params=1_000_000_000, hidden=2048, layers=24)
    h100 = find_gpu("H100-SXM")
    rec = recommend(prof, _cluster(h100), global_batch=384, goal=Goal(objective="time", tokens=2e10))
    pick = rec.estimate
    envelope = mfu_envelope("H100-SXM", pick.strategy.precision)
    assert envelope is not None
    line = next((r for r in rec.rationale if r.startswith("MFU:")), None)
    if pick.mfu > envelope * 1.01:
        assert line is not None and f"{pick.mfu:.0%}" in line and f"({envelope:.0%})" in line
        assert "above the best measured MFU for H100-SXM in 16-bit" in line and "optimistic" in line
    elif pick.mfu > envelope:
        assert line is not None and "MFU for H100-SXM in 16-bit" in line
    else:
        assert line is None
    # the same plan at a lower MFU (a slow step) says nothing; above the envelope it always speaks
    slow = pick.model_copy(update={"mfu": envelope * 0.9})
    assert _envelope_line(slow) == ""
    fast = pick.model_copy(update={"mfu": envelope * 1.2})
    assert f"{envelope * 1.2:.0%}" in _envelope_line(fast) and f"{envelope:.0%}" in _envelope_line(fast)
    # a hair above: the step at the envelope would print as the same time ("would take 7.54 s, not 7.54 s" before)
    edge = _envelope_line(pick.model_copy(update={"mfu": envelope * 1.0001}))
    assert "is at the best measured MFU" in edge and "would take" not in edge, edge


def test_unmeasured_and_derived_gpus_are_named() -> None:
    e = estimate(make_profile(), _cluster(), Strategy(dp=8, mbs=8))
    assert mfu_envelope("TestGPU", "bf16") is None
    line = _envelope_line(e)
    assert "no run on TestGPU in 16-bit precision was ever measured" in line and f"{e.mfu:.0%}" in line
    h200 = estimate(make_profile(), _cluster(find_gpu("H200")), Strategy(dp=8, mbs=8))
    hot = h200.model_copy(update={"mfu": 0.9})
    assert "H200 (figures derived from H100-SXM)" in _envelope_line(hot)


def _zero(prof, z: int, **kw):  # type: ignore[no-untyped-def]
    return estimate(prof, _cluster(), Strategy(zero=z, dp=8, mbs=4, **kw))


def test_sharding_that_costs_memory_never_says_it_frees_a_negative_amount() -> None:
    prof = make_profile()  # 124M parameters: ZeRO-3's gather buffers outweigh the weights it shards
    z3, z2 = _zero(prof, 3), _zero(prof, 2)
    assert z3.memory.total_bytes > z2.memory.total_bytes and z3.samples_per_s < z2.samples_per_s
    goal = Goal()

    def price(s: Strategy):  # type: ignore[no-untyped-def]
        return z2 if s == z2.strategy else None

    unsearched = _sharding_line(z3, price, [z3], goal)
    assert "frees" not in unsearched and "costs" in unsearched and "more than ZeRO-2" in unsearched
    assert "its buffers" in unsearched and "not among the plans searched" in unsearched
    searched = _sharding_line(z3, price, [z2, z3], goal)
    assert "frees" not in searched and "slow end" in searched
    # were ZeRO-3 the faster one, speed is the reason
    quick = z3.model_copy(update={"samples_per_s": z2.samples_per_s * 1.2})
    assert "chosen for speed" in _sharding_line(quick, price, [quick, z2], goal)


def test_sharding_that_frees_memory_says_how_much() -> None:
    prof = make_profile(params=1_000_000_000, hidden=2048, layers=24)
    z3, z2 = _zero(prof, 3), _zero(prof, 2)
    freed = z2.memory.total_bytes - z3.memory.total_bytes
    assert freed > 0
    line = _sharding_line(z3, lambda s: z2 if s == z2.strategy else None, [z2, z3], Goal())
    assert f"frees {freed / 2**30:.1f} GiB/GPU" in line


def test_model_scope_note_names_what_the_time_model_rests_on() -> None:
    from optplan.estimators.efficiency import fitted_gpus
    from optplan.estimators.uncertainty import time_domain
    from optplan.planner.recommend import MODEL_SCOPE_NOTE

    dom = time_domain()
    for gpu in {*fitted_gpus(), *(s.gpu for s in dom.sets)}:
        assert gpu.split("-")[0] in MODEL_SCOPE_NOTE  # A100, H100
    for d in dom.derived:
        assert f"{d.gpu}" in MODEL_SCOPE_NOTE and f"derived from {d.from_gpu.split('-')[0]}" in MODEL_SCOPE_NOTE
    for s in dom.sets:
        engine = s.engine.replace("torch", "torch FSDP").replace("megatron", "Megatron").replace("deepspeed",
                                                                                                 "DeepSpeed")
        if s.kind == "moe":  # the published MoE runs, one set per GPU
            assert "MoE models judged by" in MODEL_SCOPE_NOTE and s.gpu.split("-")[0] in MODEL_SCOPE_NOTE
            assert "benchmarks/fidelity_moe.py" in MODEL_SCOPE_NOTE
            continue
        if "benchmarks/results" in s.source:  # the GPU campaign's single-GPU runs
            assert f"{s.gpu} also measured on one GPU by optplan's GPU campaign" in MODEL_SCOPE_NOTE
            engine = engine.replace("torch FSDP", "torch")
        assert engine in MODEL_SCOPE_NOTE, engine
        for source in s.source.split(" (")[0].split("; "):
            name = source.split("-")[0].replace("llmfoundry", "llm-foundry").replace("gpu", "GPU campaign")
            assert name.lower() in MODEL_SCOPE_NOTE.lower(), name
    moe_runs = sum(s.runs for s in dom.sets if s.kind == "moe")
    assert f"MoE models judged by {moe_runs} published" in MODEL_SCOPE_NOTE


def test_an_eager_selective_pick_says_its_host_cost_and_what_removes_it() -> None:
    """estimators/selective_host.py: the eager op-level policy costs host time per operator; the checkpointing line
    says so, and a compiled selective plan (the policy traced once) does not."""
    from optplan.planner.rationale import _checkpointing_line
    from optplan.planner.space import build_space

    prof = make_profile().model_copy(update={"eager_layer_ops": {"fp32": 60.0, "amp": 70.0, "bf16": 60.0}})
    cluster = _cluster(find_gpu("H200"), gpus=1)
    space = build_space(prof, cluster, global_batch=8)

    def price(s: Strategy):  # type: ignore[no-untyped-def]
        return estimate(prof, cluster, s)

    eager = estimate(prof, cluster, Strategy(mbs=1, grad_accum=8, checkpointing="selective"))
    line = _checkpointing_line(eager, price, space)
    assert line.startswith("selective (per-op") and "host time per operator" in line and "--compile" in line
    compiled = estimate(prof, cluster, Strategy(mbs=1, grad_accum=8, checkpointing="selective", compile=True))
    assert "host time per operator" not in _checkpointing_line(compiled, price, space)


def test_the_micro_batch_line_gives_the_reason_a_faster_larger_one_was_not_picked() -> None:
    """The line read "2 fits but is not faster (41.6 vs 38.7 samples/s)" when 2 was faster but fitted only at the
    allocator's median margin: each reason is now named with the figures that decide it."""
    from optplan.planner.rationale import _larger_mbs_reason

    cluster = _cluster()
    pick = estimate(make_profile(), cluster, Strategy(dp=8, mbs=4))
    nxt = estimate(make_profile(), cluster, Strategy(dp=8, mbs=8))
    assert nxt.fits and nxt.samples_per_s > pick.samples_per_s
    assert _larger_mbs_reason(nxt, pick).startswith("4 fits but is not faster")  # slower: said as before
    risky = nxt.model_copy(update={"fits_at_high_margin": False})
    assert "fits only at the median allocator margin" in _larger_mbs_reason(pick.model_copy(
        update={"fits_at_high_margin": True}), risky)
    # faster nominally, slower at the slow end of a wider band (e.g. outside the measured domain)
    spread = pick.time.step_s_high / pick.time.step_s  # three times the pick's own band
    wide = nxt.model_copy(update={"time": nxt.time.model_copy(update={"step_s_high": nxt.time.step_s * 3 * spread})})
    line = _larger_mbs_reason(pick, wide)
    assert line.startswith("8 is faster nominally") and "not at the band's slow end" in line, line
    # faster at both ends by less than the tie tolerance: a tie, which the simpler plan wins
    tied = nxt.model_copy(update={"samples_per_s": pick.samples_per_s * 1.02,
                                  "time": pick.time.model_copy(update={"step_s": pick.time.step_s / 1.02 * 2,
                                                                       "step_s_high": pick.time.step_s_high / 1.02 * 2})})
    assert "a tie, which the simpler plan wins" in _larger_mbs_reason(pick, tied)


def test_the_layout_line_compares_model_parallel_plans_on_as_many_gpus_only() -> None:
    """A --gpus-range search ranks plans on several GPU counts: "the best tensor/pipeline plan" must be one on the
    pick's count (it once named a faster plan on more GPUs to justify data parallelism)."""
    from optplan.planner.rationale import _layout_line

    prof = make_profile(params=1_000_000_000, hidden=2048, layers=24)
    cluster = _cluster(gpus=16)
    pick = estimate(prof, cluster, Strategy(dp=8, mbs=4))
    wider = estimate(prof, cluster, Strategy(dp=8, tp=2, mbs=4))  # 16 GPUs
    same = estimate(prof, cluster, Strategy(dp=4, tp=2, mbs=4))  # 8 GPUs
    assert wider.strategy.world_size == 16 and same.strategy.world_size == 8
    assert "tensor/pipeline plan" not in _layout_line(pick, [pick, wider])
    line = _layout_line(pick, [pick, wider, same])
    assert f"the best tensor/pipeline plan ({same.strategy.label()})" in line, line


def test_a_model_that_checkpoints_itself_is_said_so_and_full_checkpointing_adds_only_its_own_recompute() -> None:
    """estimators/own_checkpointing.py: without the plan's checkpointing the recompute is the model's own, and the
    line says so with its time; full checkpointing's cost is what it adds, and its line says the two nest."""
    from optplan.planner.rationale import _checkpointing_line
    from optplan.planner.space import build_space

    plain = make_profile()
    own_flops = 0.5 * plain.fwd_flops_per_sample
    own = plain.model_copy(update={"bwd_flops_per_sample": plain.bwd_flops_per_sample + own_flops,
                                   "self_recompute_flops_per_sample": own_flops})
    cluster = _cluster(find_gpu("H100-SXM"), gpus=1)
    lines = {}
    for name, prof in (("plain", plain), ("own", own)):
        space = build_space(prof, cluster, global_batch=8)

        def price(s: Strategy, prof=prof):  # type: ignore[no-untyped-def]
            return estimate(prof, cluster, s)

        for mode in ("none", "full"):
            pick = estimate(prof, cluster, Strategy(engine="torch", mbs=2, grad_accum=4, checkpointing=mode))
            lines[name, mode] = (_checkpointing_line(pick, price, space), pick)
    assert lines["plain", "none"][0].startswith("no activation checkpointing: activations of")
    line, pick = lines["own", "none"]
    assert line.startswith(f"no activation checkpointing added (the model's own re-runs "
                           f"{pick.time.recompute_s * 1e3:,.0f} ms of the")
    added = [float(re.search(r"full checkpointing would make the step (\d+)% slower \(([\d,]+) ms -> ([\d,]+) ms",
                             lines[k, "none"][0]).group(1)) for k in ("plain", "own")]
    assert added[1] <= added[0]  # the model's own recompute is not counted again as what full would add
    full_plain, none_plain = lines["plain", "full"][1], lines["plain", "none"][1]
    assert added[0] == round(100 * (full_plain.time.step_s / none_plain.time.step_s - 1))  # the whole step's change
    assert "also checkpoints itself: both re-run" in lines["own", "full"][0]
    assert "itself" not in lines["plain", "full"][0]


def test_a_lower_zero_stage_that_does_not_fit_adds_up_to_its_total() -> None:
    """'under ZeRO-0 ... the model states of A do not fit beside B of activations and C of buffers and overhead
    (T > capacity)': A + B + C is T (it named states and activations only, 50 GiB short of the total it printed)."""
    from optplan.estimators.arch import parse_arch, profile_from_arch

    prof = profile_from_arch(parse_arch("layers=32,hidden=4096,heads=32,seq=4096"))
    rec = recommend(prof, Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8), engines=["deepspeed"])
    (line,) = [r for r in rec.rationale if "do not fit beside" in r]
    states, act, rest, total, cap = (float(x) for x in re.findall(r"([\d.]+) GiB", line))
    assert "of buffers and overhead" in line and total > cap
    assert states + act + rest == pytest.approx(total, abs=0.15)  # each rounded to 0.1 GiB
