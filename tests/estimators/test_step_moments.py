"""The peak is the worst moment of the step: engine buffers are added only where they live."""

from __future__ import annotations

from conftest import make_profile

from optplan.estimators.memory import (
    buffer_items,
    buffer_moments,
    deepspeed_grad_partition_elements,
    memory_breakdown,
)
from optplan.estimators.profile import ActivationFit
from optplan.estimators.strategy import Strategy

CAP = 2**40


def test_grad_partition_holds_every_parameter_that_overlaps_the_rank() -> None:
    # flat buffer [0, 100) in 2 partitions of 50: rank 0 holds [0, 60) whole (60), rank 1 the 60 + 30 + 10
    assert deepspeed_grad_partition_elements((60, 30, 10), 2) == 100
    # equal-sized tensors that line up with the partitions: exactly 1/N each
    assert deepspeed_grad_partition_elements((25, 25, 25, 25), 2) == 50
    assert deepspeed_grad_partition_elements((25, 25, 25, 25), 4) == 25
    # a tensor cut by the boundary belongs to both ranks
    assert deepspeed_grad_partition_elements((30, 40, 30), 2) == 70
    assert deepspeed_grad_partition_elements((7,), 1) == 7


def phased_profile(**phases: int):
    """A profile whose fp32 fit has the given activation bytes at each moment (flat in the micro-batch)."""
    prof = make_profile(params=10_000_000, hidden=256)
    fit = ActivationFit(precision="fp32", checkpointing="none", fixed_bytes=max(phases.values()),
                        per_sample_bytes=0, phase_lines={k: ((v, 0),) for k, v in phases.items()})
    return prof.model_copy(update={"activations": (fit, *prof.activations[1:])})


def test_deepspeed_gradient_partition_lives_only_from_the_first_gradient() -> None:
    s = Strategy(precision="fp32", engine="deepspeed", zero=2, dp=2)
    # the activation peak is at the loss: the partition is not alive yet, so it is not added there
    early = phased_profile(forward=10**8, loss=5 * 10**8, backward=10**8, grads=10**8)
    m = memory_breakdown(early, s, CAP, gpus_per_node=2)
    assert m.moment == "loss" and m.grads_bytes == 0 and m.activations_bytes == 5 * 10**8
    assert "deepspeed_reduce_buckets" not in m.detail_bytes
    # a peak after the first gradient carries the partition and the reduce buckets
    late = phased_profile(forward=10**8, loss=10**8, backward=10**8, grads=5 * 10**8)
    m = memory_breakdown(late, s, CAP, gpus_per_node=2)
    assert m.moment == "grads" and m.grads_bytes > 0 and "deepspeed_reduce_buckets" in m.detail_bytes
    assert buffer_moments(late, s, gpus_per_node=2)["deepspeed_reduce_buckets"] == frozenset({"grads", "stem_grads"})


def test_deepspeed_zero0_has_no_gradients_before_its_backward_and_flattens_them_after() -> None:
    """ZeRO-0 frees every gradient after the step (engine.zero_grad: param.grad = None): a one-micro-batch step has
    none at the loss; at the end of backward every gradient and their flat all-reduce copy, the activations freed.
    With accumulation the later micro-batches hold them all (the earlier rule). Measured: the CPU probe of a
    TransformerEncoder model read +7.5 % before, and the H200 run of examples/mlp.py fp32 ZeRO-0 +6.46 -> +3.69 %."""
    s = Strategy(precision="fp32", engine="deepspeed", zero=0, dp=2)
    prof = phased_profile(forward=10**8, loss=5 * 10**8, backward=10**8, grads=10**8)
    m = memory_breakdown(prof, s, CAP, gpus_per_node=2)
    assert m.moment == "loss" and m.grads_bytes == 0 and "deepspeed_reduce_bucket" not in m.detail_bytes
    accumulating = memory_breakdown(prof, s.model_copy(update={"grad_accum": 4}), CAP, gpus_per_node=2)
    assert accumulating.grads_bytes == 4 * 10_000_000 and accumulating.total_bytes > m.total_bytes
    quiet = phased_profile(forward=10**5, loss=10**5, backward=10**5, grads=10**5)
    end = memory_breakdown(quiet, s, CAP, gpus_per_node=2)
    grads = 4 * 10_000_000
    assert end.moment == "backward_end" and end.grads_bytes == grads and end.activations_bytes == 0
    assert end.detail_bytes["deepspeed_reduce_bucket"] == grads  # the whole fp32 gradient, flattened
    assert buffer_moments(quiet, s, gpus_per_node=2)["deepspeed_reduce_bucket"] == frozenset({"backward_end"})


def test_fsdp_units_are_not_gathered_during_the_loss() -> None:
    s = Strategy(precision="fp32", engine="torch", fsdp="full", dp=2)
    prof = phased_profile(forward=10**7, loss=10**9, backward=10**7, grads=10**7)
    m = memory_breakdown(prof, s, CAP, gpus_per_node=2)
    assert m.moment == "loss"
    assert not {"fsdp_root_unit", "fsdp_unsharded_units", "fsdp_reduce_scatter_unit"} & set(m.detail_bytes)
    items = buffer_items(prof, s, gpus_per_node=2)
    assert items["fsdp_root_unit"] > 0 and items["fsdp_unsharded_units"] > 0


def test_a_fit_without_phases_sums_every_buffer() -> None:
    """Formula and older fits have one figure: every buffer is added to it (an upper bound)."""
    prof = make_profile(params=10_000_000, hidden=256)
    s = Strategy(precision="fp32", engine="deepspeed", zero=2, dp=2)
    m = memory_breakdown(prof, s, CAP, gpus_per_node=2)
    assert m.moment == "" and "deepspeed_reduce_buckets" in m.detail_bytes and m.grads_bytes > 0


def test_phases_never_exceed_the_summed_estimate() -> None:
    prof = phased_profile(forward=3 * 10**8, loss=4 * 10**8, backward=2 * 10**8, grads=3 * 10**8)
    flat = make_profile(params=10_000_000, hidden=256)
    flat = flat.model_copy(update={"activations": (ActivationFit(precision="fp32", checkpointing="none",
                                                                 fixed_bytes=4 * 10**8, per_sample_bytes=0),
                                                   *flat.activations[1:])})
    for s in (Strategy(precision="fp32", engine="deepspeed", zero=z, dp=4) for z in (1, 2, 3)):
        phased_total = memory_breakdown(prof, s, CAP, gpus_per_node=4).total_bytes
        assert phased_total <= memory_breakdown(flat, s, CAP, gpus_per_node=4).total_bytes
    for fsdp in ("full", "grad_op"):
        s = Strategy(precision="fp32", engine="torch", fsdp=fsdp, dp=4)  # type: ignore[arg-type]
        assert (memory_breakdown(prof, s, CAP, gpus_per_node=4).total_bytes
                <= memory_breakdown(flat, s, CAP, gpus_per_node=4).total_bytes)


def test_fsdp_block_units_are_resharded_by_the_stems_backward() -> None:
    """FULL_SHARD: at the embedding's backward (stem_grads) the root unit and the last fp32 reduce-scatter
    input are alive, the two gathered block units are not (measured: benchmarks/fidelity_train.py)."""
    s = Strategy(precision="fp32", engine="torch", fsdp="full", dp=2)
    prof = phased_profile(forward=10**7, loss=10**7, backward=10**7, grads=10**7, stem_grads=10**9)
    m = memory_breakdown(prof, s, CAP, gpus_per_node=2)
    assert m.moment == "stem_grads"
    assert {"fsdp_root_unit", "fsdp_reduce_scatter_unit"} <= set(m.detail_bytes)
    assert "fsdp_unsharded_units" not in m.detail_bytes
    # SHARD_GRAD_OP keeps every unit gathered through backward, and the same reduce-scatter input
    grad_op = memory_breakdown(prof, Strategy(precision="fp32", engine="torch", fsdp="grad_op", dp=2), CAP,
                               gpus_per_node=2)
    assert grad_op.moment == "stem_grads"
    assert {"fsdp_unsharded_params", "fsdp_reduce_scatter_unit"} <= set(grad_op.detail_bytes)


def test_hsdp_keeps_every_blocks_all_reduce_output() -> None:
    prof = phased_profile(forward=10**7, loss=10**7, backward=10**7, grads=10**7, stem_grads=10**9)
    blocks = prof.repeated_block.count * prof.repeated_block.params_per_block  # type: ignore[union-attr]
    # 2 replicas of a 2-way shard group (one node of 2 GPUs each)
    hybrid = Strategy(precision="fp32", engine="torch", fsdp="hybrid", dp=4)
    items = buffer_items(prof, hybrid, gpus_per_node=2)
    assert items["hsdp_all_reduce_outputs"] == round(blocks / 2 * 4)  # fp32, 1/shard of every block
    assert "hsdp_all_reduce_outputs" not in buffer_items(prof, hybrid, gpus_per_node=4)  # one replica
    # gloo's copy of the reduce-scatter input is gone when the collective settles (probes/runtime_child.py
    # ProbeTracker): the CPU accounting holds the same buffers as a GPU rank's
    cpu = memory_breakdown(prof, hybrid, CAP, gpus_per_node=2, device="cpu")
    gpu = memory_breakdown(prof, hybrid, CAP, gpus_per_node=2)
    assert cpu.moment == "stem_grads"
    assert cpu.detail_bytes["hsdp_all_reduce_outputs"] == gpu.detail_bytes["hsdp_all_reduce_outputs"] > 0
    assert cpu.detail_bytes["fsdp_reduce_scatter_unit"] == gpu.detail_bytes["fsdp_reduce_scatter_unit"]


def test_torch_master_weights_make_fp32_gradients_at_the_step() -> None:
    """torch without FSDP, bf16 weights: train.py's MasterWeights makes an fp32 gradient per master at step()."""
    from optplan.estimators.memory import optimizer_step_scratch_bytes

    prof = make_profile(params=10_000_000, hidden=256)
    bf16 = optimizer_step_scratch_bytes(prof, Strategy(precision="bf16", engine="torch", dp=2), adam_impl="fused")
    assert bf16 == 4 * prof.trainable_params
    # bf16-pure has no master, FSDP steps its fp32 sharded parameters, DeepSpeed has its own conversion
    assert optimizer_step_scratch_bytes(prof, Strategy(precision="bf16-pure", engine="torch", dp=2),
                                        adam_impl="fused") == 0
    assert optimizer_step_scratch_bytes(prof, Strategy(precision="bf16", engine="torch", fsdp="full", dp=2),
                                        adam_impl="fused") == 0


def test_16bit_weights_use_the_profiles_bf16_weights_fit() -> None:
    from optplan.estimators.memory import activation_bytes, measured_fit

    prof = make_profile(params=10_000_000, hidden=256)
    autocast = ActivationFit(precision="bf16", checkpointing="none", fixed_bytes=6 * 10**7, per_sample_bytes=10**7,
                             param_copy_bytes=2 * 10**7)
    weights = ActivationFit(precision="bf16-weights", checkpointing="none", fixed_bytes=2 * 10**7,
                            per_sample_bytes=5 * 10**6)
    fp32 = prof.activation("fp32", "none")
    with16 = prof.model_copy(update={"activations": (fp32, autocast, weights)})
    without = prof.model_copy(update={"activations": (fp32, autocast)})
    for engine in ("torch", "deepspeed"):
        s = Strategy(precision="bf16", engine=engine, dp=2)  # type: ignore[arg-type]
        assert measured_fit(with16, s)[0] is weights
        assert activation_bytes(with16, s) == 2 * 10**7 + 5 * 10**6 * s.mbs
        # without the fit (older profiles, models that fail in bf16): the autocast fit less its weight copies
        assert activation_bytes(without, s) == 6 * 10**7 - 2 * 10**7 + 10**7 * s.mbs
    # AMP holds fp32 weights under autocast; Megatron upcasts its logits: both keep the autocast fit
    assert measured_fit(with16, Strategy(precision="amp-bf16", engine="torch", dp=2))[0] is autocast
    assert measured_fit(with16, Strategy(precision="bf16", engine="megatron", dp=2))[0] is autocast


def test_fsdp_root_reduce_is_a_moment_of_its_own() -> None:
    """FSDP2's last reduce-scatter (the root unit's) runs with the activations freed and every sharded gradient
    written: the root's unsharded gradients (weights' dtype) and its fp32 reduce-scatter input are alive, and on CPU
    gloo's copy of that input (benchmarks/results/fidelity_train_cpu.txt: the bf16 runs' peak, to 0.02 %). With
    a large root (embedding) and little activation memory it is the peak; with much, the backward is."""
    from optplan.estimators.engine_buffers import _root_unit_params, fsdp_root_reduce_items
    from optplan.estimators.profile import RepeatedBlock

    small = phased_profile(forward=10**5, loss=10**5, backward=10**5, grads=10**5, stem_grads=10**5)
    small = small.model_copy(update={"repeated_block": RepeatedBlock(class_name="Block", count=12,
                                                                     params_per_block=100_000)})
    s = Strategy(precision="fp32", engine="torch", fsdp="full", dp=2, optimizer="sgd")
    root = _root_unit_params(small, s, 0)
    assert root == 10_000_000 - 1_200_000
    gpu = memory_breakdown(small, s, CAP, gpus_per_node=2)
    cpu = memory_breakdown(small, s, CAP, gpus_per_node=2, device="cpu")
    assert gpu.moment == cpu.moment == "root_reduce"
    assert gpu.detail_bytes["fsdp_root_reduce_scatter_input"] == gpu.detail_bytes["fsdp_root_unsharded_grads"] \
        == round(root * 4)
    assert "gloo_reduce_scatter_copy" not in gpu.detail_bytes
    assert cpu.detail_bytes["gloo_reduce_scatter_copy"] == round(root * 4)
    assert "fsdp_root_unit" not in gpu.detail_bytes  # resharded after its backward
    bf16 = fsdp_root_reduce_items(small, s.model_copy(update={"precision": "bf16"}), 0, "cuda")
    assert bf16 == {"fsdp_root_unsharded_grads": round(root * 2), "fsdp_root_reduce_scatter_input": round(root * 4)}
    big = phased_profile(forward=10**9, loss=10**9, backward=10**9, grads=10**9, stem_grads=10**9)
    assert memory_breakdown(big, s, CAP, gpus_per_node=2).moment != "root_reduce"
    assert fsdp_root_reduce_items(small, Strategy(precision="fp32", engine="torch", dp=2), 0, "cpu") == {}
    assert fsdp_root_reduce_items(small, Strategy(precision="fp32", zero=3, dp=2), 0, "cpu") == {}
