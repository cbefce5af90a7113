"""Memory under tensor, sequence, pipeline and context parallelism, FSDP/HSDP and offload: hand-worked
cases of Korthikanti et al. 2022 Table 2, the ZeRO formulas per rank, and Megatron's stage placement."""

from __future__ import annotations

import pytest
from conftest import make_gpu

from optplan.estimators.arch import LOGIT_BYTES, ArchSpec, profile_from_arch
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.memory import (
    activation_bytes,
    buffer_items,
    in_flight_micro_batches,
    memory_breakdown,
    model_states,
    param_split,
    stage_params,
)
from optplan.estimators.parallel import group_nodes, placement
from optplan.estimators.strategy import Strategy

L, H, A, S, V = 24, 2048, 16, 2048, 51200


@pytest.fixture(scope="module")
def gpt():  # noqa: ANN201 - a ModelProfile
    return profile_from_arch(ArchSpec(layers=L, hidden=H, heads=A, vocab=V, seq=S))


def logits() -> int:
    """An eager 16-bit cross entropy's peak over the sample's logits (arch.py LOGIT_BYTES)."""
    return S * V * LOGIT_BYTES["bf16"]


def test_table2_no_parallelism_with_and_without_flash(gpt) -> None:  # noqa: ANN001
    flash = activation_bytes(gpt, Strategy(mbs=2))
    assert flash == 2 * (L * S * H * 34 + logits())
    eager = activation_bytes(gpt, Strategy(mbs=2, flash=False))
    assert eager == 2 * (L * S * H * (34 + 5 * A * S / H) + logits())
    # Megatron's selective recomputation drops exactly the 5·a·s/h term (Table 2, row 4 with t = 1)
    megatron_flash = activation_bytes(gpt, Strategy(mbs=2, engine="megatron"))
    assert activation_bytes(gpt, Strategy(mbs=2, flash=False, checkpointing="selective",
                                          engine="megatron")) == megatron_flash == flash
    # the torch engine's per-op policy keeps less (estimators/selective.py; tests/estimators/test_selective_fit.py)
    assert activation_bytes(gpt, Strategy(mbs=2, checkpointing="selective")) < flash


@pytest.mark.parametrize("t", [2, 4, 8])
def test_table2_tensor_parallel_rows(gpt, t: int) -> None:  # noqa: ANN001
    tp = activation_bytes(gpt, Strategy(tp=t, sp=False))
    assert tp == pytest.approx(L * S * H * (10 + 24 / t) + logits() / t, abs=2)
    tp_eager = activation_bytes(gpt, Strategy(tp=t, sp=False, flash=False))
    assert tp_eager == pytest.approx(L * S * H * (10 + 24 / t + 5 * A * S / (H * t)) + logits() / t, abs=2)
    tp_sp = activation_bytes(gpt, Strategy(tp=t, sp=True))
    assert tp_sp == pytest.approx(L * S * H * 34 / t + logits() / t, abs=2)
    tp_sp_sel = activation_bytes(gpt, Strategy(tp=t, sp=True, flash=False, checkpointing="selective",
                                               engine="megatron"))
    assert tp_sp_sel == pytest.approx(L * S * H * 34 / t + logits() / t, abs=2)


def test_full_recompute_keeps_layer_inputs_and_one_layer(gpt) -> None:  # noqa: ANN001
    t = 4
    full = activation_bytes(gpt, Strategy(tp=t, sp=True, checkpointing="full"))
    # the layer inputs, plus the larger of the recomputed layer and the logits/loss: they are never alive together
    # (the loss's tensors are freed before the first layer's backward recomputes it; measured under tensor
    # parallelism on CPU, benchmarks/fidelity_tp_cpu.py)
    assert full == pytest.approx(L * 2 * S * H / t + max(S * H * 34, logits()) / t, abs=2)


def test_pipeline_first_stage_holds_p_micro_batches(gpt) -> None:  # noqa: ANN001
    p, m = 4, 8
    s = Strategy(pp=p, grad_accum=m)
    assert in_flight_micro_batches(s, 0) == p
    assert in_flight_micro_batches(s, p - 1) == 1
    # Korthikanti §4.2.3: the first stage holds L/p layers x p micro-batches = L layers' worth
    assert activation_bytes(gpt, s, stage=0) == L * S * H * 34
    assert activation_bytes(gpt, s, stage=p - 1) == L // p * S * H * 34 + logits()
    # fewer micro-batches than stages: only m in flight
    assert in_flight_micro_batches(Strategy(pp=p, grad_accum=2), 0) == 2


def test_interleaved_schedule_factor(gpt) -> None:  # noqa: ANN001
    p, v, m = 4, 3, 8
    s = Strategy(pp=p, vpp=v, grad_accum=m)
    assert in_flight_micro_batches(s, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert activation_bytes(gpt, s, stage=0) == pytest.approx(L * S * H * 34 * (1 + (p - 1) / (p * v)), abs=2)


def test_context_parallel_splits_the_sequence(gpt) -> None:  # noqa: ANN001
    assert activation_bytes(gpt, Strategy(cp=4)) == pytest.approx((L * S * H * 34 + logits()) / 4, abs=2)
    items = buffer_items(gpt, Strategy(cp=4, mbs=1))
    assert items["cp_kv_ring_buffers"] == 2 * 2 * S // 4 * H * 1


def test_param_split_and_stage_placement(gpt) -> None:  # noqa: ANN001
    split = param_split(gpt)
    per_layer = gpt.repeated_block.params_per_block  # type: ignore[union-attr]
    assert split.tied and split.embed == V * H and split.head == 0
    assert split.other == gpt.params - L * per_layer - V * H
    assert stage_params(gpt, Strategy(tp=4)) == pytest.approx((L * per_layer + V * H) / 4 + split.other)
    first = stage_params(gpt, Strategy(pp=4), 0)
    last = stage_params(gpt, Strategy(pp=4), 3)
    assert first == L // 4 * per_layer + V * H + split.other
    assert last == L // 4 * per_layer + V * H  # Megatron copies the tied embedding to the last stage


def test_zero_formulas_per_rank_with_tp_and_pp(gpt) -> None:  # noqa: ANN001
    s = Strategy(precision="bf16", tp=2, pp=2, dp=4, zero=1, grad_accum=4)
    psi = stage_params(gpt, s, 0)
    states = model_states(gpt, s, stage=0)
    assert states.params_bytes == round(2 * psi)
    assert states.grads_bytes == round(2 * psi / 4)  # DeepSpeed's stage 1 partitions gradients as stage 2
    assert states.optimizer_bytes == round(12 * psi / 4)


def test_megatron_keeps_fp32_main_grads(gpt) -> None:  # noqa: ANN001
    ds = model_states(gpt, Strategy(precision="bf16", dp=8))
    mg = model_states(gpt, Strategy(precision="bf16", dp=8, engine="megatron"))
    assert mg.grads_bytes == 2 * ds.grads_bytes


def test_fsdp_equals_zero_and_hsdp_shards_inside_a_node(gpt) -> None:  # noqa: ANN001
    z3 = model_states(gpt, Strategy(zero=3, dp=16), gpus_per_node=8)
    full = model_states(gpt, Strategy(fsdp="full", engine="torch", dp=16), gpus_per_node=8)
    assert (full.params_bytes, full.grads_bytes, full.optimizer_bytes) == (
        z3.params_bytes, z3.grads_bytes, z3.optimizer_bytes)
    hybrid = model_states(gpt, Strategy(fsdp="hybrid", engine="torch", dp=16), gpus_per_node=8)
    assert hybrid.params_bytes == pytest.approx(2 * full.params_bytes, abs=1)
    grad_op = model_states(gpt, Strategy(fsdp="grad_op", engine="torch", dp=16), gpus_per_node=8)
    z2 = model_states(gpt, Strategy(zero=2, dp=16), gpus_per_node=8)
    # SHARD_GRAD_OP shards gradients and optimizer states as ZeRO-2 does, and keeps sharded weights too
    # (it gathers them whole for forward and backward: fsdp_unsharded_params)
    assert grad_op.optimizer_bytes == z2.optimizer_bytes
    assert (grad_op.params_bytes, grad_op.grads_bytes) == (full.params_bytes, full.grads_bytes)
    items = buffer_items(gpt, Strategy(fsdp="grad_op", engine="torch", dp=16))
    # the root unit through backward, the blocks until the stem's backward (their own reshards them)
    unsharded = items["fsdp_unsharded_params"] + items["fsdp_unsharded_block_params"]
    assert unsharded == pytest.approx(16 * full.params_bytes, abs=16)
    assert 0 < items["fsdp_unsharded_params"] < items["fsdp_unsharded_block_params"]
    assert placement(Strategy(fsdp="hybrid", engine="torch", dp=16), 8).shard.ranks == 8


def test_fsdp_buffers_hold_two_units(gpt) -> None:  # noqa: ANN001
    unit = gpt.repeated_block.params_per_block  # type: ignore[union-attr]
    items = buffer_items(gpt, Strategy(fsdp="full", engine="torch", dp=8, precision="bf16"))
    # one gathered block unit while the blocks run, the next one prefetched in the forward and after the first
    # gradient (at the start of backward only the last block's: benchmarks/results/fidelity_train_cpu.txt)
    assert items["fsdp_unsharded_units"] == items["fsdp_prefetched_unit"] == unit * 2
    # the reduce-scatter input is fp32 (FSDP2's reduce dtype for 16-bit weights in optplan's train.py)
    assert items["fsdp_reduce_scatter_unit"] == unit * 4
    assert "hsdp_all_reduce_outputs" not in items
    ddp = buffer_items(gpt, Strategy(engine="torch", dp=8, precision="bf16"))
    assert ddp["ddp_gradient_buckets"] == gpt.params * 2


def test_torch_fsdp_offload_moves_every_state_to_the_host(gpt) -> None:  # noqa: ANN001
    s = Strategy(fsdp="full", engine="torch", dp=8, offload_params="cpu")
    states = model_states(gpt, s)
    on = model_states(gpt, s.model_copy(update={"offload_params": "none"}))
    assert states.params_bytes == states.grads_bytes == states.optimizer_bytes == 0
    assert states.host_bytes == pytest.approx(on.params_bytes + on.grads_bytes + on.optimizer_bytes, abs=2)


def test_nvme_offload_is_reported_apart_from_host(gpt) -> None:  # noqa: ANN001
    s = Strategy(zero=3, dp=8, offload_optimizer="nvme", offload_params="nvme")
    states = model_states(gpt, s)
    assert states.host_bytes == 0 and states.nvme_bytes > 0
    m = memory_breakdown(gpt, s, 80 * 2**30)
    assert m.nvme_bytes == states.nvme_bytes


def test_worst_rank_is_reported(gpt) -> None:  # noqa: ANN001
    m = memory_breakdown(gpt, Strategy(pp=4, grad_accum=8, dp=2), 80 * 2**30)
    first = memory_breakdown(gpt, Strategy(pp=4, grad_accum=8, dp=2), 80 * 2**30)
    assert m.rank.startswith("pipeline stage") and m.total_bytes == first.total_bytes
    assert "cuda_context" in m.detail_bytes and "pipeline_p2p" in m.detail_bytes


def test_more_model_parallelism_never_increases_states(gpt) -> None:  # noqa: ANN001
    totals = []
    for t in (1, 2, 4, 8):
        s = model_states(gpt, Strategy(tp=t, dp=1))
        totals.append(s.params_bytes + s.grads_bytes + s.optimizer_bytes)
    assert totals == sorted(totals, reverse=True)


def test_group_nodes_follow_megatron_order() -> None:
    assert group_nodes(8, 1, 8) == 1
    assert group_nodes(4, 4, 8) == 2
    assert group_nodes(4, 8, 8) == 4
    p = placement(Strategy(tp=8, dp=4, pp=2, grad_accum=2), 8)
    assert p.tp.intra_node and p.dp.nodes == 4 and p.pp.nodes == 2


def test_tensor_parallelism_across_nodes_is_priced_over_the_inter_node_link(gpt) -> None:  # noqa: ANN001
    # tp 16 on 8-GPU nodes (Megatron-LM runs it; the vTrain study measured it): the group spans 2 nodes and
    # its collectives run over the 8 NICs of each node, slower than the same group inside one 16-GPU node
    s = Strategy(engine="megatron", tp=16, mbs=1, grad_accum=4)
    two_nodes = estimate(gpt, Cluster(gpu=make_gpu(), gpus=16, gpus_per_node=8), s)
    one_node = estimate(gpt, Cluster(gpu=make_gpu(), gpus=16, gpus_per_node=16), s)
    assert placement(s, 8).tp.nodes == 2 and placement(s, 16).tp.intra_node
    assert two_nodes.time.tp_comm_s > one_node.time.tp_comm_s > 0
    assert two_nodes.time.step_s > one_node.time.step_s
    assert any("spans 2 nodes" in n and "inter-node" in n for n in two_nodes.notes)
    assert not any("spans" in n for n in one_node.notes)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tp": 3}, "does not divide the 16 attention heads"),
    ({"tp": 16}, "exceeds the 8 GPUs"),
    ({"pp": 32}, "larger than the 24 layers"),
    ({"pp": 8, "vpp": 4, "grad_accum": 8}, "exceed the 24 layers"),
    ({"cp": 3}, "divisible by 2·cp"),
    ({"dp": 8, "tp": 2}, "exceeds the 8 GPUs"),
])
def test_invalid_degrees_are_one_line_errors(gpt, kwargs: dict, match: str) -> None:  # noqa: ANN001
    cluster = Cluster(gpu=make_gpu(), gpus=8, gpus_per_node=8)
    with pytest.raises(OptplanError, match=match):
        estimate(gpt, cluster, Strategy(**kwargs))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"zero": 2, "fsdp": "full", "engine": "torch"}, "not both"),
    ({"fsdp": "full"}, "torch engine"),
    ({"engine": "torch", "zero": 1}, "--fsdp"),
    ({"engine": "megatron", "zero": 3}, "--zero 0 or 1"),
    ({"sp": True}, "needs tensor parallelism"),
    ({"vpp": 2}, "need pipeline parallelism"),
    ({"pp": 4, "vpp": 2, "grad_accum": 6}, "divisible by --pp 4"),
    ({"pp": 2, "zero": 2}, "ZeRO-1 at most"),
    ({"engine": "torch", "fsdp": "full", "offload_optimizer": "cpu"}, "--offload params"),
])
def test_inconsistent_strategies_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Strategy(**kwargs)


def test_sp_defaults_on_with_tp_and_optimizer_alias() -> None:
    assert Strategy(tp=2).sp and not Strategy().sp
    assert Strategy(optimizer="adamw-8bit").optimizer == "adamw8bit"  # type: ignore[arg-type]
    assert Strategy(tp=2, pp=2, cp=2, dp=3, grad_accum=2).world_size == 24


def test_deepspeed_zero0_16bit_step_flattens_fp32_gradients(gpt) -> None:  # noqa: ANN001
    small_acts = Strategy(precision="bf16", dp=8, mbs=1, checkpointing="full")
    m = memory_breakdown(gpt, small_acts, 80 * 2**30)
    extra = m.detail_bytes["deepspeed_step_fp32_grad_flatten"]
    assert extra == 8 * gpt.params - m.activations_bytes
    for other in (small_acts.model_copy(update={"zero": 1}), small_acts.model_copy(update={"precision": "amp-bf16"}),
                  small_acts.model_copy(update={"engine": "megatron"})):
        assert "deepspeed_step_fp32_grad_flatten" not in memory_breakdown(gpt, other, 80 * 2**30).detail_bytes


def test_adafactor_loses_its_factoring_under_zero(gpt) -> None:  # noqa: ANN001
    factored = model_states(gpt, Strategy(precision="fp32", optimizer="adafactor", dp=8))
    flat = model_states(gpt, Strategy(precision="fp32", optimizer="adafactor", dp=8, zero=1))
    assert factored.optimizer_bytes < 0.01 * gpt.params
    # a flat fp32 second moment plus DeepSpeed's fp32 partition of the weights, both sharded
    assert flat.optimizer_bytes == pytest.approx((4 + 4) * gpt.params / 8, rel=1e-6)


def test_zero3_keeps_small_tensors_whole(gpt) -> None:  # noqa: ANN001
    # HF "auto": stage3_param_persistence_threshold = 10·h, so biases and norms (h, 4h) stay unpartitioned
    counts = gpt.small_param_counts
    persistent = sum(size * n for size, n in counts.items() if size <= 10 * H)
    assert persistent == L * (9 * H + 4 * H) + 2 * H  # per layer 9 h-sized tensors (kv = h), one 4h bias; final norm
    items = buffer_items(gpt, Strategy(zero=3, dp=8, precision="bf16"))
    assert items["zero3_persistent_params"] == round(persistent * 2 * (1 - 1 / 8))


def test_torch_foreach_adamw_step_scratch_is_a_copy_of_the_moments(gpt) -> None:  # noqa: ANN001
    from optplan.estimators.memory import optimizer_step_scratch_bytes

    ddp = Strategy(precision="amp-bf16", engine="torch", dp=8, checkpointing="full")
    # torch's foreach AdamW (the CUDA default) sqrt()s every moment at once: Σ n_i · 4 bytes
    assert optimizer_step_scratch_bytes(gpt, ddp) == 4 * gpt.params
    fsdp = ddp.model_copy(update={"fsdp": "full"})
    assert optimizer_step_scratch_bytes(gpt, fsdp) == pytest.approx(4 * gpt.params / 8, rel=1e-3)
    assert optimizer_step_scratch_bytes(gpt, ddp.model_copy(update={"engine": "megatron"})) == 0  # fused
    m = memory_breakdown(gpt, ddp, 80 * 2**30)
    assert m.detail_bytes["optimizer_step_scratch"] == 4 * gpt.params - m.activations_bytes
    cpu = optimizer_step_scratch_bytes(gpt, ddp, adam_impl="single_tensor", device="cpu")
    assert cpu == 4 * 2 * V * H  # the CPU loop holds two copies of the largest tensor (the embedding) at once


def test_adafactor_under_zero_says_so_in_the_notes(gpt) -> None:  # noqa: ANN001
    cluster = Cluster(gpu=make_gpu(), gpus=8, gpus_per_node=8)
    flat = estimate(gpt, cluster, Strategy(optimizer="adafactor", zero=1, dp=8))
    factored = estimate(gpt, cluster, Strategy(optimizer="adafactor", dp=8))
    assert any("adafactor" in n.lower() for n in flat.notes)
    assert not any("adafactor" in n.lower() for n in factored.notes)


@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("vocab", [128256, 8000])
def test_one_per_rank_step_is_one_figure_with_or_without_context_parallelism(
        checkpointing: str, precision: str, compiled: bool, vocab: int) -> None:
    """A rank of cp 2 at 2s tokens runs the step a rank of cp 1 runs at s: the whole-model fit (cp 1) and the
    model-parallel path (cp 2) count the same bytes (until 2026-12-01 full recomputation was 10-18 % lower at cp 2:
    the fit summed a layer's rerun with the loss, the split path took the larger; torchtitan's 8B runs reserved the
    same at cp 1 and cp 2-8, benchmarks/fidelity_torchtitan.py)."""
    shape = f"layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab={vocab},gated=1,tied=0"
    one = profile_from_arch(ArchSpec.model_validate({**_kv(shape), "seq": 8192}))
    two = profile_from_arch(ArchSpec.model_validate({**_kv(shape), "seq": 16384}))
    s1 = Strategy(engine="torch", fsdp="full", precision=precision, dp=8, mbs=1,  # type: ignore[arg-type]
                  checkpointing=checkpointing, compile=compiled)  # type: ignore[arg-type]
    s2 = s1.model_copy(update={"dp": 4, "cp": 2})
    assert activation_bytes(one, s1) == pytest.approx(activation_bytes(two, s2), rel=1e-9)


def _kv(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}


def test_an_arch_selective_stage_keeps_its_layers_and_one_rerun() -> None:
    """Under the op-level selective policy a pipeline stage holds its layers' kept bytes for each micro-batch in
    flight plus one layer's rerun (arch.py's fit: the kept bytes and the larger of a rerun and the loss), whether or
    not the stage computes the loss."""
    from optplan.estimators.arch import LOGIT_BYTES

    s, v, layers = 8192, 128256, 32
    prof = profile_from_arch(ArchSpec.model_validate({**_kv(
        f"layers={layers},hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab={v},gated=1,tied=0"), "seq": s}))
    rerun = s * prof.transformer.layer_bytes_per_token()  # type: ignore[union-attr]
    loss = s * v * LOGIT_BYTES["bf16"]
    kept = (prof.activation("bf16", "selective").per_sample_bytes - max(rerun, loss)) / layers
    plan = Strategy(engine="torch", precision="bf16", mbs=1, dp=4, pp=2, grad_accum=8, checkpointing="selective")
    assert activation_bytes(prof, plan, stage=0) == pytest.approx(16 * kept * 2 + rerun, rel=1e-9)  # 2 in flight
    assert activation_bytes(prof, plan, stage=1) == pytest.approx(16 * kept + max(rerun, loss), rel=1e-9)


def test_without_flash_the_recomputed_layer_holds_its_scores() -> None:
    """--no-flash on an --arch shape: the layer rerun under full recomputation materialises its 5·a·s² scores
    (Korthikanti Table 2), beside the kept inputs; a compiled loss below it shows them."""
    s, a = 4096, 16
    prof = profile_from_arch(ArchSpec(layers=L, hidden=H, heads=a, vocab=V, seq=s))
    plan = Strategy(engine="torch", precision="bf16", mbs=1, checkpointing="full", compile=True)
    flash, math = activation_bytes(prof, plan), activation_bytes(prof, plan.model_copy(update={"flash": False}))
    rerun, scores, compiled_loss = s * H * 34, 5 * a * s * s, 4 * s * V  # the logits and their gradient: 4 B each
    assert compiled_loss > rerun and rerun + scores > compiled_loss
    assert math - flash == pytest.approx(rerun + scores - compiled_loss, rel=1e-9)
