"""Which attention kernel an engine runs on a GPU, and how much faster it is than the fitted flash fractions.

The per-GPU flash-attention fractions (efficiency.py, ``flash_attention_fraction`` / ``flash_backward_fraction``) are
fitted on runs whose attention was FlashAttention-2 (H100: llm-foundry's MPT runs). Megatron-Core on Hopper runs
Transformer Engine's cuDNN fused attention instead, which FlashAttention-3's paper measured at about 1.6x
FlashAttention-2's throughput, forward and backward, at sequence 2k-16k (data/attention_kernels.yaml has the
figures and the source). torch's ``scaled_dot_product_attention`` and DeepSpeed run FlashAttention-2-class kernels:
no speed-up. Blackwell kernels were not measured against the fit: no speed-up is claimed there.

Dimensionless; pure data and a lookup, no torch.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import yaml
from pydantic import BaseModel, ConfigDict, Field


class AttentionKernel(BaseModel):
    """One engine's attention kernel on a set of GPUs, relative to FlashAttention-2 (dimensionless)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: str
    gpus: tuple[str, ...]
    kernel: str
    forward_speedup: float = Field(gt=0, description="achieved forward TFLOP/s ÷ FlashAttention-2's")
    backward_speedup: float = Field(gt=0, description="achieved backward TFLOP/s ÷ FlashAttention-2's")
    source: str


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


def flash_speedups(engine: str, gpu: str) -> tuple[float, float]:
    """(forward, backward) speed-up of the engine's attention kernel over the fitted flash fractions."""
    kernel = attention_kernel(engine, gpu)
    return (1.0, 1.0) if kernel is None else (kernel.forward_speedup, kernel.backward_speedup)


__all__ = ["AttentionKernel", "AttentionKernelTable", "attention_kernel", "attention_kernel_table", "flash_speedups"]
