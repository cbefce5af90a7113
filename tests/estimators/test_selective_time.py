"""The time of the op-level selective policy (estimators/selective.py): the matmul FLOPs the profile measured it
re-running, on the torch and DeepSpeed engines; Megatron's selective recomputation keeps the attention core."""

from __future__ import annotations

import pytest

from optplan.estimators.compute import compute_time
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.selective import recompute_flops_per_sample, recomputed_tp_collectives, runs_op_policy
from optplan.estimators.strategy import Strategy
from tests.factories import make_profile

H100 = find_gpu("H100-SXM")


def test_the_hardware_flops_count_what_the_policy_re_runs() -> None:
    base = make_profile()
    recompute = 0.05 * base.fwd_flops_per_sample
    profile = base.model_copy(update={"selective_recompute_flops_per_sample": recompute})
    cluster = Cluster(gpu=H100, gpus=1, gpus_per_node=1)
    s = Strategy(precision="bf16", engine="torch", mbs=4, checkpointing="selective")
    assert runs_op_policy(s) and recompute_flops_per_sample(profile, s) == recompute
    t = estimate(profile, cluster, s).time
    assert t.hfu / t.mfu == pytest.approx((profile.train_flops_per_sample + recompute)
                                          / profile.train_flops_per_sample, rel=1e-9)
    assert t.recompute_s > 0
    less = estimate(profile.model_copy(update={"selective_recompute_flops_per_sample": recompute / 2}), cluster, s)
    assert less.time.recompute_s < t.recompute_s  # the measured FLOPs drive it
    megatron = Strategy(precision="bf16", engine="megatron", mbs=4, checkpointing="selective")
    assert recompute_flops_per_sample(profile, megatron) is None  # the attention core, from the shape
    assert recompute_flops_per_sample(base, s) is None  # not measured: the shape's formula


def test_the_flops_only_model_adds_the_measured_recompute() -> None:
    profile = make_profile(tokens=False).model_copy(update={"transformer": None,
                                                             "selective_recompute_flops_per_sample": 1e9})
    s = Strategy(precision="bf16", engine="torch", mbs=2, grad_accum=3, checkpointing="selective")
    ct = compute_time(profile, s, H100)
    assert ct.recompute_s == pytest.approx(ct.compute_s * 1e9 / profile.train_flops_per_sample, rel=1e-9)
    assert compute_time(profile, s.model_copy(update={"checkpointing": "none"}), H100).recompute_s == 0


def test_the_policy_issues_the_tensor_parallel_all_gathers_again() -> None:
    # torchtitan's save list keeps the reduce-scatters, not the all-gathers: under sequence parallelism backward
    # re-issues each sublayer's all-gather, half of what full recomputation's re-run forward issues again
    profile = make_profile()
    cluster = Cluster(gpu=H100, gpus=8, gpus_per_node=8)

    def tp_comm_s(checkpointing: str, engine: str = "torch", sp: bool = True) -> float:
        s = Strategy(precision="bf16", engine=engine, mbs=4, tp=4, dp=2, sp=sp, checkpointing=checkpointing)
        return estimate(profile, cluster, s).time.tp_comm_s

    none, selective, full = tp_comm_s("none"), tp_comm_s("selective"), tp_comm_s("full")
    assert none < selective < full
    assert selective - none == pytest.approx((full - none) / 2, rel=1e-9)
    # without sequence parallelism: the attention's all-reduce alone, again half of full recomputation's two
    plain = {mode: tp_comm_s(mode, sp=False) for mode in ("none", "selective", "full")}
    assert plain["selective"] - plain["none"] == pytest.approx((plain["full"] - plain["none"]) / 2, rel=1e-9)
    assert recomputed_tp_collectives(Strategy(engine="torch", tp=4, checkpointing="selective"), 2) == 1.0
    assert recomputed_tp_collectives(Strategy(engine="torch", tp=4, sp=True, checkpointing="selective"), 1) == 0.5
    assert recomputed_tp_collectives(Strategy(engine="torch", tp=1, checkpointing="selective"), 2) == 0.0
    # Megatron's selective recomputation re-runs the attention core, no collective
    assert tp_comm_s("selective", engine="megatron") == pytest.approx(tp_comm_s("none", engine="megatron"), rel=1e-9)
