"""The search's partial-checkpointing candidates (planner/partial.py): for a fitting plan with full checkpointing, the
fewest first blocks of each stage to checkpoint that still fit, in each memory class, found and picked."""

from __future__ import annotations

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.estimate import Estimate, estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from optplan.planner.partial import can_be_partial, fewest_checkpointed, fits_robustly
from optplan.planner.recommend import recommend

LLAMA_8K = profile_from_arch(parse_arch("layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,"
                                        "tied=0", seq_len=8192))
H100 = Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8)
FULL = Strategy(precision="bf16", engine="torch", fsdp="grad_op", dp=8, mbs=1, grad_accum=8, checkpointing="full")


def price(s: Strategy) -> Estimate:
    return estimate(LLAMA_8K, H100, s)


def test_the_fewest_blocks_that_fit_in_each_class() -> None:
    median = fewest_checkpointed(price, FULL, 32)
    robust = fewest_checkpointed(price, FULL, 32, fits_robustly)
    assert median is not None and robust is not None
    n, r = median.strategy.checkpoint_layers, robust.strategy.checkpoint_layers
    assert n is not None and r is not None and 1 < n <= r < 32
    assert median.fits and not price(FULL.model_copy(update={"checkpoint_layers": n - 1})).fits
    assert fits_robustly(robust) and not fits_robustly(price(FULL.model_copy(update={"checkpoint_layers": r - 1})))
    # fewer blocks recomputed, faster than every block
    assert median.time.step_s < robust.time.step_s < price(FULL).time.step_s
    # searching the robust class from the median count up finds the same count
    assert fewest_checkpointed(price, FULL, 32, fits_robustly, at_least=n) == robust


def test_no_candidate_where_it_cannot_be_or_need_not_be() -> None:
    assert not can_be_partial(FULL.model_copy(update={"checkpointing": "selective"}), 32)
    assert not can_be_partial(FULL, 1)  # one block: nothing to leave out
    assert not can_be_partial(FULL, None)
    roomy = FULL.model_copy(update={"fsdp": "full"})
    short = profile_from_arch(parse_arch("layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,"
                                         "tied=0", seq_len=2048))
    assert estimate(short, H100, roomy.model_copy(update={"checkpointing": "none"})).fits
    found = fewest_checkpointed(lambda s: estimate(short, H100, s), roomy, 32)
    assert found is not None and found.strategy.checkpoint_layers == 1  # one block is enough: the answer
    tight = FULL.model_copy(update={"mbs": 8, "grad_accum": 1})  # even every block but one does not fit
    assert not price(tight.model_copy(update={"checkpoint_layers": 31})).fits
    assert fewest_checkpointed(price, tight, 32) is None


def test_recommend_picks_partial_checkpointing_when_no_checkpointing_does_not_fit() -> None:
    """Searching none and partial (with full): without checkpointing nothing fits at micro-batch 1; the pick
    checkpoints fewer blocks than all, and the rationale says which and what all would cost. Naming full alone
    searches every block only."""
    only_full = recommend(LLAMA_8K, H100, global_batch=64, engines=("torch",), checkpointing=("none", "full"))
    assert only_full.plan.checkpoint_layers is None
    assert all(a.plan.checkpoint_layers is None for a in only_full.alternatives)
    rec = recommend(LLAMA_8K, H100, global_batch=64, engines=("torch",), checkpointing=("none", "partial"))
    pick = rec.plan
    assert pick.checkpointing == "full" and pick.checkpoint_layers is not None and pick.checkpoint_layers < 32
    assert rec.estimate.fits_at_high_margin
    every = price(pick.model_copy(update={"checkpoint_layers": None}))
    assert rec.estimate.time.step_s < every.time.step_s
    line = next(x for x in rec.rationale if "activation checkpointing" in x)
    assert f"first {pick.checkpoint_layers} blocks" in line and "every block" in line


def test_samplers_price_partial_checkpointing_as_the_enumeration_does() -> None:
    """NSGA-II and TPE draw full checkpointing and price its partial plans with it: the trial records the best of
    them, and the partial plans are among those ranked (they were left out before)."""
    from optplan.planner.search import search
    from optplan.planner.space import build_space

    space = build_space(LLAMA_8K, H100, global_batch=64, engines=("torch",), checkpointing=("none", "partial"))
    assert space.partial_checkpointing
    enum = search(LLAMA_8K, H100, space, method="enumerate")
    assert enum.feasible[0].strategy.checkpoint_layers is not None
    assert enum.evaluated >= len(enum.feasible)  # the partial search's probes count as priced (they were not)
    for method in ("nsga2", "tpe"):
        found = search(LLAMA_8K, H100, space, method=method, n_trials=80, seed=3)  # type: ignore[arg-type]
        partial = [e for e in found.feasible if e.strategy.checkpoint_layers is not None]
        assert partial, method
        assert all(0 < (e.strategy.checkpoint_layers or 0) < 32 for e in partial)
        recorded = [t.user_attrs["strategy"].get("checkpoint_layers") for t in found.study.trials
                    if t.state.name == "COMPLETE"]
        assert any(n is not None for n in recorded), method  # a trial stands for its best plan
        assert found.feasible[0].strategy.checkpoint_layers is not None, method
