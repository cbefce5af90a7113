"""FSDP under torch pipelining (estimators/pipeline_fsdp.py): a stage gathers its weights and reduce-scatters its
gradients once per step, not once per micro-batch, and holds the gathered stage and its fp32 accumulated
gradients meanwhile."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.comm import link_for, ring_all_gather_s, ring_reduce_scatter_s
from optplan.estimators.efficiency import efficiency_for
from optplan.estimators.estimate import estimate
from optplan.estimators.fsdp_grad_sync import syncs_once_per_step
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.memory import buffer_items, buffer_moments, stage_params
from optplan.estimators.parallel import placement
from optplan.estimators.pipeline_fsdp import keeps_stage_unsharded
from optplan.estimators.precision import get_recipe
from optplan.estimators.strategy import Strategy

LLAMA = "layers=16,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0,seq=4096"


def _cluster(gpus: int) -> Cluster:
    return Cluster(gpu=find_gpu("H100-SXM"), gpus=gpus, gpus_per_node=8, inter_node_bandwidth_bytes_per_s=50e9)


def _torch(**kw: object) -> Strategy:
    base: dict[str, object] = dict(engine="torch", fsdp="full", precision="bf16", dp=4, tp=2, pp=2, mbs=1,
                                   grad_accum=8, checkpointing="full")
    base.update(kw)
    return Strategy(**base)  # type: ignore[arg-type]


def test_which_plans_keep_the_stage_unsharded() -> None:
    assert keeps_stage_unsharded(_torch())
    assert keeps_stage_unsharded(_torch(fsdp="grad_op"))
    assert not keeps_stage_unsharded(_torch(pp=1))
    assert not keeps_stage_unsharded(_torch(fsdp="none"))
    assert not keeps_stage_unsharded(Strategy(engine="megatron", zero=1, dp=4, tp=2, pp=2, grad_accum=8))
    assert syncs_once_per_step(_torch())  # one gather and reduce-scatter per step
    assert not syncs_once_per_step(_torch(pp=1))  # one per micro-batch


def test_data_parallel_traffic_is_one_gather_and_one_reduce_per_step() -> None:
    prof = profile_from_arch(parse_arch(LLAMA))
    cluster = _cluster(16)
    times = {m: estimate(prof, cluster, _torch(grad_accum=m)).time for m in (4, 8, 16)}
    # the same bytes whatever the micro-batches
    assert times[4].dp_comm_s == pytest.approx(times[16].dp_comm_s, rel=1e-9)
    # by hand: one ring all-gather of the stage's bf16 weights and one reduce-scatter of its fp32 gradients over the
    # 4 FSDP ranks of the shard group, on the link timing.py prices that group at
    s = _torch()
    pl = placement(s, cluster.gpus_per_node)
    eff = efficiency_for(cluster.gpu)
    link = link_for(pl.shard, cluster, intra_fraction=eff.intra_node_link_fraction,
                    intra_alpha_s=eff.intra_node_alpha_s)
    psi = max(stage_params(prof, s, 0), stage_params(prof, s, 1))
    by_hand = (ring_all_gather_s(psi * 2, pl.shard.ranks, link.bandwidth_bytes_per_s, link.alpha_s)
               + ring_reduce_scatter_s(psi * 4, pl.shard.ranks, link.bandwidth_bytes_per_s, link.alpha_s))
    assert pl.shard.ranks == 4
    assert times[8].dp_comm_s == pytest.approx(by_hand, rel=1e-6)
    # without pipelining the same plan gathers twice and reduces once per micro-batch
    flat = {m: estimate(prof, _cluster(8), _torch(pp=1, grad_accum=m)).time for m in (4, 8)}
    assert flat[8].dp_comm_s == pytest.approx(2 * flat[4].dp_comm_s, rel=1e-9)


def test_memory_holds_the_gathered_stage_and_its_fp32_gradients() -> None:
    prof = profile_from_arch(parse_arch(LLAMA))
    s = _torch()
    items = buffer_items(prof, s, stage=0)
    psi = stage_params(prof, s, 0)
    weight = get_recipe("bf16").weight_bytes
    assert items["fsdp_pipeline_unsharded_params"] == round(psi * weight)
    assert items["fsdp_pipeline_accumulated_grads"] == round(psi * 4)
    assert not {"fsdp_unsharded_units", "fsdp_prefetched_unit", "fsdp_root_unit"} & set(items)
    moments = buffer_moments(prof, s, stage=0)
    assert "optimizer_step" not in (moments["fsdp_pipeline_unsharded_params"] or {"optimizer_step"})
    assert "forward" not in (moments["fsdp_pipeline_accumulated_grads"] or {"forward"})
    # the peak grows by about those bytes against per-unit gathering (the same plan without pipelining keeps two
    # units): a 16-layer model's 8-layer stage is far more than two units
    assert items["fsdp_pipeline_unsharded_params"] > 6 * buffer_items(prof, _torch(pp=1), stage=0)[
        "fsdp_unsharded_units"]
