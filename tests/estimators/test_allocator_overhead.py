"""The device memory beside the tensors follows what the GPU runs measured (estimators/allocator_overhead.py):
recomputation leaves a larger allocator margin, a process group a larger context, and a probe's own measurement
replaces either (calibration.py)."""

from __future__ import annotations

import pytest
from conftest import make_profile

from optplan.estimators.allocator_overhead import (
    allocator_overhead,
    context_bytes,
    context_class,
    fragmentation_fraction,
    margin_class,
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
    prof = make_profile()
    s = Strategy(precision="bf16", engine="torch", mbs=2, checkpointing="full")
    m0 = memory_breakdown(prof, s, capacity_bytes=CAP)
    cal = Calibration(gpu="H100-SXM", model_hash="x", allocated_scale=1.2, memory_probes=1)
    m1 = calibrate_memory(m0, cal)
    scaled = _allocated(m0) * 1.2
    assert m1.detail_bytes["fragmentation_margin"] == pytest.approx(fragmentation_fraction(s) * scaled, rel=1e-6)
    assert m1.detail_bytes["cuda_context"] == m0.detail_bytes["cuda_context"]
