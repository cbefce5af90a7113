"""The device memory beside the tensors follows what the GPU runs measured (estimators/allocator_overhead.py):
recomputation leaves a larger allocator margin, a process group a larger context, and a probe's own measurement
replaces either (calibration.py)."""

from __future__ import annotations

import pytest
from conftest import make_profile

from optplan.estimators.allocator_overhead import (
    MARGIN_NOTE_MARK,
    allocator_overhead,
    context_bytes,
    context_class,
    fits_at_high_margin,
    fragmentation_fraction,
    margin_class,
    margin_note,
)
from optplan.estimators.calibration import Calibration, calibrate_memory
from optplan.estimators.memory import memory_breakdown
from optplan.estimators.strategy import Strategy

CAP = 80 * 2**30


def _allocated(m) -> int:  # type: ignore[no-untyped-def]
    return m.params_bytes + m.grads_bytes + m.optimizer_bytes + m.activations_bytes + m.buffers_bytes


def test_classes() -> None:
    assert margin_class(Strategy(precision="bf16", engine="torch")) == "none"
    assert margin_class(Strategy(precision="bf16", engine="torch", checkpointing="full")) == "recompute"
    assert margin_class(Strategy(precision="bf16", engine="torch", checkpointing="selective")) == "none"  # unmeasured
    assert context_class(Strategy(precision="bf16", engine="torch")) == "one_process"
    assert context_class(Strategy(precision="bf16", engine="torch", dp=2)) == "process_group"
    assert context_class(Strategy(precision="bf16", engine="deepspeed")) == "process_group"  # NCCL at any size
    assert context_class(Strategy(precision="bf16", engine="torch", dp=8), world_size=1) == "one_process"
    # FSDP starts a NCCL process group even on one rank (probes/trainloop.py)
    assert context_class(Strategy(precision="bf16", engine="torch", fsdp="full")) == "process_group"


def test_the_measured_table_says_recompute_and_process_groups_cost_more() -> None:
    table = allocator_overhead()
    assert table.margin["recompute"].median > table.margin["none"].median > 0
    assert table.context_bytes["process_group"].median > table.context_bytes["one_process"].median > 0
    for spread in [*table.margin.values(), *table.context_bytes.values()]:
        assert spread.low <= spread.median <= spread.high and spread.runs >= 1


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_breakdown_books_its_class_margin_and_context(checkpointing: str) -> None:
    prof = make_profile()
    s = Strategy(precision="bf16", engine="torch", mbs=2, checkpointing=checkpointing)
    m = memory_breakdown(prof, s, capacity_bytes=CAP)
    assert m.detail_bytes["fragmentation_margin"] == round(fragmentation_fraction(s) * _allocated(m))
    assert m.detail_bytes["cuda_context"] == context_bytes(s) == round(allocator_overhead().context_bytes[
        "one_process"].median)
    assert m.overhead_bytes == m.detail_bytes["fragmentation_margin"] + m.detail_bytes["cuda_context"]


def test_a_probe_without_allocator_figures_keeps_the_estimate_s_own() -> None:
    """The fallback margin is the estimate's own fraction, taken over the bytes it was computed on: calibrating
    an already calibrated breakdown again changes nothing."""
    prof = make_profile()
    s = Strategy(precision="bf16", engine="torch", mbs=2, checkpointing="full")
    m0 = memory_breakdown(prof, s, capacity_bytes=CAP)
    cal = Calibration(gpu="H100-SXM", model_hash="x", allocated_scale=1.2, memory_probes=1)
    m1 = calibrate_memory(m0, cal)
    scaled = _allocated(m0) * 1.2
    assert m1.detail_bytes["fragmentation_margin"] == pytest.approx(fragmentation_fraction(s) * scaled, rel=1e-6)
    assert m1.detail_bytes["cuda_context"] == m0.detail_bytes["cuda_context"]
    assert calibrate_memory(m1, cal) == m1


def test_a_fit_that_depends_on_the_margin_s_spread_says_so() -> None:
    s = Strategy(precision="bf16", engine="torch", mbs=2, checkpointing="full")
    table = allocator_overhead()
    margin, context = table.margin["recompute"], table.context_bytes["one_process"]
    allocated = 20 * 2**30
    median_need = allocated * (1 + margin.median) + context.median
    high_need = allocated * (1 + margin.high) + context.high
    low_need = allocated * (1 + margin.low) + context.low
    tight = margin_note(allocated, int((median_need + high_need) / 2), s)
    assert tight is not None and tight.startswith("memory: fits at the median allocator margin")
    assert "90th percentile" in tight and "expandable_segments:True" in tight and MARGIN_NOTE_MARK in tight
    short = margin_note(allocated, int((low_need + median_need) / 2), s)
    assert short is not None and short.startswith("memory: does not fit") and "10th percentile" in short
    assert MARGIN_NOTE_MARK in short  # a calibration can drop either
    assert margin_note(allocated, int(2 * high_need), s) is None  # fits at any measured margin
    assert margin_note(allocated, int(low_need / 2), s) is None  # fits at none
    # the same boundary as a flag: only a capacity at or above the 90th percentile's need fits robustly
    assert not fits_at_high_margin(allocated, int((median_need + high_need) / 2), s)
    assert fits_at_high_margin(allocated, int(high_need) + 1, s)
    assert not fits_at_high_margin(allocated, int(high_need) - 1, s)
    assert fits_at_high_margin(allocated, int(high_need) - 1, s, context_override_bytes=int(context.high) - 2**20)


def test_the_estimate_carries_the_note_until_a_probe_measures_the_margin() -> None:
    from optplan.estimators.estimate import calibrate_estimate, estimate
    from optplan.estimators.hardware import Cluster, find_gpu

    prof = make_profile()
    gpu = find_gpu("H100-SXM")
    s = Strategy(precision="bf16", engine="torch", mbs=2, checkpointing="full")
    m = estimate(prof, Cluster(gpu=gpu, gpus=1, gpus_per_node=8), s).memory
    allocated = m.total_bytes - m.overhead_bytes
    margin, context = allocator_overhead().margin["recompute"], allocator_overhead().context_bytes["one_process"]
    # a GPU whose usable memory sits between the median and the 90th percentile's need
    usable = (allocated * (1 + (margin.median + margin.high) / 2) + (context.median + context.high) / 2)
    small = gpu.model_copy(update={"name": "H100-SXM", "memory_bytes": int(usable / 0.98)})
    est = estimate(prof, Cluster(gpu=small, gpus=1, gpus_per_node=8), s)
    assert est.fits and any(MARGIN_NOTE_MARK in n for n in est.notes)
    assert est.fits_at_high_margin is False  # the flag the tie-break reads (planner/simplicity.py)
    roomy = estimate(prof, Cluster(gpu=gpu, gpus=1, gpus_per_node=8), s)
    assert roomy.fits_at_high_margin is True and not any(MARGIN_NOTE_MARK in n for n in roomy.notes)
    measured = Calibration(gpu="H100-SXM", model_hash="x", fragmentation_fraction=0.05, memory_probes=1)
    assert not any(MARGIN_NOTE_MARK in n for n in calibrate_estimate(est, measured).notes)
    assert calibrate_estimate(est, measured).fits_at_high_margin is True  # a measured margin: fits is the answer
    scaled_only = Calibration(gpu="H100-SXM", model_hash="x", allocated_scale=1.0, memory_probes=1)
    assert any(MARGIN_NOTE_MARK in n for n in calibrate_estimate(est, scaled_only).notes)
    assert calibrate_estimate(est, scaled_only).fits_at_high_margin is False
    # a probe that measured 30 % more tensors: the plan no longer fits, and no note says it fits
    bigger = calibrate_estimate(est, Calibration(gpu="H100-SXM", model_hash="x", allocated_scale=1.3, memory_probes=1))
    assert not bigger.fits and not any(n.startswith("memory: fits at") for n in bigger.notes)
