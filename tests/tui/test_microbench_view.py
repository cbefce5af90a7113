"""``optplan hardware --microbench``'s attention lines: a GPU's measured SDPA speed beside what torch plans are
priced at (estimators/attention_kernels.py)."""

from __future__ import annotations

from optplan.estimators.attention_kernels import attention_kernel
from optplan.estimators.hardware import find_gpu
from optplan.probes.microbench import MicrobenchResult
from optplan.tui.microbench_view import attention_lines


def test_a_gpus_attention_is_shown_against_the_priced_kernel() -> None:
    gpu = find_gpu("H100-SXM")
    peak = gpu.peak_flops_for("bf16")
    bench = MicrobenchResult(device="cuda", device_name="NVIDIA H100 80GB HBM3", torch_version="2.13.0",
                             matmul_flops_per_s={"bf16": 7e14}, copy_bytes_per_s=3e12,
                             attention_flops_per_s={"default": {8192: {"forward": 0.5 * peak, "backward": 0.4 * peak},
                                                                32768: {"forward": 0.6 * peak,
                                                                        "backward": 0.45 * peak}},
                                                    "flash": {32768: {"forward": 0.3 * peak, "backward": 0.3 * peak}}},
                             attention_skipped={"cudnn": "RuntimeError: no cuDNN attention on this build"})
    lines = attention_lines(bench, gpu)
    priced = attention_kernel("torch", gpu.name)
    assert priced is not None
    f_p, b_p = priced.fractions_at(32768)
    # the longest sequence of each backend; torch's own pick beside the kernel its plans are priced at
    assert lines[0].startswith("attention (default SDPA, causal, seq 32768)")
    assert "= 0.60 / 0.45 of the bf16 peak" in lines[0] and f"{priced.name}'s {f_p:.2f} / {b_p:.2f}" in lines[0]
    assert "= 0.30 / 0.30 of the bf16 peak" in lines[1] and "priced at" not in lines[1]
    assert lines[2] == "attention (cudnn SDPA): not measured (RuntimeError: no cuDNN attention on this build)"
    assert bench.attention_fractions(peak)["default"][8192] == (0.5, 0.4)
    # without a catalogued GPU: the rates only
    plain = attention_lines(bench, None)[0]
    assert plain.endswith(f"forward {0.6 * peak / 1e12:.3g}, backward {0.45 * peak / 1e12:.3g} TFLOP/s")
    assert "peak" not in plain
