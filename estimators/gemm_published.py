"""Published matmul ceilings: how close each GPU's fastest GEMM comes to its datasheet peak, one method for all.

The time model's GEMM fraction is fitted per GPU on measured training runs (efficiency.yaml: A100 on vTrain, H100
on llm-foundry). A GPU without a fit of its own (the B200, the GB200) derives from a fitted one; until 2026-12 it
took the fitted fraction against its own datasheet peak, as if every GPU reached the same share of its peak. They
do not: Stas Bekman's maximum achievable matmul FLOPS (MAMF) table (stas00/ml-engineering, compute/accelerator,
``mamf-finder.py``: torch.matmul over a sweep of shapes, the best shape's mean TFLOP/s) measured, in BF16, the
A100 SXM at 86.9 % of its 312 TFLOP/s, the H100 SXM at 80.3 % of 989, the B200 at 77.6 % of 2,250 and the GB200
at 72.9 % of 2,500: the GB200's datasheet is 11 % above the B200's, its measured matmul 4.4 % (its 1,200 W part
is quoted at a clock it does not hold under a full tensor-core load). A derived GPU's GEMM fraction is therefore
the fitted GPU's times the ratio of the two measured shares (dimensionless):

    gemm_peak_fraction[derived] = gemm_peak_fraction[from] · (MAMF[derived] / peak[derived]) / (MAMF[from] / peak[from])

in the 16-bit dtype the fit was made in (bf16). The fp8 rows of the table are kept as data but not applied:
the table's fp8 share over its bf16 share (0.98-0.99 on Blackwell) would make Blackwell's fp8 GEMMs 1.3x faster
than the stated fp8 ratio (0.75 of the 16-bit fraction) does, and the measured fp8 training runs say otherwise:
with it, Megatron-Bridge's B200 runs are priced at a median 0.87 of their step (12.0 % MAPE) and the GB200 ones at
0.80-0.83 (15.8-17.1 %), against 1.01 and 0.94-0.95 with the stated ratio (benchmarks/published_sets.py). Transformer
Engine's fp8 on Blackwell (current scaling, MXFP8) quantises in kernels of its own, which the ratio stands in for.

A derivation opts in with ``gemm_ceiling: true`` (efficiency.yaml: the B200, x0.965, and the GB200, x0.907).
Checked, never fitted (benchmarks/fidelity_published.py): the GB200 runs of Megatron-Bridge went from 11.6 % MAPE
(median predicted/measured 0.88) to 10.5 % (0.94), the DGX Cloud recipes' release-25.05 GB200 runs from 15.7 %
(0.84) to 10.2 % (0.89), the B200 runs from 4.1 % (0.99) to 4.3 % (1.01). Pure data and lookups; no torch.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import yaml
from pydantic import BaseModel, ConfigDict, Field


class PublishedCeiling(BaseModel):
    """One GPU's published maximum achievable matmul TFLOP/s and the datasheet peak it is a share of."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    measured_as: str = Field(description="the table's row name")
    applies_to: tuple[str, ...] = Field(description="catalogue GPU names the row stands for")
    tflops: dict[str, float] = Field(description="measured dense TFLOP/s by input dtype")
    theory: dict[str, float] = Field(description="the datasheet dense TFLOP/s by input dtype the table divides by")
    software: str = ""

    def share(self, dtype: str) -> float | None:
        """Measured ÷ datasheet peak in ``dtype`` (dimensionless), or None where not measured."""
        if dtype not in self.tflops or dtype not in self.theory:
            return None
        return self.tflops[dtype] / self.theory[dtype]


class PublishedCeilings(BaseModel):
    """``data/gemm_published.yaml``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str
    gpus: dict[str, PublishedCeiling]


@cache
def published_ceilings() -> PublishedCeilings:
    """The packaged table (read once; immutable)."""
    text = resources.files("optplan.estimators").joinpath("data/gemm_published.yaml").read_text(encoding="utf-8")
    return PublishedCeilings(**yaml.safe_load(text))


def ceiling_share(gpu_name: str, dtype: str = "bf16") -> float | None:
    """The published matmul share of peak (MAMF ÷ datasheet) of the row standing for catalogue ``gpu_name``."""
    for row in published_ceilings().gpus.values():
        if gpu_name in row.applies_to:
            return row.share(dtype)
    return None


def ceiling_ratio(gpu_name: str, from_gpu: str, dtype: str = "bf16") -> float | None:
    """MAMF share of ``gpu_name`` over that of ``from_gpu`` (dimensionless; module docstring), None unless both are
    in the table."""
    mine, theirs = ceiling_share(gpu_name, dtype), ceiling_share(from_gpu, dtype)
    if mine is None or theirs is None:
        return None
    return mine / theirs


__all__ = ["PublishedCeiling", "PublishedCeilings", "ceiling_ratio", "ceiling_share", "published_ceilings"]
