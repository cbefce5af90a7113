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
    assert buffer_moments(late, s, gpus_per_node=2)["deepspeed_reduce_buckets"] == frozenset({"grads"})


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
