"""Expert parallelism (Megatron-Core's expert-model-parallel group): which states it divides, what it costs in
all-to-all time, and the strategies it refuses."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.comm import all_to_all_s
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import estimate
from optplan.estimators.expert_parallel import routed_params
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.memory import model_states, stage_params
from optplan.estimators.strategy import Strategy
from optplan.estimators.validity import check_strategy

MIXTRAL = "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000,gated=1,tied=0,experts=8,topk=2,seq=4096"
EXPERT = 3 * 4096 * 14336


@pytest.fixture(scope="module")
def mixtral():  # type: ignore[no-untyped-def]
    return profile_from_arch(parse_arch(MIXTRAL))


def _s(**kw: object) -> Strategy:
    base = {"engine": "megatron", "precision": "bf16", "tp": 2, "dp": 32, "zero": 1, "mbs": 1, "grad_accum": 8,
            "checkpointing": "full"}
    return Strategy(**{**base, **kw})  # type: ignore[arg-type]


def test_ep_divides_the_routed_experts_only(mixtral) -> None:  # type: ignore[no-untyped-def]
    assert routed_params(mixtral) == 32 * 8 * EXPERT
    one, four = stage_params(mixtral, _s()), stage_params(mixtral, _s(ep=4))
    assert one - four == pytest.approx(32 * 8 * EXPERT / 2 * (1 - 1 / 4))  # per tp rank, 3/4 of the experts gone


def test_ep_shrinks_unsharded_states_not_sharded_ones(mixtral) -> None:  # type: ignore[no-untyped-def]
    """Megatron's distributed optimizer shards the expert states over dp·cp/ep ranks: per rank the same share as
    without ep; the bf16 weights and fp32 main gradients (unsharded under ZeRO-1) shrink by the experts' 1 - 1/ep."""
    a, b = model_states(mixtral, _s()), model_states(mixtral, _s(ep=8))
    assert a.optimizer_bytes == b.optimizer_bytes
    gone = 32 * 8 * EXPERT / 2 * (1 - 1 / 8)
    assert a.params_bytes - b.params_bytes == pytest.approx(2 * gone, rel=1e-6)
    assert a.grads_bytes - b.grads_bytes == pytest.approx(4 * gone, rel=1e-6)  # Megatron's fp32 main grads


def test_all_to_all_by_hand() -> None:
    # 8 ranks in one node, 80 MB per rank: 7/8 of it over NVLink at 360 GB/s, 7 latency steps of 5 us
    assert all_to_all_s(80e6, 8, 8, 360e9, 50e9, 5e-6) == pytest.approx(7 / 8 * 80e6 / 360e9 + 7 * 5e-6)
    # 16 ranks, 8 per node: half the bytes leave the node over each GPU's 50 GB/s NIC, which decides
    assert all_to_all_s(80e6, 16, 8, 360e9, 50e9, 0.0) == pytest.approx(8 / 16 * 80e6 / 50e9)
    assert all_to_all_s(80e6, 1, 8, 360e9, 50e9, 0.0) == 0.0


def test_all_to_all_time_grows_when_the_expert_group_leaves_the_node(mixtral) -> None:  # type: ignore[no-untyped-def]
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8)
    inside = estimate(mixtral, cluster, _s(ep=4)).time  # tp 2 x ep 4 = 8 GPUs: one node
    across = estimate(mixtral, cluster, _s(ep=8)).time  # 16 GPUs: two nodes
    assert 0 < inside.ep_comm_s < across.ep_comm_s
    assert estimate(mixtral, cluster, _s(etp=1)).time.ep_comm_s == 0.0  # every expert whole and local: no dispatch
    # split over tp 2 (etp = tp), the dispatcher still gathers each rank's routed copies over the pair
    assert 0 < estimate(mixtral, cluster, _s()).time.ep_comm_s < inside.ep_comm_s
    # fewer local experts: less of the grouped GEMM's weight reading per pass
    assert inside.memory_bound_s < estimate(mixtral, cluster, _s()).time.memory_bound_s


def test_moe_compute_counts_active_experts(mixtral) -> None:  # type: ignore[no-untyped-def]
    """The step's model FLOPs are the profile's (routed experts only): MFU in a sane range, not the 8-expert
    dense cost."""
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8)
    t = estimate(mixtral, cluster, _s(ep=4)).time
    assert 0.2 < t.mfu < 0.6


@pytest.mark.parametrize(("strategy", "message"), [
    ({"ep": 3}, "does not divide the 8 experts"),
])
def test_bad_ep_for_the_model(mixtral, strategy: dict, message: str) -> None:  # type: ignore[no-untyped-def]
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=96, gpus_per_node=8)
    with pytest.raises(OptplanError, match=message):
        check_strategy(mixtral, cluster, _s(dp=48, **strategy))


def test_bad_ep_strategies() -> None:
    dense = profile_from_arch(parse_arch("layers=2,hidden=64,heads=4,seq=32"))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8)
    with pytest.raises(OptplanError, match="has none"):
        check_strategy(dense, cluster, Strategy(engine="megatron", dp=8, ep=2))
    with pytest.raises(ValueError, match="--engine megatron"):
        Strategy(engine="deepspeed", dp=8, ep=2)
    with pytest.raises(ValueError, match="must divide the data-parallel"):
        Strategy(engine="megatron", dp=6, ep=4)


def test_the_all_to_all_receive_buffer_is_named(mixtral) -> None:  # type: ignore[no-untyped-def]
    from optplan.estimators.memory import buffer_items

    items = buffer_items(mixtral, _s(ep=4))
    # one layer's routed copies: 4096 tokens / tp 2 (sequence parallel) x top-2 x h x 2 bytes
    assert items["moe_all_to_all_receive"] == 4096 // 2 * 2 * 4096 * 2
    assert "moe_all_to_all_receive" not in buffer_items(mixtral, _s())


def test_moe_step_times_rest_on_the_measured_moe_runs(mixtral) -> None:  # type: ignore[no-untyped-def]
    """On the H100 the band of an MoE plan rests on the published MoE runs (time_domain.yaml's ``moe`` sets, from
    benchmarks/fidelity_moe.py); on a GPU without such runs it says MoE was never measured there and widens."""
    from optplan.estimators.uncertainty import time_band, time_domain

    h100 = Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8)
    est = estimate(mixtral, h100, _s(ep=4))
    band = time_band(mixtral, _s(ep=4), h100, mfu=est.time.mfu)
    moe_set = next(s for s in time_domain().sets if s.gpu == "H100-SXM" and s.kind == "moe")
    assert band.basis.startswith(moe_set.name[:20]) or moe_set.name in band.basis
    assert not any("no MoE model" in r for r in band.outside)
    # the band is at least the measured MoE runs' spread (5th-95th percentile of measured / predicted)
    assert band.low <= moe_set.ratio_low + 1e-9 and band.high >= moe_set.ratio_high - 1e-9
    a100 = Cluster(gpu=find_gpu("A100-80GB"), gpus=64, gpus_per_node=8)
    far = estimate(mixtral, a100, _s(ep=4))
    assert any("no MoE model was measured on A100-80GB" in n and "all-to-all" in n for n in far.notes)
    dense = profile_from_arch(parse_arch(MIXTRAL.replace(",experts=8,topk=2", "")))
    d = estimate(dense, a100, _s())
    assert not any("MoE" in n for n in d.notes)
    # wider than the same plan of the dense model: two unmeasured things more
    assert far.time.step_s_high / far.time.step_s > d.time.step_s_high / d.time.step_s
