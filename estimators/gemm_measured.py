"""GEMM figures measured on a GPU: the exponent γ of the time model's alignment factor (a/16)^γ, and the fraction of
its fp32 peak an fp32 GEMM reaches.

A GEMM whose dimension is not a multiple of 16 bytes (an odd vocabulary such as GPT-2's 50,257) cannot use the
GPU's fastest kernels: cuBLAS falls back to kernels that load one element at a time. compute.py's
``gemm_time_s`` divides the achieved rate by (16/a)^γ, a the worst dimension's alignment in bytes (NVIDIA, "Matrix
Multiplication Background User's Guide", Tensor Core Requirements: dimensions a multiple of 16 bytes). γ was fitted
on the A100 (efficiency.yaml) where no measured set has an odd dimension; the microbenchmark measures it
(probes/microbench.py ``unaligned_gemm_slowdown``: the same GEMMs with the odd and the padded dimension):

    γ = ln(slowdown) / ln(16 / a)      a = one element of the dtype, in bytes (dimensionless)

The 16-bit figure sets γ (the dtypes the tensor cores run; bf16 first). fp32 GEMMs take no alignment factor at all
(compute.py): on the H200 the odd fp32 GEMM ran 1.02x the padded one's time per FLOP (SIMT kernels, no 16-byte
vector loads to lose). Their speed is measured too: compute.py's stated fp32 fraction (1.4x the 16-bit GEMM
fraction, capped at 0.9: "SIMT SGEMM reaches ~80-90 % of its lower peak") met 0.76 on the H200 (51.0 of 67 TFLOP/s
at 8192³), and the fitted 16-bit fractions do not constrain it (every fitted set trained in 16-bit), so the measured
fraction replaces it.

fp8 GEMMs alike: compute.py's stated fp8 ratio (0.75 of the fitted 16-bit fraction: "Transformer Engine fp8 speeds
GEMMs up ~1.5×, not 2×", 0.56 of the fp8 peak on the H100 fit) is below what an fp8 GEMM reached on the H200: 0.64
of its fp8 peak (the median of three 8192³ ``torch._scaled_mm`` runs, e4m3 × e4m3 → bf16 with per-tensor scales and
full-precision accumulation, 1,238-1,289 of 1,979 TFLOP/s), which replaces it on the Hopper GPUs. Transformer Engine
runs the forward GEMMs with fast accumulation (faster still) and the gradient GEMMs with split accumulation (as
measured). Checked, never fitted, on the dgxc-nemo set's 35 fp8 runs (benchmarks/published_sets.py: NeMo on up to
2,304 H100s): MAPE 12.0 % with the stated ratio, 5.7 % with the measured fraction.

``data/gemm_measured.yaml`` keeps the measurements by GPU and the catalogue GPUs each applies to (the same die and
library).
"""

from __future__ import annotations

import math
from functools import cache
from importlib import resources

import yaml
from pydantic import BaseModel, ConfigDict, Field

UNALIGNED_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Alignment in bytes of the microbenchmark's odd dimension per dtype (one element), in the order a γ is taken."""


def alignment_exponent_from(slowdown: float, dtype: str) -> float:
    """γ such that (a/16)^γ reproduces a measured unaligned/aligned time-per-FLOP ratio (dimensionless):
    γ = ln(slowdown) / ln(16/a), a = :data:`UNALIGNED_BYTES` [dtype]; 0 when the unaligned GEMM was not slower."""
    return max(0.0, math.log(slowdown) / math.log(16.0 / UNALIGNED_BYTES[dtype]))


class MeasuredAlignment(BaseModel):
    """One GPU's measured unaligned-GEMM slowdowns (dimensionless, per dtype) and where they come from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    slowdown: dict[str, float] = Field(description="unaligned / aligned time per FLOP, by dtype")
    fp32_gemm_fraction: float | None = Field(default=None, gt=0, le=1,
                                             description="an 8192³ fp32 GEMM's achieved / catalogue fp32 peak")
    fp8_gemm_fraction: float | None = Field(default=None, gt=0, le=1,
                                            description="an 8192³ fp8 GEMM's achieved / catalogue fp8 peak")
    shape: dict[str, int] = Field(default_factory=dict, description="the GEMM measured (m, n, k, padded_n)")
    applies_to: tuple[str, ...] = Field(description="catalogue GPU names that run the same kernels")
    source: str

    def exponent(self) -> float | None:
        """γ from the first 16-bit dtype measured (bf16, then fp16), or None."""
        for dtype in ("bf16", "fp16"):
            if dtype in self.slowdown:
                return alignment_exponent_from(self.slowdown[dtype], dtype)
        return None


@cache
def measured_table() -> dict[str, MeasuredAlignment]:
    """``data/gemm_measured.yaml``'s measurements by the GPU they were taken on."""
    text = resources.files("optplan.estimators").joinpath("data/gemm_measured.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text) or {}
    return {name: MeasuredAlignment(**entry) for name, entry in (raw.get("measured") or {}).items()}


def catalogue_fp32_fraction(gpu_name: str) -> float | None:
    """The fp32 GEMM fraction measured on a GPU of ``gpu_name``'s kind, or None."""
    for m in measured_table().values():
        if gpu_name in m.applies_to and m.fp32_gemm_fraction is not None:
            return m.fp32_gemm_fraction
    return None


def catalogue_fp8_fraction(gpu_name: str) -> float | None:
    """The fp8 GEMM fraction measured on a GPU of ``gpu_name``'s kind, or None."""
    for m in measured_table().values():
        if gpu_name in m.applies_to and m.fp8_gemm_fraction is not None:
            return m.fp8_gemm_fraction
    return None


def catalogue_alignment(gpu_name: str) -> tuple[float, str] | None:
    """(γ, a note naming the measurement) for a catalogue GPU a measurement applies to, or None."""
    for measured_on, m in measured_table().items():
        gamma = m.exponent()
        if gpu_name in m.applies_to and gamma is not None:
            return gamma, f"GEMM alignment exponent {gamma:.3f} measured on the {measured_on} (data/gemm_measured.yaml)"
    return None


__all__ = ["UNALIGNED_BYTES", "MeasuredAlignment", "alignment_exponent_from", "catalogue_alignment",
           "catalogue_fp8_fraction", "catalogue_fp32_fraction", "measured_table"]
