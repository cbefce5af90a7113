"""Which attention kernel an engine runs on a GPU where it is not the one the per-GPU flash fractions were fitted on,
and how fast that kernel runs by sequence length (dimensionless fractions of the dense 16-bit peak).

The per-GPU flash-attention fractions (efficiency.py, ``flash_attention_fraction`` / ``flash_backward_fraction``) are
fitted on runs whose attention was FlashAttention-2 (H100: llm-foundry's MPT runs, where they came out at 0.25 and
0.15 of peak: effective figures that also carry that stack's other sequence-dependent costs). Other kernels were
measured on their own (data/attention_kernels.yaml has the figures and their sources), and their measured fractions
replace the fitted ones:

- Megatron-Core on Hopper runs Transformer Engine's cuDNN fused attention: cuDNN 9.19 on an H200 at 0.49-0.70
  (forward) and 0.37-0.59 (backward) of the BF16 peak at sequence 2k-32k (NVIDIA's cudnn-frontend benchmark).
- On Blackwell (B200) Megatron-Core's cuDNN attention and torch's SDPA, which prefers its cuDNN backend on sm100
  (and which torchtitan selects there), run cuDNN 9.13 at 0.11-0.63 / 0.14-0.49 of the B200's BF16 peak at 1k-128k.
  FlashAttention-2 does not use Blackwell's tensor-core instructions (0.17 of peak at 8k): the Hopper fit, which
  stands for it, is not carried over.

A kernel's speed rises with the sequence (more work per tile, fewer partly filled tiles): between two measured
sequence lengths the fraction is interpolated linearly in log2(sequence), outside them the nearest point holds
(stated). torch on Hopper and Ampere and DeepSpeed run FlashAttention-2-class kernels as fitted (torch >= 2.11
wheels, whose cuDNN passes 9.15, prefer cuDNN on sm90 too: not priced here; the measured torch sets ran FA2).

Pure data and a lookup, no torch.
"""

from __future__ import annotations

import math
from functools import cache
from importlib import resources

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class KernelPoint(BaseModel):
    """One measured sequence length of a kernel (dimensionless fractions of the dense 16-bit peak)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: int = Field(gt=0, description="sequence length (tokens) of the measurement")
    forward_fraction: float = Field(gt=0, le=1, description="forward TFLOP/s ÷ the dense 16-bit peak (causal half)")
    backward_fraction: float = Field(gt=0, le=1, description="backward TFLOP/s ÷ the dense 16-bit peak")


class AttentionKernel(BaseModel):
    """One engine's attention kernel on a set of GPUs, measured by sequence length (dimensionless)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: str
    gpus: tuple[str, ...]
    kernel: str
    points: tuple[KernelPoint, ...] = Field(min_length=1, description="measured fractions, ascending sequence")
    source: str

    @model_validator(mode="after")
    def _ascending(self) -> AttentionKernel:
        seqs = [p.seq for p in self.points]
        if seqs != sorted(set(seqs)):
            raise ValueError(f"{self.kernel}: points must have distinct, ascending sequence lengths")
        return self

    def fractions_at(self, seq: float) -> tuple[float, float]:
        """(forward, backward) fractions at sequence length ``seq``: linear in log2(seq) between the measured
        points, the nearest point's outside them."""
        pts = self.points
        if seq <= pts[0].seq:
            return pts[0].forward_fraction, pts[0].backward_fraction
        for lo, hi in zip(pts, pts[1:], strict=False):
            if seq <= hi.seq:
                w = (math.log2(seq) - math.log2(lo.seq)) / (math.log2(hi.seq) - math.log2(lo.seq))
                return (lo.forward_fraction + w * (hi.forward_fraction - lo.forward_fraction),
                        lo.backward_fraction + w * (hi.backward_fraction - lo.backward_fraction))
        return pts[-1].forward_fraction, pts[-1].backward_fraction


class AttentionKernelTable(BaseModel):
    """``data/attention_kernels.yaml``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kernels: tuple[AttentionKernel, ...]


@cache
def attention_kernel_table() -> AttentionKernelTable:
    """The packaged table (read once; immutable)."""
    text = resources.files("optplan.estimators").joinpath("data/attention_kernels.yaml").read_text(encoding="utf-8")
    return AttentionKernelTable(**yaml.safe_load(text))


def attention_kernel(engine: str, gpu: str) -> AttentionKernel | None:
    """The kernel ``engine`` runs on catalogue GPU ``gpu`` when it differs from the fit's, else None."""
    return next((k for k in attention_kernel_table().kernels if k.engine == engine and gpu in k.gpus), None)


def flash_fractions(engine: str, gpu: str, fitted_forward: float, fitted_backward: float, *,
                    seq: float) -> tuple[float, float]:
    """(forward, backward) flash-attention fractions of peak ``engine`` reaches on ``gpu`` at sequence length ``seq``
    (the tokens one attention call sees per sequence): its kernel's measured ones (module docstring), else the GPU's
    fitted ones."""
    kernel = attention_kernel(engine, gpu)
    return (fitted_forward, fitted_backward) if kernel is None else kernel.fractions_at(seq)


__all__ = ["AttentionKernel", "AttentionKernelTable", "KernelPoint", "attention_kernel", "attention_kernel_table",
           "flash_fractions"]
