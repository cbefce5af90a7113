"""Compute, communication and estimate figures against hand-computed values."""

from __future__ import annotations

import pytest
from conftest import make_gpu, make_profile

from optplan.estimators.comm import (
    LINK_EFFICIENCY,
    data_parallel_link,
    ring_all_gather_s,
    ring_all_reduce_s,
    ring_reduce_scatter_s,
)
from optplan.estimators.compute import MAX_EFFICIENCY, compute_time, matmul_efficiency
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import comm_time_s, estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.strategy import Strategy


def test_ring_collectives_hand_checked() -> None:
    # 1 GB over 8 ranks at 100 GB/s: all-reduce 2·7/8·10 ms = 17.5 ms; RS/AG half that.
    assert ring_all_reduce_s(1e9, 8, 100e9, 0.0) == pytest.approx(17.5e-3)
    assert ring_reduce_scatter_s(1e9, 8, 100e9, 0.0) == pytest.approx(8.75e-3)
    assert ring_all_gather_s(1e9, 8, 100e9, 0.0) == pytest.approx(8.75e-3)
    assert ring_all_reduce_s(1e9, 8, 100e9, 1e-5) == pytest.approx(17.5e-3 + 14e-5)
    assert ring_all_reduce_s(1e9, 1, 100e9, 1e-5) == 0.0


def test_link_choice_by_placement() -> None:
    gpu = make_gpu()
    c = Cluster(gpu=gpu, gpus=16, gpus_per_node=8, inter_node_bandwidth_bytes_per_s=50e9)
    assert data_parallel_link(c, 8)[0] == pytest.approx(400e9 * LINK_EFFICIENCY)
    assert data_parallel_link(c, 16)[0] == pytest.approx(50e9 * LINK_EFFICIENCY)


def test_compute_time_is_flops_over_peak_times_efficiency() -> None:
    prof = make_profile(params=1_000_000_000, seq=1024)
    gpu = make_gpu()
    s = Strategy(precision="bf16", mbs=4, grad_accum=2)
    eff = matmul_efficiency(prof, s)
    assert eff == pytest.approx(MAX_EFFICIENCY["bf16"] * 4096 / (4096 + 512))
    ct = compute_time(prof, s, gpu)
    assert ct.compute_s == pytest.approx(6e9 * 1024 * 8 / (1000e12 * eff))
    assert ct.recompute_s == 0.0
    ck = compute_time(prof, s.model_copy(update={"checkpointing": "full"}), gpu)
    assert ck.recompute_s == pytest.approx(ct.compute_s / 3)
    fp32 = compute_time(prof, s.model_copy(update={"precision": "fp32"}), gpu)
    assert fp32.compute_s > 10 * ct.compute_s


def test_comm_volume_by_zero_stage() -> None:
    prof = make_profile(params=1_000_000_000)
    c = Cluster(gpu=make_gpu(), gpus=8, gpus_per_node=8)
    bw, a = data_parallel_link(c, 8)
    grads = 2e9
    z0 = comm_time_s(prof, Strategy(precision="bf16", zero=0, dp=8, grad_accum=4), c)
    assert z0 == pytest.approx(ring_all_reduce_s(grads, 8, bw, a))
    z2 = comm_time_s(prof, Strategy(precision="bf16", zero=2, dp=8, grad_accum=4), c)
    assert z2 == pytest.approx(4 * ring_reduce_scatter_s(grads, 8, bw, a) + ring_all_gather_s(grads, 8, bw, a))
    z3 = comm_time_s(prof, Strategy(precision="bf16", zero=3, dp=8, grad_accum=1), c)
    assert z3 == pytest.approx(3 * ring_reduce_scatter_s(grads, 8, bw, a))


def test_estimate_throughput_and_mfu_definitions() -> None:
    prof = make_profile()
    c = Cluster(gpu=make_gpu(), gpus=8, gpus_per_node=8)
    s = Strategy(precision="bf16", zero=1, mbs=8, grad_accum=2, dp=8)
    e = estimate(prof, c, s)
    t = e.time
    assert t.step_s == pytest.approx(t.compute_s + t.recompute_s + t.memory_bound_s + t.optimizer_s
                                    + t.exposed_comm_s)
    assert e.global_batch == 128
    assert e.samples_per_s == pytest.approx(128 / t.step_s)
    assert e.tokens_per_s == pytest.approx(e.samples_per_s * 1024)
    assert e.mfu == pytest.approx(prof.train_flops_per_sample * e.samples_per_s / 8 / 1000e12)
    assert e.hfu == pytest.approx(e.mfu)
    ck = estimate(prof, c, s.model_copy(update={"checkpointing": "full"}))
    assert ck.hfu == pytest.approx(ck.mfu * 4 / 3)
    # the same figures under time.* (the keys issue 3 pins), equal to the top-level ones
    for est in (e, ck):
        t = est.time
        assert (t.samples_per_s, t.tokens_per_s, t.mfu, t.hfu, t.model_tflops_per_gpu) == (
            est.samples_per_s, est.tokens_per_s, est.mfu, est.hfu, est.model_tflops_per_gpu)
        assert t.hardware_tflops_per_gpu == pytest.approx(t.model_tflops_per_gpu * t.hfu / t.mfu)
        assert t.bubble_s == 0.0
    assert 0 < e.mfu < MAX_EFFICIENCY["bf16"]


def test_estimate_refuses_missing_math_and_too_many_ranks() -> None:
    prof = make_profile()
    v100like = Cluster(gpu=make_gpu(bf16=False), gpus=8, gpus_per_node=8)
    with pytest.raises(OptplanError, match="no bf16 math"):
        estimate(prof, v100like, Strategy(precision="bf16", dp=8))
    with pytest.raises(OptplanError, match="exceeds"):
        estimate(prof, v100like, Strategy(precision="fp16", dp=16))


def test_not_fitting_reason_names_largest_part() -> None:
    prof = make_profile(params=20_000_000_000)
    e = estimate(prof, Cluster(gpu=make_gpu(), gpus=1, gpus_per_node=1), Strategy(precision="bf16"))
    assert not e.fits
    assert "does not fit" in e.reason and "optimizer states" in e.reason


def test_memory_bound_term_is_activation_traffic_over_bandwidth() -> None:
    prof = make_profile()
    gpu = make_gpu()
    s = Strategy(precision="bf16", mbs=4, grad_accum=3)
    traffic = prof.activation("bf16", "none").bytes_at(4)
    assert compute_time(prof, s, gpu).memory_bound_s == pytest.approx(3 * 3 * traffic / 2e12)
    ck = compute_time(prof, s.model_copy(update={"checkpointing": "full"}), gpu)
    assert ck.memory_bound_s == pytest.approx(3 * 4 * traffic / 2e12)


def test_offloaded_optimizer_shares_the_host_between_ranks() -> None:
    prof = make_profile(params=1_000_000_000)
    s = Strategy(precision="bf16", zero=2, dp=8, offload_optimizer="cpu", grad_accum=4)
    one = compute_time(prof, s, make_gpu(), ranks_per_node=1).optimizer_s
    eight = compute_time(prof, s, make_gpu(), ranks_per_node=8).optimizer_s
    shard = 1e9 / 8
    pcie = shard * (4 * 2 + 2) / 25e9
    assert eight - pcie == pytest.approx(8 * (one - pcie))


def test_mfu_uses_one_16bit_reference_for_every_precision() -> None:
    prof = make_profile()
    c = Cluster(gpu=make_gpu(), gpus=8, gpus_per_node=8)
    fp32 = estimate(prof, c, Strategy(precision="fp32", mbs=4, dp=8))
    bf16 = estimate(prof, c, Strategy(precision="bf16", mbs=4, dp=8))
    assert fp32.mfu == pytest.approx(prof.train_flops_per_sample * fp32.samples_per_s / 8 / 1000e12)
    assert (fp32.mfu < bf16.mfu) == (fp32.samples_per_s < bf16.samples_per_s)
