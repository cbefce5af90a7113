"""One GEMM's time on one GPU: the roofline of its FLOPs and bytes, with the tensor cores' wave saturation and
alignment (seconds).

Roofline (Williams, Waterman & Patterson 2009, "Roofline", CACM 52(4), eq. 1): time = max(FLOPs / attainable
FLOP rate, bytes / attainable bandwidth), the FLOP rate the GPU's fitted large-GEMM fraction of peak
(efficiency.py) scaled by the outputs per wave and the worst dimension's alignment (the fits in
data/efficiency.yaml, compute.py's A100 docstring). Units: seconds; dimensions in elements.
"""

from __future__ import annotations

from optplan.estimators.efficiency import GpuEfficiency


def _align_bytes(dim: float, elem_bytes: int) -> int:
    """Largest power of two (<= 16) dividing ``dim`` × ``elem_bytes`` (bytes); 16 for non-integers."""
    n = int(dim)
    if n != dim or n <= 0:
        return 16
    n *= elem_bytes
    return min(16, n & -n)


def gemm_time_s(m: float, n: float, k: float, *, batch: float = 1.0, peak_flops: float, bandwidth_bytes_per_s: float,
                eff: GpuEfficiency, elem_bytes: int = 2, fraction: float | None = None, aligned: bool = False) -> float:
    """One (batched) GEMM C[m×n] = A[m×k]·B[k×n], ``batch`` times (seconds).

    Roofline: max(2·m·n·k·batch / (peak · f · x/(x+½) · (a/16)^γ), bytes / (hbm · BW)) with x the output
    elements per wave and a the worst dimension's alignment in bytes; bytes = elem·(mk + kn + mn)·batch. The
    alignment factor is the tensor cores' (16- and 8-bit elements): fp32 GEMMs run SIMT kernels that measured
    1.02x on an odd dimension (gemm_measured.py) and take none; nor do dimensions derived from parameter counts
    (``aligned``: an MLP width read as its weights ÷ 2h, which a router or a gate makes no GEMM's dimension).
    """
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    flops = 2.0 * m * n * k * batch
    x = m * n * batch / eff.gemm_wave_outputs
    align = 16 if aligned else min(_align_bytes(m, elem_bytes), _align_bytes(n, elem_bytes), _align_bytes(k, elem_bytes))
    f = eff.gemm_peak_fraction if fraction is None else fraction
    gamma = eff.alignment_exponent if elem_bytes <= 2 else 0.0
    rate = peak_flops * f * x / (x + 0.5) * (align / 16.0) ** gamma
    mem = elem_bytes * (m * k + k * n + m * n) * batch / (bandwidth_bytes_per_s * eff.hbm_fraction)
    return max(flops / rate, mem)


def gemm_train_time_s(m: float, n: float, k: float, *, weight_grad: bool = True, **kw: object) -> tuple[float, float]:
    """(forward, backward) seconds of a weight GEMM: backward = data gradient (m×k×n) + weight gradient
    (k×n×m) (Narayanan et al. 2021 §3: backward is twice the forward's FLOPs); a frozen weight
    (``weight_grad=False``: LoRA's base, Hu et al. 2021 §4.2, whose weights get no gradient) the data gradient only."""
    fwd = gemm_time_s(m, n, k, **kw)  # type: ignore[arg-type]
    bwd = gemm_time_s(m, k, n, **kw) + (gemm_time_s(k, n, m, **kw) if weight_grad else 0.0)  # type: ignore[arg-type]
    return fwd, bwd


__all__ = ["gemm_time_s", "gemm_train_time_s"]
