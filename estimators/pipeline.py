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
- DualPipe (DeepSeek-V3 technical report, arXiv 2412.19437 §3.2.1 and Table 2; github.com/deepseek-ai/DualPipe):
  micro-batches enter from both ends, rank r holds stage r and stage p − 1 − r (2x the parameters), pairs one
  micro-batch's forward chunk with another's backward chunk so that each hides the other's communication, and
  fills and drains in (p/2 − 1)·(F&B + B − 3W) with p + 1 chunk-micro-batches of activations in flight.
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


DUALPIPE_B_OVER_F = 2.0
"""A backward chunk's time ÷ its forward's (dimensionless): two GEMMs per forward one (input and weight gradients;
Narayanan et al. 2021 §3.1, "the backward pass takes about twice the forward")."""
DUALPIPE_W_OVER_F = 1.0
"""A "backward for weights" chunk's time ÷ the forward's (dimensionless): the weight-gradient half of the backward
(Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241 §2: B and W each take about F)."""


def dualpipe_stages(pp: int, rank: int) -> tuple[int, int]:
    """The two model stages rank ``rank`` holds under DualPipe: its own for the forward direction and the mirrored
    one, p − 1 − rank, for the reverse direction (DeepSeek-V3 report §3.2.1; ``dualpipe/dualpipe.py``)."""
    return rank, pp - 1 - rank


def dualpipe_bubble_s(pp: int, rank_s: float) -> float:
    """DualPipe's fill and drain (seconds): (p/2 − 1)·(F&B + B − 3W) (DeepSeek-V3 report Table 2; DualPipe README),
    with a rank's forward+backward time per micro-batch ``rank_s`` = F + B, its two overlapped chunks F&B = F + B
    (the overlap hides communication, not compute), B = 2F and W = F (:data:`DUALPIPE_B_OVER_F`,
    :data:`DUALPIPE_W_OVER_F`): (p/2 − 1)·(2/3)·``rank_s``."""
    f = rank_s / (1.0 + DUALPIPE_B_OVER_F)
    b, w = DUALPIPE_B_OVER_F * f, DUALPIPE_W_OVER_F * f
    return max(0, pp // 2 - 1) * (rank_s + b - 3 * w)


def dualpipe_time_s(stage_s: Sequence[float], microbatches: int) -> PipelineTime:
    """Step time of DualPipe given every stage's forward+backward seconds per micro-batch (``stage_s[i]`` for stage
    i of p): rank r runs half the micro-batches through stage r and half through stage p − 1 − r, so its time per
    micro-batch is their mean; the slowest rank sets m·t_max and :func:`dualpipe_bubble_s` adds the fill and drain."""
    p = len(stage_s)
    if not p:
        return PipelineTime(total_s=0.0, bubble_s=0.0, bottleneck_s=0.0)
    ranks = [(stage_s[r] + stage_s[p - 1 - r]) / 2 for r in range(p)]
    t_max = max(ranks)
    bubble = dualpipe_bubble_s(p, t_max)
    return PipelineTime.model_construct(total_s=microbatches * t_max + bubble, bubble_s=bubble, bottleneck_s=t_max)


def dualpipe_solo_fraction(pp: int, microbatches: int) -> float:
    """Share of a DualPipe rank's forward (and backward) chunks that run without a partner chunk to overlap with
    (dimensionless, 0-1), for the first rank, which pairs fewest: ``dualpipe/dualpipe.py`` ``step`` pairs
    2·(m/2 − p + 1) chunks in its main step and p/2 − 1 in step 5, m − 1.5·p + 1 of m, so (1.5·p − 1)/m run alone."""
    m = max(1, microbatches)
    return min(1.0, (1.5 * pp - 1) / m)


DUALPIPE_IN_FLIGHT_EXTRA = 1
"""DualPipe holds p + 1 chunk-micro-batches of activations per rank, 1F1B's first stage p (DeepSeek-V3 report
Table 2, "Activation: PP+1"): taken for every rank (an upper bound for the middle ranks)."""
