"""Memory estimators against hand-checked numbers from the ZeRO paper and the recipe tables."""

from __future__ import annotations

import pytest
from conftest import make_profile

from optplan.estimators.allocator_overhead import context_bytes, fragmentation_fraction
from optplan.estimators.memory import (
    activation_bytes,
    buffer_bytes,
    memory_breakdown,
    model_states,
    usable_capacity_bytes,
    zero3_gathered_params,
    zero3_prefetch_params,
)
from optplan.estimators.strategy import Strategy

GB = 1e9


@pytest.mark.parametrize(("zero", "expected_gb"), [(0, 120.0), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure1_numbers(zero: int, expected_gb: float) -> None:
    """ZeRO paper Figure 1: Ψ = 7.5B, K = 12, N_d = 64 -> 120, (31.4,) 16.6, 1.9 GB per GPU."""
    prof = make_profile(params=7_500_000_000)
    states = model_states(prof, Strategy(precision="bf16", zero=zero, dp=64))
    total = states.params_bytes + states.grads_bytes + states.optimizer_bytes
    assert total / GB == pytest.approx(expected_gb, abs=0.05)


def test_deepspeed_stage1_partitions_gradients_like_stage2() -> None:
    """The paper's ZeRO-1 keeps every gradient (31.4 GB in Figure 1); DeepSpeed's stage 1 (stage_1_and_2.py
    with contiguous_gradients, as exported) copies them into the same partition buffer as stage 2, which
    the probes measure (benchmarks/fidelity.py: equal ZeRO-1 and ZeRO-2 peaks)."""
    prof = make_profile(params=7_500_000_000)
    one, two = (model_states(prof, Strategy(precision="bf16", zero=z, dp=64)) for z in (1, 2))
    assert one == two
    assert (one.params_bytes + one.grads_bytes + one.optimizer_bytes) / GB == pytest.approx(16.6, abs=0.05)


@pytest.mark.parametrize(("precision", "optimizer", "bytes_per_param"), [
    ("fp32", "adamw", 16), ("amp-bf16", "adamw", 16), ("amp-fp16", "adamw", 16), ("bf16", "adamw", 16),
    ("fp16", "adamw", 16), ("bf16-pure", "adamw", 8), ("bf16", "sgd", 12), ("fp32", "sgd", 12),
    ("amp-bf16", "adamw-8bit", 10.004), ("bf16", "adamw-8bit", 10.004),
])
def test_bytes_per_parameter_per_recipe(precision: str, optimizer: str, bytes_per_param: float) -> None:
    prof = make_profile(params=1_000_000)
    s = model_states(prof, Strategy(precision=precision, optimizer=optimizer))  # type: ignore[arg-type]
    assert (s.params_bytes + s.grads_bytes + s.optimizer_bytes) / 1e6 == pytest.approx(bytes_per_param, abs=1e-3)


def test_recipe_split_between_weights_grads_optimizer() -> None:
    prof = make_profile(params=1_000_000)
    amp = model_states(prof, Strategy(precision="amp-bf16"))
    assert (amp.params_bytes, amp.grads_bytes, amp.optimizer_bytes) == (4_000_000, 4_000_000, 8_000_000)
    mixed = model_states(prof, Strategy(precision="bf16"))
    assert (mixed.params_bytes, mixed.grads_bytes, mixed.optimizer_bytes) == (2_000_000, 2_000_000, 12_000_000)


def test_frozen_parameters_have_no_gradients_or_optimizer_state() -> None:
    prof = make_profile(params=1_000_000, trainable=100_000)
    s = model_states(prof, Strategy(precision="bf16"))
    assert s.params_bytes == 2_000_000
    assert s.grads_bytes == 200_000
    assert s.optimizer_bytes == 1_200_000


def test_offload_moves_states_to_host() -> None:
    prof = make_profile(params=1_000_000)
    s = model_states(prof, Strategy(precision="bf16", zero=3, dp=4, offload_optimizer="cpu", offload_params="cpu"))
    assert s.optimizer_bytes == 0 and s.params_bytes == 0
    assert s.grads_bytes == 500_000
    assert s.host_bytes == 3_000_000 + 1_000_000 + 500_000  # optimizer + fp32 grads + weights


def test_offload_rules_are_validated() -> None:
    with pytest.raises(ValueError, match="ZeRO stage 3"):
        Strategy(zero=2, offload_params="cpu")
    with pytest.raises(ValueError, match="ZeRO stage 1"):
        Strategy(zero=0, offload_optimizer="cpu")
    with pytest.raises(ValueError, match="NVMe optimizer offload needs ZeRO stage 3"):  # 1-2 keep it in host RAM
        Strategy(zero=2, offload_optimizer="nvme")
    assert Strategy(zero=3, offload_optimizer="nvme").offload_optimizer == "nvme"


def test_activations_follow_the_fit_and_precision() -> None:
    prof = make_profile(fixed_bytes=1000)
    per = 34 * 768 * 1024 * 12
    assert activation_bytes(prof, Strategy(precision="bf16", mbs=4)) == 1000 + 4 * per
    assert activation_bytes(prof, Strategy(precision="fp32", mbs=4)) == 1000 + 8 * per
    ckpt = activation_bytes(prof, Strategy(precision="bf16", mbs=4, checkpointing="full"))
    assert ckpt < activation_bytes(prof, Strategy(precision="bf16", mbs=4)) / 5


def test_buffers_by_stage() -> None:
    prof = make_profile(params=100_000_000, hidden=2048)
    assert buffer_bytes(prof, Strategy(engine="torch", dp=1)) == 0
    # DeepSpeed's ZeRO-0 flattens its gradients for the all-reduce at world size 1 too (measured by the
    # CPU probe: examples/mlp.py fp32 ZeRO-0 on one process peaks one flat fp32 gradient higher)
    assert buffer_bytes(prof, Strategy(zero=0, dp=1)) == buffer_bytes(prof, Strategy(zero=0, dp=8)) > 0
    bucket = 2048 * 2048
    # ZeRO-0's all-reduce flattens up to 5e8 elements at a time whatever reduce_bucket_size says: here the whole
    # 16-bit gradient (deepspeed/runtime/engine.py MEMORY_OPT_ALLREDUCE_SIZE), at the end of backward only
    assert buffer_bytes(prof, Strategy(precision="bf16", zero=0, dp=8)) == prof.params * 2
    assert buffer_bytes(prof, Strategy(precision="bf16", zero=2, dp=8)) == bucket * 2 * 2
    z3 = buffer_bytes(prof, Strategy(precision="bf16", zero=3, dp=8))
    # below ~0.5e9 parameters DeepSpeed's default stage3_max_reuse_distance (1e9) keeps every parameter
    # gathered from its forward to its backward; one more prefetch bucket (0.9·h² elements, rounded up to
    # a whole block) is in flight while a block computes
    block = prof.repeated_block.params_per_block  # type: ignore[union-attr]
    assert z3 == bucket * 2 + prof.params * 2 + block * 2


def test_zero3_prefetch_buffer_is_the_next_bucket() -> None:
    prof = make_profile(params=100_000_000, hidden=2048)
    s = Strategy(precision="bf16", zero=3, dp=8)
    block = prof.repeated_block.params_per_block  # type: ignore[union-attr]
    inflight, moments = zero3_prefetch_params(prof, s)
    assert inflight == block and moments == frozenset({"forward"})  # the whole model stays gathered
    tiny = make_profile(params=800_000, layers=2, hidden=64)  # one bucket holds it all: nothing in flight
    assert zero3_prefetch_params(tiny, s)[0] == 0
    big = make_profile(params=20_000_000_000, layers=40, hidden=8192)
    assert zero3_prefetch_params(big, s)[1] == frozenset({"forward", "backward", "grads", "stem_grads"})  # backward fetches


def test_zero3_keeps_the_last_half_reuse_distance_gathered() -> None:
    """Between a block's forward and backward come twice the later blocks' parameters: those within
    stage3_max_reuse_distance / 2 of the end stay gathered, plus the block in use and the prefetch bucket,
    at most stage3_max_live_parameters."""
    big = make_profile(params=20_000_000_000, layers=40, hidden=8192)
    block = big.repeated_block.params_per_block  # type: ignore[union-attr]
    gathered = zero3_gathered_params(big, Strategy(precision="bf16", zero=3, dp=64))
    assert gathered == min(0.5e9 + block + int(0.9 * 8192**2), 1e9)
    small = make_profile(params=300_000_000, hidden=1024)
    assert zero3_gathered_params(small, Strategy(precision="bf16", zero=3, dp=8)) == small.params


def test_breakdown_total_and_overhead() -> None:
    prof = make_profile()
    s = Strategy(precision="bf16", mbs=2, zero=1, dp=8)
    m = memory_breakdown(prof, s, capacity_bytes=80 * 2**30)
    allocated = m.params_bytes + m.grads_bytes + m.optimizer_bytes + m.activations_bytes + m.buffers_bytes
    assert m.overhead_bytes == context_bytes(s) + round(fragmentation_fraction(s) * allocated)
    assert m.detail_bytes["cuda_context"] == context_bytes(s) and m.detail_bytes["fragmentation_margin"] > 0
    assert m.total_bytes == allocated + m.overhead_bytes
    assert m.headroom_bytes == 80 * 2**30 - m.total_bytes
    assert usable_capacity_bytes(80 * 2**30) == int(0.98 * 80 * 2**30)
    assert m.fits


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_memory_monotone_in_micro_batch(zero: int) -> None:
    prof = make_profile()
    totals = [memory_breakdown(prof, Strategy(mbs=b, zero=zero, dp=8), 80 * 2**30).total_bytes
              for b in (1, 2, 4, 8, 16)]
    assert totals == sorted(totals)
    # strictly rising, except where DeepSpeed's ZeRO-0 step buffers (8 B/param) outweigh the activations
    assert len(set(totals)) == len(totals) or zero == 0


def test_sharding_never_increases_model_states() -> None:
    prof = make_profile(params=3_000_000_000)
    per_stage = []
    for zero in range(4):
        s = model_states(prof, Strategy(zero=zero, dp=8))
        per_stage.append(s.params_bytes + s.grads_bytes + s.optimizer_bytes)
    assert per_stage == sorted(per_stage, reverse=True)


def test_autocast_weight_copies_only_count_for_amp() -> None:
    base = make_profile()
    fits = tuple(f.model_copy(update={"fixed_bytes": f.fixed_bytes + 5000, "param_copy_bytes": 5000})
                 if f.precision == "bf16" else f for f in base.activations)
    prof = base.model_copy(update={"activations": fits})
    amp = activation_bytes(prof, Strategy(precision="amp-bf16", mbs=2))
    assert amp == activation_bytes(base, Strategy(precision="amp-bf16", mbs=2)) + 5000
    for precision in ("bf16", "fp16", "bf16-pure"):
        assert activation_bytes(prof, Strategy(precision=precision, mbs=2)) == amp - 5000  # type: ignore[arg-type]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_deepspeed_16_bit_zero_step_converts_the_gradient_partition_to_fp32(zero: int) -> None:
    # stage_1_and_2.py step(): a flat 16-bit copy of the rank's averaged gradient partition and its fp32
    # conversion, alive together: (2 + 4) bytes per parameter of the partition (fused Adam adds nothing);
    # stage3.py: the partition is already one flat tensor, only its fp32 conversion is new (4 bytes)
    from optplan.estimators.memory import DEEPSPEED_SUB_GROUP_ELEMENTS, optimizer_step_scratch_bytes

    per_param = 4 if zero == 3 else 6
    prof = make_profile(params=100_000_000, hidden=2048)
    bf16 = Strategy(precision="bf16", engine="deepspeed", zero=zero, dp=8)
    assert optimizer_step_scratch_bytes(prof, bf16, gpus_per_node=8, adam_impl="fused") == per_param * 100_000_000 // 8
    fp32 = bf16.model_copy(update={"precision": "fp32"})  # fp32 gradients need no conversion
    assert optimizer_step_scratch_bytes(prof, fp32, gpus_per_node=8, adam_impl="fused") == 0
    big = make_profile(params=40_000_000_000, hidden=8192)
    capped = optimizer_step_scratch_bytes(big, bf16, gpus_per_node=8, adam_impl="fused")
    per_rank = per_param * 40_000_000_000 // 8
    assert capped == (4 * DEEPSPEED_SUB_GROUP_ELEMENTS if zero == 3 else per_rank)  # ZeRO-3: one sub-group


def test_deepspeed_zero12_frees_16bit_gradients_before_a_cpu_adam_step() -> None:
    """ZeRO-1/2 on CPU ranks (torch AdamW's loop over the one flat fp32 partition): the step's peak is the larger
    of the conversion (16-bit flat copy + fp32 gradient) and the fp32 gradient + Adam's 2 partition-sized
    temporaries less the freed 16-bit partition (stage_1_and_2.py ``step``; measured, fidelity_train.py)."""
    from optplan.estimators.memory import optimizer_step_scratch_bytes

    prof = make_profile(params=100_000_000, hidden=2048)
    e = 100_000_000 // 8
    bf16 = Strategy(precision="bf16", engine="deepspeed", zero=2, dp=8)
    assert optimizer_step_scratch_bytes(prof, bf16, gpus_per_node=8, adam_impl="single_tensor") == max(6 * e, 4 * e + 8 * e - 2 * e)
    z3 = bf16.model_copy(update={"zero": 3})
    assert optimizer_step_scratch_bytes(prof, z3, gpus_per_node=8, adam_impl="single_tensor") == 4 * e + 8 * e
