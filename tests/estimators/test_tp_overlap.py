"""Megatron's communication overlaps (estimators/tp_overlap.py): the exposed time by hand, what each overlap hides in
a whole estimate (and that the total communication stays the same), and the rules the plan must keep."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from optplan.estimators.tp_overlap import (
    DP_OVERLAP_INTERFERENCE,
    TP_OVERLAP_INTERFERENCE,
    TP_OVERLAP_SPLITS,
    exposed_p2p_s,
    interleaved_dp_s,
    overlapped_dp_s,
    overlapped_tp_s,
    overlaps_p2p,
)

LLAMA70 = "layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256,gated=1,tied=0,seq=8192"


def _megatron(**kw: object) -> Strategy:
    base: dict[str, object] = dict(engine="megatron", precision="bf16", zero=1, dp=2, tp=4, pp=8, vpp=5, mbs=1,
                                   grad_accum=64, checkpointing="none")
    base.update(kw)
    return Strategy(**base)  # type: ignore[arg-type]


def _cluster() -> Cluster:
    return Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8, inter_node_bandwidth_bytes_per_s=50e9)


def test_exposed_time_by_hand() -> None:
    # hidden behind a longer GEMM: one split stays, the rest costs its interference
    assert overlapped_tp_s(1.0, 3.0) == pytest.approx(1 / TP_OVERLAP_SPLITS + TP_OVERLAP_INTERFERENCE * 0.75)
    # longer than the GEMM: the excess stays
    assert overlapped_tp_s(2.0, 1.0) == pytest.approx(1.0 + TP_OVERLAP_INTERFERENCE * 1.0)
    assert overlapped_tp_s(0.0, 1.0) == 0.0
    assert overlapped_dp_s(1.0, 5.0, 0.1) == pytest.approx(0.1 + DP_OVERLAP_INTERFERENCE * 0.9)
    assert overlapped_dp_s(1.0, 0.0, 0.1) == pytest.approx(1.0)


def test_overlap_hides_tensor_and_data_parallel_time_not_bytes() -> None:
    prof = profile_from_arch(parse_arch(LLAMA70))
    plain = estimate(prof, _cluster(), _megatron()).time
    over = estimate(prof, _cluster(), _megatron(comm_overlap=True)).time
    # the same collectives move the same bytes
    assert over.comm_s == pytest.approx(plain.comm_s, rel=1e-9)
    assert over.dp_comm_s == pytest.approx(plain.dp_comm_s, rel=1e-9)
    # tensor parallelism: at least one split and its interference stay, at most all of it
    low = 1 / TP_OVERLAP_SPLITS + TP_OVERLAP_INTERFERENCE * (1 - 1 / TP_OVERLAP_SPLITS)
    assert low * plain.tp_comm_s - 1e-9 <= over.tp_comm_s < plain.tp_comm_s
    assert over.exposed_dp_comm_s < plain.exposed_dp_comm_s == pytest.approx(plain.dp_comm_s)
    saved = (plain.tp_comm_s - over.tp_comm_s) + (plain.exposed_dp_comm_s - over.exposed_dp_comm_s)
    assert plain.step_s - over.step_s == pytest.approx(saved, rel=0.05)


def test_interleaved_chunks_issue_their_collectives_one_by_one() -> None:
    # one chunk (no interleaving): the collective behind one pass, as before
    assert interleaved_dp_s(1.0, 0.3, 0.05, chunks=1, rounds=8) == pytest.approx(overlapped_dp_s(1.0, 0.3, 0.05))
    # five chunks, eight micro-batches a round: all but the last chunk's share hide behind the cool-down
    share = 1.0 / 5
    assert interleaved_dp_s(1.0, 0.1, 0.05, chunks=5, rounds=8) == pytest.approx(
        (share - 0.1) + DP_OVERLAP_INTERFERENCE * (1.0 - (share - 0.1)))
    # a collective longer than every pass after the first chunk's: the excess stays, as without interleaving
    window = (4 * 8 + 1) * 0.01
    assert interleaved_dp_s(2.0, 0.01, 0.05, chunks=5, rounds=8) == pytest.approx(
        (2.0 - window) + DP_OVERLAP_INTERFERENCE * window)
    assert interleaved_dp_s(0.0, 0.1, 0.05, chunks=5, rounds=8) == 0.0


def test_interleaving_hides_the_distributed_optimizer_collectives() -> None:
    # Megatron issues each chunk's reduce-scatter when its last backward ends (schedules.py): with 5 chunks on 8
    # stages the 70B's data-parallel collectives hide behind the cool-down; without interleaving they cannot
    prof = profile_from_arch(parse_arch(LLAMA70))
    slow_dp = Cluster(gpu=find_gpu("H100-SXM"), gpus=256, gpus_per_node=8, inter_node_bandwidth_bytes_per_s=5e9)
    inter = estimate(prof, slow_dp, _megatron(comm_overlap=True, dp=8)).time
    plain = estimate(prof, slow_dp, _megatron(comm_overlap=True, dp=8, vpp=1)).time
    assert inter.dp_comm_s == pytest.approx(plain.dp_comm_s, rel=1e-6)  # the same bytes
    assert inter.exposed_dp_comm_s < 0.5 * plain.exposed_dp_comm_s
    off = estimate(prof, slow_dp, _megatron(dp=8)).time  # no overlap: all of it exposed, chunks or not
    assert off.exposed_dp_comm_s == pytest.approx(off.dp_comm_s, rel=1e-6)


def test_interleaved_sends_run_behind_other_chunks() -> None:
    prof = profile_from_arch(parse_arch(LLAMA70))
    interleaved = estimate(prof, _cluster(), _megatron()).time
    one_f_one_b = estimate(prof, _cluster(), _megatron(vpp=1)).time
    assert overlaps_p2p(_megatron()) and not overlaps_p2p(_megatron(vpp=1))
    assert interleaved.pp_comm_s == 0.0 < one_f_one_b.pp_comm_s
    # still counted as communication: v-fold the 1F1B sends (each chunk sends its own activations)
    p2p_total = interleaved.comm_s - interleaved.tp_comm_s - interleaved.dp_comm_s
    assert p2p_total == pytest.approx(5 * one_f_one_b.pp_comm_s, rel=1e-6)


def test_sends_slower_than_the_compute_they_hide_behind_pace_the_stage() -> None:
    assert exposed_p2p_s(1.0, 3.0, None) == 1.0  # 1F1B: no overlap
    assert exposed_p2p_s(1.0, 3.0, 0.0) == 0.0  # hidden
    assert exposed_p2p_s(5.0, 3.0, 0.0) == pytest.approx(2.0)  # the excess stays
    assert exposed_p2p_s(1.0, 3.0, 0.25) == pytest.approx(0.25)  # a stated share stays
    # a whole estimate on a slow inter-node link: the interleaved sends no longer vanish from the step
    prof = profile_from_arch(parse_arch(LLAMA70))
    slow = Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8, inter_node_bandwidth_bytes_per_s=12.5e9 / 8)
    plans = {v: estimate(prof, slow, _megatron(tp=8, dp=1, vpp=v, grad_accum=64)).time for v in (1, 2, 10)}
    assert plans[2].pp_comm_s == 0.0  # two chunks: the sends still fit behind the compute
    sends = plans[10].comm_s - plans[10].tp_comm_s - plans[10].dp_comm_s
    assert sends > 2 * plans[10].compute_s  # ten chunks: more sending than computing ...
    rest = plans[10].step_s - plans[10].pp_comm_s
    assert plans[10].pp_comm_s >= sends - rest > 0  # ... and no more hides than the rest of the step lasts
    assert plans[10].step_s > plans[1].step_s  # so ten-fold interleaving is not the faster plan


def test_rules() -> None:
    with pytest.raises(ValueError, match="--engine megatron"):
        Strategy(engine="torch", fsdp="full", dp=8, comm_overlap=True)
    with pytest.raises(ValueError, match="sequence parallelism"):
        _megatron(sp=False, comm_overlap=True)
    assert "comm-overlap" in _megatron(comm_overlap=True).label()
    _megatron(tp=1, dp=8, comm_overlap=True, sp=False)  # no tensor parallelism: the data-parallel overlap alone
