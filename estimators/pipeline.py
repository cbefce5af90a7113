"""Pipeline schedules: 1F1B and interleaved 1F1B step time, bubble, micro-batches in flight.

Sources (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", arXiv 2104.04473, §2.2.1-2.2.2; formulas.md):
- 1F1B (PipeDream-Flush) with p stages and m micro-batches: the pipeline fills and drains once per
  step, so with a per-micro-batch stage time t (forward + backward) the step takes (m + p − 1)·t and the
  bubble fraction is (p − 1)/m of the ideal m·t.
- Interleaved 1F1B with v model chunks per rank: each chunk takes t/v, the bubble shrinks to
  (p − 1)·t/v, i.e. a fraction (p − 1)/(v·m); the point-to-point traffic grows v-fold.
- Unequal stages (the first holds the embedding, the last the logits and loss): the slowest stage sets
  the steady state and every stage's time passes once through the fill and drain:
  T = m·t_max + (Σ_s t_s − t_max)/v (equal stages give the formula above).
- In flight under 1F1B: stage i (0-based) holds min(p − i, m) micro-batches' activations; interleaved,
  Megatron-LM's schedule warms up (p − i − 1)·2 + (v − 1)·p chunk-micro-batches (each 1/v of the
  stage's layers) before its first backward (``megatron/core/pipeline_parallel/schedules.py``).
Units: seconds, counts.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field


class PipelineTime(BaseModel):
    """One step through the pipeline (seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    total_s: float = Field(ge=0)
    bubble_s: float = Field(ge=0, description="total − m·t_max: fill and drain")
    bottleneck_s: float = Field(ge=0, description="slowest stage's time per micro-batch")


def bubble_fraction(pp: int, microbatches: int, vpp: int = 1) -> float:
    """Bubble time / ideal time for equal stages: (p − 1)/(v·m) (dimensionless)."""
    return (pp - 1) / (vpp * microbatches)


def pipeline_time_s(stage_s: Sequence[float], microbatches: int, vpp: int = 1) -> PipelineTime:
    """Step time of the 1F1B (``vpp`` = 1) or interleaved schedule given each stage's forward+backward
    seconds per micro-batch: m·t_max + (Σ t_s − t_max)/v."""
    if not stage_s:
        return PipelineTime(total_s=0.0, bubble_s=0.0, bottleneck_s=0.0)
    t_max = max(stage_s)
    bubble = (sum(stage_s) - t_max) / vpp
    return PipelineTime.model_construct(total_s=microbatches * t_max + bubble, bubble_s=bubble, bottleneck_s=t_max)


def in_flight_microbatches(pp: int, stage: int, microbatches: int, vpp: int = 1) -> float:
    """Micro-batches' worth of a stage's activations held at its peak (count; may be fractional with
    interleaving, where a chunk-micro-batch holds 1/v of the stage's layers)."""
    if pp <= 1:
        return 1.0
    if vpp <= 1:
        return float(min(pp - stage, microbatches))
    warmup = (pp - stage - 1) * 2 + (vpp - 1) * pp
    chunks = min(warmup + 1, microbatches * vpp)
    return chunks / vpp
