"""What ``optplan hardware --microbench`` prints: the measured ceilings, against the datasheet and the time model's
figures when the device is a catalogued GPU."""

from __future__ import annotations

from typing import Any

from rich.console import Console


def print_microbench(out: Console, bench: Any, report: Any) -> None:
    """Measured figures; against the datasheet when the device is a catalogued GPU."""
    out.print(f"microbenchmarks on {bench.device_name} ({bench.device}, torch {bench.torch_version}, "
              f"{bench.wall_s:.0f} s):")
    catalogue = next((d.catalogue_name for d in report.devices if d.catalogue_name), None) if report.available else None
    if bench.device == "cuda" and catalogue:
        from optplan.estimators.ceilings import ceiling_report
        from optplan.estimators.hardware import find_gpu
        gpu = find_gpu(catalogue)
        for line in ceiling_report(gpu, bench.ceilings()):
            out.print(f"  {line}")
        for line in attention_lines(bench, gpu):
            out.print(f"  {line}")
        return
    for dtype, flops in bench.matmul_flops_per_s.items():
        out.print(f"  {dtype} matmul: {flops / 1e12:.3g} TFLOP/s")
    for dtype, slowdown in bench.unaligned_gemm_slowdown.items():
        out.print(f"  {dtype} GEMMs with an odd dimension: {slowdown:.2f}x the time per FLOP of padded ones")
    out.print(f"  copy: {bench.copy_bytes_per_s / 1e9:.3g} GB/s (read + write)")
    for line in attention_lines(bench, None):
        out.print(f"  {line}")
    if bench.allreduce_bus_bytes_per_s is not None:
        out.print(f"  all-reduce bus bandwidth over {bench.allreduce_ranks} ranks: "
                  f"{bench.allreduce_bus_bytes_per_s / 1e9:.3g} GB/s")
    if bench.device == "cpu":
        out.print("  (CPU figures: they are not used to plan for a GPU)", style="dim")


def attention_lines(bench: Any, gpu: Any) -> list[str]:
    """Causal attention per SDPA backend at its longest measured sequence: TFLOP/s, and on a catalogued GPU the
    fractions of its dense 16-bit peak beside those the time model prices torch plans at
    (estimators/attention_kernels.py)."""
    lines = []
    for backend, by_seq in bench.attention_flops_per_s.items():
        seq = max(by_seq)
        fwd, bwd = by_seq[seq]["forward"], by_seq[seq]["backward"]
        text = f"attention ({backend} SDPA, causal, seq {seq}): forward {fwd / 1e12:.3g}, backward {bwd / 1e12:.3g} TFLOP/s"
        if gpu is not None:
            from optplan.estimators.attention_kernels import attention_kernel

            peak = gpu.peak_flops_for("bf16")
            text += f" = {fwd / peak:.2f} / {bwd / peak:.2f} of the bf16 peak"
            priced = attention_kernel("torch", gpu.name)
            if priced is not None and backend == "default":
                f_p, b_p = priced.fractions_at(seq)
                text += f" (torch plans are priced at {priced.name}'s {f_p:.2f} / {b_p:.2f})"
        lines.append(text)
    lines += [f"attention ({backend} SDPA): not measured ({why})" for backend, why in bench.attention_skipped.items()]
    return lines


__all__ = ["attention_lines", "print_microbench"]
