"""When torch FSDP reduces gradients under accumulation (estimators/fsdp_grad_sync.py): once per step holds the
unsharded gradients through the micro-batches and saves grad_accum - 1 reduce-scatters; the reduce dtype follows
FSDP2's policy (fp32 under the mixed recipes, the parameter dtype without one)."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.comm import link_for, ring_reduce_scatter_s
from optplan.estimators.efficiency import efficiency_for
from optplan.estimators.estimate import estimate
from optplan.estimators.fsdp_grad_sync import fsdp_reduce_bytes, syncs_once_per_step
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.memory import buffer_items, buffer_moments, memory_breakdown
from optplan.estimators.parallel import placement
from optplan.estimators.strategy import Strategy

LLAMA = "layers=16,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0,seq=4096"


def _fsdp(**kw: object) -> Strategy:
    base: dict[str, object] = dict(engine="torch", fsdp="full", precision="bf16", dp=8, mbs=1, grad_accum=4,
                                   checkpointing="full", fsdp_grad_sync="step")
    base.update(kw)
    return Strategy(**base)  # type: ignore[arg-type]


def test_reduce_dtype_follows_fsdp2s_policy() -> None:
    # optplan's train.py: MixedPrecisionPolicy(reduce_dtype=fp32) over fp32 shards for bf16/fp16; none otherwise
    assert fsdp_reduce_bytes("bf16") == fsdp_reduce_bytes("fp16") == 4
    assert fsdp_reduce_bytes("fp32") == fsdp_reduce_bytes("amp-bf16") == 4
    assert fsdp_reduce_bytes("bf16-pure") == 2


def test_which_plans_sync_once_per_step() -> None:
    assert syncs_once_per_step(_fsdp())  # one reduce-scatter per step
    assert not syncs_once_per_step(_fsdp(grad_accum=1))  # one micro-batch: the same run
    assert not syncs_once_per_step(_fsdp(fsdp_grad_sync="micro_batch"))
    assert syncs_once_per_step(_fsdp(fsdp_grad_sync="micro_batch", dp=4, pp=2))  # torch pipelining always does


@pytest.mark.parametrize("kw", [{"engine": "deepspeed", "zero": 3, "fsdp": "none"}, {"fsdp": "none"},
                                {"engine": "megatron", "fsdp": "none", "zero": 1}])
def test_once_per_step_needs_torch_fsdp(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="--fsdp-grad-sync step defers torch FSDP's"):
        _fsdp(**kw)


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
def test_the_unsharded_gradients_are_held_until_the_last_backward(precision: str) -> None:
    prof = profile_from_arch(parse_arch(LLAMA))
    step, per_mb = _fsdp(precision=precision), _fsdp(precision=precision, fsdp_grad_sync="micro_batch")
    items, moments = buffer_items(prof, step), buffer_moments(prof, step)
    held = ("fsdp_accumulated_grads", "fsdp_accumulated_unit_grads", "fsdp_accumulated_root_grads")
    # every parameter's gradient, unsharded, at the reduce dtype: what the micro-batches before the last leave
    assert sum(items[k] for k in held) == pytest.approx(prof.params * fsdp_reduce_bytes(precision), rel=1e-6)
    assert not set(held) & set(buffer_items(prof, per_mb))
    # alive in the forward; the last backward moves them unit by unit into the reduce-scatter and frees them
    assert all("forward" in moments[k] for k in held)
    assert "grads" not in moments["fsdp_accumulated_unit_grads"]
    assert "stem_grads" not in moments["fsdp_accumulated_grads"]
    assert "stem_grads" in moments["fsdp_accumulated_root_grads"]
    cap = 2**40
    def allocated(s: Strategy) -> int:  # the tensors, without the allocator's margin and the context
        m = memory_breakdown(prof, s, cap)
        return m.total_bytes - m.overhead_bytes

    grown = allocated(step) - allocated(per_mb)
    assert 0.5 * prof.params * fsdp_reduce_bytes(precision) < grown <= 1.01 * prof.params * fsdp_reduce_bytes(precision)
    # one micro-batch: nothing held, the same peak
    assert memory_breakdown(prof, _fsdp(grad_accum=1), cap) == memory_breakdown(
        prof, _fsdp(grad_accum=1, fsdp_grad_sync="micro_batch"), cap)


def test_it_saves_grad_accum_minus_one_reduce_scatters() -> None:
    prof = profile_from_arch(parse_arch(LLAMA))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=16, gpus_per_node=8, inter_node_bandwidth_bytes_per_s=50e9)
    s = _fsdp(dp=16, grad_accum=8)
    once = estimate(prof, cluster, s).time
    each = estimate(prof, cluster, _fsdp(dp=16, grad_accum=8, fsdp_grad_sync="micro_batch")).time
    # by hand: one ring reduce-scatter of every fp32 gradient over the 16 FSDP ranks, on the link timing.py prices
    pl = placement(s, cluster.gpus_per_node)
    eff = efficiency_for(cluster.gpu)
    link = link_for(pl.shard, cluster, intra_fraction=eff.intra_node_link_fraction,
                    intra_alpha_s=eff.intra_node_alpha_s)
    rs = ring_reduce_scatter_s(prof.params * 4, pl.shard.ranks, link.bandwidth_bytes_per_s, link.alpha_s)
    assert each.dp_comm_s - once.dp_comm_s == pytest.approx(7 * rs, rel=1e-6)
    assert once.step_s < each.step_s


def test_the_plans_reduce_dtype_sets_the_bytes() -> None:
    # Strategy.fsdp_reduce_dtype: auto is the recipe's default above; fp32 and the 16-bit dtypes name the bytes
    assert fsdp_reduce_bytes("bf16", "auto") == 4 and fsdp_reduce_bytes("bf16-pure", "auto") == 2
    assert fsdp_reduce_bytes("bf16", "bf16") == fsdp_reduce_bytes("fp16", "fp16") == fsdp_reduce_bytes("fp8", "bf16") == 2
    assert fsdp_reduce_bytes("bf16-pure", "fp32") == fsdp_reduce_bytes("amp-bf16", "fp32") == 4


@pytest.mark.parametrize(("kw", "message"), [
    ({"engine": "deepspeed", "zero": 3, "fsdp": "none", "fsdp_grad_sync": "micro_batch"}, "sets torch FSDP's"),
    ({"fsdp": "none", "fsdp_grad_sync": "micro_batch"}, "sets torch FSDP's"),
    ({"precision": "bf16", "fsdp_reduce_dtype": "fp16"}, "use --fsdp-reduce-dtype bf16 or fp32"),
    ({"precision": "fp16", "fsdp_reduce_dtype": "bf16"}, "use --fsdp-reduce-dtype fp16 or fp32"),
    ({"precision": "amp-bf16", "fsdp_reduce_dtype": "bf16"}, "a recipe with 16-bit weights"),
    ({"precision": "fp32", "fsdp_reduce_dtype": "bf16"}, "a recipe with 16-bit weights"),
])
def test_a_16_bit_reduction_needs_torch_fsdp_over_16_bit_weights(kw: dict[str, object], message: str) -> None:
    kw = {"fsdp_reduce_dtype": "bf16", **kw}
    with pytest.raises(ValueError, match=message):
        _fsdp(**kw)


def test_the_reduce_dtype_is_in_the_label() -> None:
    assert "reduce-bf16" in _fsdp(fsdp_reduce_dtype="bf16").label()
    assert "reduce-fp32" in _fsdp(precision="bf16-pure", fsdp_reduce_dtype="fp32").label()
    assert "reduce" not in _fsdp().label()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_bf16_reduction_halves_the_held_gradients_and_the_reduce_scatter(precision: str) -> None:
    prof = profile_from_arch(parse_arch(LLAMA))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=16, gpus_per_node=8, inter_node_bandwidth_bytes_per_s=50e9)
    fp32, low = _fsdp(dp=16, precision=precision), _fsdp(dp=16, precision=precision, fsdp_reduce_dtype="bf16")
    held = ("fsdp_accumulated_grads", "fsdp_accumulated_unit_grads", "fsdp_accumulated_root_grads")
    items32, items16 = buffer_items(prof, fp32), buffer_items(prof, low)
    assert sum(items16[k] for k in held) == pytest.approx(sum(items32[k] for k in held) / 2, rel=1e-6)
    assert items16["fsdp_reduce_scatter_unit"] * 2 == pytest.approx(items32["fsdp_reduce_scatter_unit"], abs=2)
    # one reduce-scatter per step (sync step): its fp32 bytes halve, the all-gathers stay
    pl = placement(fp32, cluster.gpus_per_node)
    eff = efficiency_for(cluster.gpu)
    link = link_for(pl.shard, cluster, intra_fraction=eff.intra_node_link_fraction,
                    intra_alpha_s=eff.intra_node_alpha_s)
    rs = [ring_reduce_scatter_s(prof.params * b, pl.shard.ranks, link.bandwidth_bytes_per_s, link.alpha_s)
          for b in (4, 2)]
    t32, t16 = estimate(prof, cluster, fp32).time, estimate(prof, cluster, low).time
    assert t32.dp_comm_s - t16.dp_comm_s == pytest.approx(rs[0] - rs[1], rel=1e-6)
    assert t16.step_s < t32.step_s
    assert "auto" == Strategy(engine="torch", fsdp="full", dp=8).fsdp_reduce_dtype  # the default prices as before
