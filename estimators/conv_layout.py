"""What a channels-first (NCHW) convolution net pays on a GPU where it was measured (counted_traffic.py's NCHW term).

counted_traffic.py charges ``NCHW_TRANSPOSE_PASSES`` extra passes over a channels-first tensor-core convolution's
activation bytes (cuDNN transposes them to channels-last and back), fitted on timm's RTX 3090 pairs (0.5). Hopper
pays far more: the fifth H200 visit measured timm's ResNet-50 under bf16 autocast at micro-batch 128 busy 55.0 ms
channels-first against 28.8 ms channels-last (traces, benchmarks/results/2026-11-29-H200-visit5): cuDNN 9's
``nchwToNhwcKernel``/``nhwcToNchwKernel`` around every convolution (6.3 ms) and PyTorch's channels-first batch-norm
kernels (30.6 ms against 12.6 ms for the channels-last ones: the per-channel reductions over strided data do not
reach Hopper's bandwidth). The same passes, per GPU and convolution math (16-bit, TF32), measured:

    NCHW term = passes(GPU, math) x nchw_conv_bytes_per_sample x m      (bytes, counted_traffic.py ``memory_s``)

``data/conv_layout.yaml`` keeps them with the catalogue GPUs each applies to (the same die, cuDNN and PyTorch
kernels: the H100s take the H200's); ``benchmarks/fit_conv_layout.py`` fits them on the GPU runs. A proxy, stated:
the batch-norm slowness is charged per convolution activation byte, as the two come together in these nets.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import yaml
from pydantic import BaseModel, ConfigDict, Field


class LayoutPasses(BaseModel):
    """One GPU's measured channels-first passes (dimensionless) and where they come from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    passes_16bit: float = Field(ge=0, description="extra passes over 16-bit NCHW convolution activation bytes")
    passes_tf32: float = Field(ge=0, description="extra passes over TF32 NCHW convolution activation bytes")
    applies_to: tuple[str, ...] = Field(description="catalogue GPU names that run the same kernels")
    source: str


@cache
def measured_layout() -> dict[str, LayoutPasses]:
    """``data/conv_layout.yaml``'s measurements by the GPU they were taken on."""
    text = resources.files("optplan.estimators").joinpath("data/conv_layout.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text) or {}
    return {name: LayoutPasses(**entry) for name, entry in (raw.get("measured") or {}).items()}


def nchw_passes(gpu_name: str, *, tf32: bool, default: float) -> float:
    """The channels-first passes for ``gpu_name``'s 16-bit (or, ``tf32``, TF32) convolutions: a measurement that
    applies to it, else ``default`` (counted_traffic.py's fit)."""
    for m in measured_layout().values():
        if gpu_name in m.applies_to:
            return m.passes_tf32 if tf32 else m.passes_16bit
    return default


__all__ = ["LayoutPasses", "measured_layout", "nchw_passes"]
