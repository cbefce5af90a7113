"""Device memory beyond the live tensors: the caching allocator's margin and what lives outside it (bytes).

A GPU training step's device memory is its live tensors (``torch.cuda.max_memory_allocated``, what memory.py
accounts for exactly) plus two things no model file shows:

* **the allocator's margin**: PyTorch's caching allocator keeps freed blocks for reuse and splits large blocks,
  so its reserved peak exceeds the allocated one (PyTorch docs, "CUDA semantics: memory management";
  ``torch.cuda.max_memory_reserved``). optplan states it as a fraction of the allocated peak;
* **the context**: the CUDA context, the loaded kernel modules and NCCL's communicator buffers, outside the
  allocator ((total − free) − ``memory_reserved``).

Both are measured, not assumed: ``data/allocator_overhead.yaml`` is fitted by
``benchmarks/fit_allocator_overhead.py`` from the GPU runs committed under ``benchmarks/results/`` (one H200,
torch 2.11, CUDA 13; GPT-2 small, a Llama-3 1B layout, ResNet-50; torch and DeepSpeed). Per class it holds the
median (what the estimate uses), the 10th and 90th percentiles and the run count. Classes, as the runs split:

* margin: a step that recomputes every block from its input (full activation checkpointing frees and
  re-allocates every layer's activations beside the saved boundaries: the runs' margins were 13-48 %) or one
  that keeps them (0-29 %). Selective and MoE-layer recomputation were not measured; most of their activations
  stay saved as without recomputation, and they take that class;
* context: one torch process without a process group, or a process with a NCCL process group (DeepSpeed at any
  world size; torch over several ranks, whose NCCL buffers grow with the peers: measured at world size 1 only).

Other GPUs, drivers and CUDA versions were not measured and take the same figures; a probe on the target GPU
replaces both (calibration.py). Units: fractions of allocated bytes; bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.strategy import Strategy
from optplan.estimators.units import GIB_BYTES

MarginClass = Literal["recompute", "none"]
ContextClass = Literal["one_process", "process_group"]


class MeasuredSpread(BaseModel):
    """What the runs of one class measured: median, 10th and 90th percentile, how many runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    median: float = Field(ge=0)
    low: float = Field(ge=0, description="10th percentile")
    high: float = Field(ge=0, description="90th percentile")
    runs: int = Field(ge=1)


class AllocatorOverhead(BaseModel):
    """``data/allocator_overhead.yaml``: margins (fractions of the allocated peak) and contexts (bytes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    margin: dict[MarginClass, MeasuredSpread] = Field(min_length=1)
    context_bytes: dict[ContextClass, MeasuredSpread] = Field(min_length=1)
    source: str


@cache
def allocator_overhead() -> AllocatorOverhead:
    """The packaged table (read once; immutable)."""
    text = resources.files("optplan.estimators").joinpath("data/allocator_overhead.yaml").read_text(encoding="utf-8")
    return AllocatorOverhead(**yaml.safe_load(text))


def margin_class(strategy: Strategy) -> MarginClass:
    """``recompute`` when the step recomputes every block from its input (full checkpointing, what the measured
    runs did), else ``none`` (selective and MoE-layer recomputation keep most activations: module docstring)."""
    return "recompute" if strategy.checkpointing == "full" else "none"


def context_class(strategy: Strategy, world_size: int | None = None) -> ContextClass:
    """``one_process`` for the torch engine on one rank without FSDP (no process group), else ``process_group``
    (DeepSpeed and Megatron create one at any world size, FSDP even on one rank: probes/trainloop.py).
    ``world_size`` overrides the strategy's (a probe's ranks)."""
    ranks = strategy.world_size if world_size is None else world_size
    alone = strategy.engine == "torch" and ranks == 1 and strategy.fsdp == "none"
    return "one_process" if alone else "process_group"


def _spread(table: Mapping[str, MeasuredSpread], name: str) -> MeasuredSpread:
    """The class's figures, or the other class's where a table was fitted without it."""
    return table[name] if name in table else next(iter(table.values()))


def fragmentation_fraction(strategy: Strategy) -> float:
    """The allocator's margin over the allocated peak for ``strategy`` (fraction; the measured median)."""
    return _spread(allocator_overhead().margin, margin_class(strategy)).median


def context_bytes(strategy: Strategy) -> int:
    """Device bytes outside the allocator for ``strategy`` (CUDA context, kernels, NCCL; the measured median)."""
    return round(_spread(allocator_overhead().context_bytes, context_class(strategy)).median)


MARGIN_NOTE_MARK = "at the median allocator margin measured"
"""Text every :func:`margin_note` holds (a calibration that measured the margin drops the note)."""


Percentile = Literal["low", "median", "high"]


def needed_bytes(allocated_bytes: float, strategy: Strategy, at: Percentile,
                 context_override_bytes: int | None = None) -> float:
    """Device bytes a step of ``allocated_bytes`` live tensors needs at the ``at`` percentile (10th, median, 90th)
    of the measured allocator margins and contexts (bytes); ``context_override_bytes``: a context a probe measured
    (calibration.py) in place of the table's."""
    table = allocator_overhead()
    fraction = getattr(_spread(table.margin, margin_class(strategy)), at)
    context = getattr(_spread(table.context_bytes, context_class(strategy)), at)
    return allocated_bytes * (1 + fraction) + (context if context_override_bytes is None else context_override_bytes)


def fits_at_high_margin(allocated_bytes: float, capacity_bytes: int, strategy: Strategy,
                        context_override_bytes: int | None = None) -> bool:
    """Whether ``allocated_bytes`` of live tensors fit ``capacity_bytes`` at the 90th percentile of the measured
    allocator margins and contexts (:func:`needed_bytes`): the plan fits on most workloads measured, not only on
    the median one."""
    return needed_bytes(allocated_bytes, strategy, "high", context_override_bytes) <= capacity_bytes


def margin_note(allocated_bytes: float, capacity_bytes: int, strategy: Strategy,
                context_override_bytes: int | None = None) -> str | None:
    """One note when the plan's fit depends on where in the measured spread the allocator's margin lands: it fits
    at the median but not at the 90th percentile, or the other way round at the 10th; None otherwise.
    ``context_override_bytes``: a context measured by a probe (calibration.py) in place of the table's. The spread
    is over different workloads on one GPU, not run-to-run noise of this plan. PyTorch documents
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` against fragmentation ("CUDA semantics: optimizing memory
    usage with PYTORCH_CUDA_ALLOC_CONF": a segment grows instead of new segments being split); optplan never
    measured that mode."""
    margin = _spread(allocator_overhead().margin, margin_class(strategy))

    def need(at: Percentile) -> float:
        return needed_bytes(allocated_bytes, strategy, at, context_override_bytes)

    gib = GIB_BYTES
    median_fits = need("median") <= capacity_bytes
    cap = f"{capacity_bytes / gib:.1f} GiB"
    if median_fits and need("high") > capacity_bytes:
        return (f"memory: fits {MARGIN_NOTE_MARK} ({100 * margin.median:.0f} % of the "
                f"allocated peak, {margin.runs} runs on one GPU), not at the 90th percentile's "
                f"({100 * margin.high:.0f} %: {need('high') / gib:.1f} GiB of {cap}); "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True may lower the margin")
    if not median_fits and need("low") <= capacity_bytes:
        return (f"memory: does not fit {MARGIN_NOTE_MARK} ({100 * margin.median:.0f} % of the "
                f"allocated peak, {margin.runs} runs on one GPU) but would at the 10th percentile's "
                f"({100 * margin.low:.0f} %: {need('low') / gib:.1f} GiB of {cap}); a short run "
                "of the plan on the GPU shows its own (train.py's step lines, finetune.py --dry-run)")
    return None


__all__ = ["AllocatorOverhead", "MeasuredSpread", "allocator_overhead", "context_bytes", "context_class",
           "fits_at_high_margin", "fragmentation_fraction", "margin_class", "margin_note", "needed_bytes",
           "MARGIN_NOTE_MARK"]
