"""Which attention kernel an engine runs on a GPU where it is not the one the per-GPU flash fractions were fitted on.

The per-GPU flash-attention fractions (efficiency.py, ``flash_attention_fraction`` / ``flash_backward_fraction``) are
fitted on runs whose attention was FlashAttention-2 (H100: llm-foundry's MPT runs, where they came out at 0.25 and
0.15 of peak: effective figures that also carry that stack's other sequence-dependent costs). Megatron-Core on
Hopper runs Transformer Engine's cuDNN fused attention instead, a different kernel measured on its own by
FlashAttention-3's paper at 0.49-0.54 (forward) and 0.47-0.52 (backward) of the H100's BF16 peak at sequence
2k-16k (data/attention_kernels.yaml has the figures and the source): those fractions replace the fitted ones.
torch's ``scaled_dot_product_attention`` and DeepSpeed run FlashAttention-2-class kernels: the fit stands.
Blackwell's kernels were not measured here: nothing is claimed for them.

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
    forward_fraction: float = Field(gt=0, le=1, description="forward TFLOP/s ÷ the dense 16-bit peak (causal half)")
    backward_fraction: float = Field(gt=0, le=1, description="backward TFLOP/s ÷ the dense 16-bit peak")
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


def flash_fractions(engine: str, gpu: str, fitted_forward: float, fitted_backward: float) -> tuple[float, float]:
    """(forward, backward) flash-attention fractions of peak ``engine`` reaches on ``gpu``: its kernel's measured
    ones (module docstring), else the GPU's fitted ones."""
    kernel = attention_kernel(engine, gpu)
    return (fitted_forward, fitted_backward) if kernel is None else (kernel.forward_fraction, kernel.backward_fraction)


__all__ = ["AttentionKernel", "AttentionKernelTable", "attention_kernel", "attention_kernel_table", "flash_fractions"]
