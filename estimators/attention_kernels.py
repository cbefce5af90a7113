"""Which attention kernel an engine runs on a GPU, and how fast that kernel runs by sequence length (dimensionless
fractions of the dense 16-bit peak).

The per-GPU flash-attention fractions (efficiency.py, ``flash_attention_fraction`` / ``flash_backward_fraction``) are
fitted on llm-foundry's MPT runs (H100 0.25 / 0.15 of peak): those ran MPT's own Triton flash attention (its
benchmark script's default ``attn_impl: triton``), and the fit also carries that stack's other sequence-dependent
costs. The kernels engines run today were measured on their own (data/attention_kernels.yaml has the figures and
their sources), and their measured fractions replace the fitted ones:

- ``flash2``: FlashAttention-2, what torch's ``scaled_dot_product_attention`` runs on Hopper (its flash backend) and so
  what the torch and DeepSpeed engines run for a model that calls it: 0.19-0.34 (forward) and 0.22-0.33 (backward)
  of the H100's BF16 peak at sequence 512-16k (FlashAttention-3's Fig. 5-6). On a B200 it reaches 0.17 / 0.13 at 8k
  (no Blackwell tensor-core instructions): nobody runs it there by default.
- ``cudnn``: cuDNN's fused attention, Megatron-Core's (Transformer Engine) on Hopper: cuDNN 9.19 on an H200 at
  0.49-0.70 / 0.37-0.59 at 2k-32k; on Blackwell every engine's (torch's SDPA prefers cuDNN on sm100, torchtitan
  selects it): cuDNN 9.13 on a B200 at 0.11-0.63 / 0.14-0.49 at 1k-128k, cuDNN 9.22 on a GB200.
- ``fitted``: the GPU's fitted fractions (the kernel of the runs they were fitted on; A100 and other GPUs without a
  measured kernel, and the llm-foundry rows that fit them).

A kernel's speed rises with the sequence (more work per tile, fewer partly filled tiles): between two measured
sequence lengths the fraction is interpolated linearly in log2(sequence), outside them the nearest point holds
(stated). Known gap: torch >= 2.11 wheels (cuDNN > 9.15) prefer cuDNN on Hopper too; optplan prices torch plans on
Hopper at FlashAttention-2 (a slower kernel: the estimate errs slow there).

Pure data and a lookup, no torch.
"""

from __future__ import annotations

import math
from functools import cache
from importlib import resources
from typing import Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class KernelPoint(BaseModel):
    """One measured sequence length of a kernel (dimensionless fractions of the dense 16-bit peak)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: int = Field(gt=0, description="sequence length (tokens) of the measurement")
    forward_fraction: float = Field(gt=0, le=1, description="forward TFLOP/s ÷ the dense 16-bit peak (causal half)")
    backward_fraction: float = Field(gt=0, le=1, description="backward TFLOP/s ÷ the dense 16-bit peak")


KernelName = Literal["flash2", "cudnn", "fitted"]
"""Attention kernels a plan or a measured row can name (module docstring); ``fitted``: the GPU's fitted fractions."""
KERNEL_NAMES: tuple[str, ...] = get_args(KernelName)


class AttentionKernel(BaseModel):
    """One attention kernel on a set of GPUs, measured by sequence length (dimensionless), and the engines that run
    it there by default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Literal["flash2", "cudnn"]
    engines: tuple[str, ...] = Field(description="engines that run this kernel by default on these GPUs")
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


def attention_kernel(engine: str, gpu: str, name: str | None = None) -> AttentionKernel | None:
    """The measured kernel ``engine`` runs on catalogue GPU ``gpu``: ``name``'s measurement on that GPU when given
    (None for ``fitted`` or a kernel not measured there), else the engine's default there (None: the fitted one)."""
    kernels = attention_kernel_table().kernels
    if name is not None:
        return next((k for k in kernels if k.name == name and gpu in k.gpus), None)
    return next((k for k in kernels if engine in k.engines and gpu in k.gpus), None)


def flash_fractions(engine: str, gpu: str, fitted_forward: float, fitted_backward: float, *,
                    seq: float, kernel: str | None = None) -> tuple[float, float]:
    """(forward, backward) flash-attention fractions of peak on ``gpu`` at sequence length ``seq`` (the tokens one
    attention call sees per sequence): the measured kernel's (``kernel`` when named, else ``engine``'s default on
    that GPU; module docstring), else the GPU's fitted ones."""
    found = attention_kernel(engine, gpu, kernel)
    return (fitted_forward, fitted_backward) if found is None else found.fractions_at(seq)


__all__ = ["KERNEL_NAMES", "AttentionKernel", "AttentionKernelTable", "KernelName", "KernelPoint", "attention_kernel",
           "attention_kernel_table", "flash_fractions"]
