"""Measured ceilings: turn microbenchmark figures into the GPU figures the time model uses.

The time model (compute.py, comm.py, timing.py) never uses a datasheet figure raw: it applies an
achieved fraction from the GPU's :class:`~optplan.estimators.compute.GpuEfficiency` first:
- a large aligned GEMM in dtype d runs at ``peak_flops[d] · f_d`` with
  f_d = min(MAX_GEMM_FRACTION, gemm_peak_fraction · GEMM_DTYPE_FRACTION[d]) (compute.py ``gemm_time_s``
  and ``_fraction``; the wave-quantisation factor x/(x + ½) is ~1 for a large GEMM: an 8192² output is
  x ≈ 470 waves of the A100 fit's 1.4e5 outputs);
- memory-bound work streams at ``memory_bandwidth_bytes_per_s · hbm_fraction`` (compute.py roofline,
  elementwise ops, timing.py gradient accumulation);
- an intra-node collective runs at ``intra_node_bandwidth_bytes_per_s · intra_node_link_fraction``
  (comm.py ``link_for``), and that product is used as B in the ring all-reduce time 2(n−1)/n · S / B
  (comm.py ``ring_all_reduce_s``; Thakur, Rabenseifner & Gropp 2005). nccl-tests defines the all-reduce
  bus bandwidth as busbw = S / t · 2(n−1)/n (NVIDIA nccl-tests, doc/PERFORMANCE.md, "Bus bandwidth"), so
  the model's B *is* the bus bandwidth (``GpuEfficiency.intra_node_link_fraction`` is documented as
  "achieved bus bandwidth / datasheet link"; both are per GPU, one way): no conversion by n is needed.

So that the model reproduces what was measured, a measured achieved figure replaces the datasheet
ceiling divided by the same fraction (units: FLOP/s and bytes/s):

    peak_flops[d]                    = measured matmul FLOP/s [d] / f_d
    memory_bandwidth_bytes_per_s     = measured copy bytes/s / hbm_fraction
    intra_node_bandwidth_bytes_per_s = measured all-reduce busbw / intra_node_link_fraction
    gemm_alignment_exponent          = ln(measured unaligned slowdown) / ln(16 / a)

The last one is the γ of the GEMM alignment factor (a/16)^γ (compute.py ``gemm_time_s``; NVIDIA Deep Learning
Performance Guide, "Matrix Multiplication Background", "Tensor Core Requirements"): the microbenchmark times a
language-model head's three training GEMMs with an odd vocabulary against a padded one (microbench_child.py),
so a = 2 bytes in 16-bit and 4 in fp32; the 16-bit figure is used (bf16, else fp16), else fp32's. vTrain's A100
fit could not separate γ from the cross-entropy bytes per logit (benchmarks/fidelity_vtrain.py): a measured γ
replaces the fitted one for that machine's plans (efficiency.py ``efficiency_for``).

and the model, multiplying back by the fraction, predicts exactly the measured figure for the
benchmark's own operation (a large square GEMM, a large device copy counted as read + write per the
STREAM convention, a large all-reduce). Everything else the model derives from those ceilings (small
GEMMs, alignment, elementwise kernels, small collectives) scales with them. Dtypes that were not
measured, and figures that are None, keep their datasheet values; the returned spec keeps the GPU's
name (so ``efficiency_for`` still finds its fit) and its ``source`` lists the measured figures.

Caveats the caller should know (stated, not corrected here):
- Pass the same ``efficiency`` that ``step_time`` will use (default: ``efficiency_for(gpu)``); another
  one would not reproduce the measurement.
- MFU (timing.py ``mfu_peak_flops``) takes its reference peak from the spec: on a spec with measured
  ceilings it is measured / f, not the datasheet. Keep the datasheet spec for MFU if MFU must stay
  comparable across machines.
- The optimizer step and the FLOPs-only model's memory-bound traffic use the bandwidth without
  ``hbm_fraction`` (compute.py), so there the replaced figure is 1/hbm_fraction above the measured one,
  as the datasheet figure was before.
- The A100 fit's ``intra_node_link_fraction`` is effective for the 2-32 MB all-reduces of its data (186
  of 300 GB/s, below nccl-tests' large-message ~230 GB/s); replacing the link with a large-message busbw
  makes such collectives that much faster in the model. The microbenchmark keeps busbw by size.
- The figures are the measuring device's: apply CPU measurements to a CPU-sized spec only (tests).
"""

from __future__ import annotations

from typing import Annotated, get_args

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.compute import GpuEfficiency, efficiency_for
from optplan.estimators.compute import _fraction as _gemm_fraction
from optplan.estimators.gemm_measured import UNALIGNED_BYTES, alignment_exponent_from
from optplan.estimators.hardware import Dtype, GPUSpec

PositiveFinite = Annotated[float, Field(gt=0, allow_inf_nan=False)]
DTYPE_ORDER: tuple[str, ...] = get_args(Dtype)


class MeasuredCeilings(BaseModel):
    """Achieved figures measured on this machine (every one optional; None/absent = not measured).

    Units: FLOP/s per dtype for square GEMMs (2·n³ FLOPs each), bytes/s for a device copy counted as
    bytes read + bytes written (STREAM convention), bytes/s of all-reduce bus bandwidth (nccl-tests).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    matmul_flops_per_s: dict[Dtype, PositiveFinite] = Field(default_factory=dict,
                                                            description="achieved large-GEMM FLOP/s per dtype")
    copy_bytes_per_s: PositiveFinite | None = Field(default=None, description="device copy, read + write")
    allreduce_bus_bytes_per_s: PositiveFinite | None = Field(default=None,
                                                             description="all-reduce busbw, per GPU one way")
    unaligned_gemm_slowdown: dict[Dtype, PositiveFinite] = Field(
        default_factory=dict, description="per dtype, a head's training GEMMs' time per FLOP with an odd "
                                          "vocabulary over a padded one (microbench_child.py)")
    source: str = Field(default="", description="where the figures come from (device, tool, date)")

    @property
    def empty(self) -> bool:
        """True when nothing was measured."""
        return (not self.matmul_flops_per_s and self.copy_bytes_per_s is None and self.allreduce_bus_bytes_per_s is None
                and not self.unaligned_gemm_slowdown)


def measured_alignment(measured: MeasuredCeilings) -> tuple[str, float] | None:
    """(dtype, γ) from the unaligned-GEMM figure the time model takes (bf16, else fp16, else fp32), or None."""
    for dtype in UNALIGNED_BYTES:  # bf16, fp16, fp32
        slowdown = measured.unaligned_gemm_slowdown.get(dtype)  # type: ignore[call-overload]
        if slowdown is not None:
            return dtype, alignment_exponent_from(slowdown, dtype)
    return None


def gemm_fraction(eff: GpuEfficiency, dtype: str) -> float:
    """Achieved / peak of a large aligned GEMM in ``dtype`` as the time model uses it (dimensionless):
    min(MAX_GEMM_FRACTION, gemm_peak_fraction · GEMM_DTYPE_FRACTION[dtype]) (compute.py), or the fraction
    measured on a GPU of its kind (gemm_measured.py: fp32, and fp8's kernel alone, the GEMM the microbenchmark
    times)."""
    return _gemm_fraction(eff, dtype, fp8_kernels_only=True)


def gpu_with_measured_ceilings(gpu: GPUSpec, measured: MeasuredCeilings,
                               efficiency: GpuEfficiency | None = None) -> GPUSpec:
    """``gpu`` with its ceilings replaced by measured achieved figures / the model's fractions (module
    docstring): peak FLOP/s per measured dtype, HBM bandwidth, intra-node link bandwidth (FLOP/s,
    bytes/s). Unmeasured figures keep the datasheet's; ``gpu`` is returned as is when nothing was measured.
    """
    if measured.empty:
        return gpu
    eff = efficiency or efficiency_for(gpu)
    update: dict[str, object] = {}
    parts: list[str] = []
    if measured.matmul_flops_per_s:
        peaks = dict(gpu.peak_flops)
        dtypes = [d for d in DTYPE_ORDER if d in measured.matmul_flops_per_s]
        for dtype in dtypes:
            peaks[dtype] = measured.matmul_flops_per_s[dtype] / gemm_fraction(eff, dtype)  # type: ignore[index]
        update["peak_flops"] = peaks
        parts.append(f"{'/'.join(dtypes)} matmul")
    if measured.copy_bytes_per_s is not None:
        update["memory_bandwidth_bytes_per_s"] = measured.copy_bytes_per_s / eff.hbm_fraction
        parts.append("memory bandwidth")
    if measured.allreduce_bus_bytes_per_s is not None:
        update["intra_node_bandwidth_bytes_per_s"] = measured.allreduce_bus_bytes_per_s / eff.intra_node_link_fraction
        parts.append("intra-node all-reduce bandwidth")
    alignment = measured_alignment(measured)
    if alignment is not None:
        update["gemm_alignment_exponent"] = alignment[1]
        parts.append(f"{alignment[0]} unaligned GEMM")
    if gpu.mfu_reference_flops is None:
        from optplan.estimators.timing import mfu_peak_flops
        update["mfu_reference_flops"] = mfu_peak_flops(gpu)  # MFU stays quoted against the datasheet
    origin = measured.source or "microbenchmark"
    update["source"] = (f"{gpu.source}; measured ({origin}): {', '.join(parts)} "
                        "(ceiling = measured / the model's achieved fraction)")
    return GPUSpec.model_validate({**gpu.model_dump(), **update})


def _num(value: float) -> str:
    """Four significant figures, whole numbers from 1,000 on (712.3, 989.5, 1,979, 0.4192)."""
    return f"{value:,.0f}" if value >= 1000 else f"{value:.4g}"


def _pct(fraction: float) -> str:
    """A fraction as a percentage: whole percent from 10 % on, two significant figures below (0.15%)."""
    pct = 100 * fraction
    return f"{pct:.0f}%" if pct >= 10 else f"{pct:.2g}%"


def ceiling_report(gpu: GPUSpec, measured: MeasuredCeilings,
                   efficiency: GpuEfficiency | None = None) -> list[str]:
    """One line per measured figure against the datasheet, e.g.
    ``bf16 matmul: measured 712 TFLOP/s = 72% of datasheet 989.5 (model assumed 86%)`` (TFLOP/s, GB/s).
    "model assumed" is the achieved fraction the time model applies to the datasheet figure."""
    eff = efficiency or efficiency_for(gpu)
    lines: list[str] = []
    for dtype in DTYPE_ORDER:
        achieved = measured.matmul_flops_per_s.get(dtype)  # type: ignore[call-overload]
        if achieved is None:
            continue
        sheet = gpu.peak_flops_for(dtype)  # type: ignore[arg-type]
        head = f"{dtype} matmul: measured {_num(achieved / 1e12)} TFLOP/s"
        if sheet > 0:
            lines.append(f"{head} = {_pct(achieved / sheet)} of datasheet {_num(sheet / 1e12)} "
                         f"(model assumed {_pct(gemm_fraction(eff, dtype))})")
        else:
            lines.append(f"{head} (no datasheet figure for {dtype})")
    if measured.copy_bytes_per_s is not None:
        sheet = gpu.memory_bandwidth_bytes_per_s
        lines.append(f"memory copy: measured {_num(measured.copy_bytes_per_s / 1e9)} GB/s = "
                     f"{_pct(measured.copy_bytes_per_s / sheet)} of datasheet {_num(sheet / 1e9)} "
                     f"(model assumed {_pct(eff.hbm_fraction)})")
    for dtype, slowdown in measured.unaligned_gemm_slowdown.items():
        assumed = (16.0 / UNALIGNED_BYTES[dtype]) ** eff.alignment_exponent if UNALIGNED_BYTES[dtype] <= 2 else 1.0
        lines.append(f"{dtype} GEMMs with an odd dimension (an unpadded vocabulary): measured {slowdown:.2f}x the "
                     f"time per FLOP of padded ones (model assumed {assumed:.2f}x)")
    if measured.allreduce_bus_bytes_per_s is not None:
        sheet = gpu.intra_node_bandwidth_bytes_per_s
        lines.append(f"all-reduce bus bandwidth: measured {_num(measured.allreduce_bus_bytes_per_s / 1e9)} GB/s = "
                     f"{_pct(measured.allreduce_bus_bytes_per_s / sheet)} of datasheet {gpu.intra_node_link} "
                     f"{_num(sheet / 1e9)} (model assumed {_pct(eff.intra_node_link_fraction)})")
    return lines


__all__ = ["UNALIGNED_BYTES", "MeasuredCeilings", "alignment_exponent_from", "ceiling_report", "gemm_fraction",
           "gpu_with_measured_ceilings", "measured_alignment"]
