"""Measured ceilings (estimators/ceilings.py): the replaced datasheet figures make the time model reproduce
the measured achieved figures, unmeasured figures stay, step time follows a slower measured GEMM, bad
figures are rejected, and the module keeps torch out."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from optplan.estimators.ceilings import (
    MeasuredCeilings,
    alignment_exponent_from,
    ceiling_report,
    gemm_fraction,
    gpu_with_measured_ceilings,
    measured_alignment,
)
from optplan.estimators.comm import link_for, ring_all_reduce_s
from optplan.estimators.compute import A100_FIT, DEFAULT_EFFICIENCY, efficiency_for, gemm_time_s
from optplan.estimators.hardware import Cluster, GPUSpec, find_gpu
from optplan.estimators.parallel import GroupPlacement
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.timing import step_time

MEASURED = MeasuredCeilings(matmul_flops_per_s={"bf16": 600e12, "fp32": 30e12, "fp8": 900e12},
                            copy_bytes_per_s=1.5e12, allreduce_bus_bytes_per_s=250e9, source="test rig")


@pytest.mark.parametrize("eff", [A100_FIT, DEFAULT_EFFICIENCY], ids=["a100-fit", "default"])
def test_replaced_ceilings_times_the_fractions_give_back_the_measurements(eff, gpu: GPUSpec) -> None:
    new = gpu_with_measured_ceilings(gpu, MEASURED, eff)
    for dtype, achieved in MEASURED.matmul_flops_per_s.items():
        assert new.peak_flops[dtype] * gemm_fraction(eff, dtype) == pytest.approx(achieved)
    assert new.memory_bandwidth_bytes_per_s * eff.hbm_fraction == pytest.approx(1.5e12)
    assert new.intra_node_bandwidth_bytes_per_s * eff.intra_node_link_fraction == pytest.approx(250e9)


def test_time_model_reproduces_the_measured_gemm_copy_and_allreduce(gpu: GPUSpec) -> None:
    """Through the model's own functions: a large square bf16 GEMM runs at the measured FLOP/s (up to the
    x/(x+½) wave factor, ~1 at n = 8192), an intra-node all-reduce at the measured nccl-tests busbw."""
    eff = efficiency_for(gpu)
    new = gpu_with_measured_ceilings(gpu, MEASURED)
    n = 8192
    t = gemm_time_s(n, n, n, peak_flops=new.peak_flops_for("bf16"),
                    bandwidth_bytes_per_s=new.memory_bandwidth_bytes_per_s, eff=eff, elem_bytes=2,
                    fraction=gemm_fraction(eff, "bf16"))
    assert 2 * n**3 / t == pytest.approx(600e12, rel=2e-3)
    cluster = Cluster(gpu=new, gpus=8, gpus_per_node=8)
    link = link_for(GroupPlacement(ranks=8, nodes=1), cluster, intra_fraction=eff.intra_node_link_fraction,
                    intra_alpha_s=0.0)
    size = 2**30
    busbw = size / ring_all_reduce_s(size, 8, link.bandwidth_bytes_per_s, 0.0) * 2 * 7 / 8  # nccl-tests
    assert busbw == pytest.approx(250e9)


def test_unmeasured_figures_keep_the_datasheet_and_the_name() -> None:
    gpu = find_gpu("H100-SXM")
    new = gpu_with_measured_ceilings(gpu, MeasuredCeilings(matmul_flops_per_s={"bf16": 700e12}))
    assert new.name == gpu.name and efficiency_for(new) is efficiency_for(gpu)
    for dtype in ("fp32", "tf32", "fp16", "fp8"):
        assert new.peak_flops[dtype] == gpu.peak_flops[dtype]
    assert new.peak_flops["bf16"] == pytest.approx(700e12 / gemm_fraction(efficiency_for(gpu), "bf16"))
    assert new.memory_bandwidth_bytes_per_s == gpu.memory_bandwidth_bytes_per_s
    assert new.intra_node_bandwidth_bytes_per_s == gpu.intra_node_bandwidth_bytes_per_s
    assert new.source.startswith(gpu.source) and "bf16 matmul" in new.source
    assert "memory bandwidth" not in new.source
    assert gpu_with_measured_ceilings(gpu, MeasuredCeilings()) is gpu


def test_measured_dtype_missing_from_the_datasheet_is_added(gpu: GPUSpec) -> None:
    gpu = gpu.model_copy(update={"peak_flops": {"fp32": 50e12, "fp16": 1000e12}})
    new = gpu_with_measured_ceilings(gpu, MeasuredCeilings(matmul_flops_per_s={"bf16": 100e12}))
    assert new.supports_bf16 and not gpu.supports_bf16


def test_step_time_follows_the_measured_matmul_and_copy(gpu: GPUSpec, profile: ModelProfile) -> None:
    """tests/conftest.py's GPT-2-small-like profile on its test GPU (bf16 1000 TFLOP/s datasheet: the model
    assumes 860 achieved)."""
    prof = profile
    strat = Strategy(precision="bf16", mbs=8, engine="megatron")
    datasheet = step_time(prof, strat, Cluster(gpu=gpu, gpus=1, gpus_per_node=1))

    def timed(measured: MeasuredCeilings):
        return step_time(prof, strat, Cluster(gpu=gpu_with_measured_ceilings(gpu, measured), gpus=1,
                                              gpus_per_node=1))

    slow = timed(MeasuredCeilings(matmul_flops_per_s={"bf16": 400e12}))
    fast = timed(MeasuredCeilings(matmul_flops_per_s={"bf16": 900e12}))
    assert slow.step_s > datasheet.step_s > fast.step_s
    assert slow.compute_s > 1.8 * datasheet.compute_s  # 860/400: GEMM-bound layers slow down ~2x
    assert slow.memory_bound_s == pytest.approx(datasheet.memory_bound_s)
    same = timed(MeasuredCeilings(matmul_flops_per_s={"bf16": 1000e12 * gemm_fraction(efficiency_for(gpu), "bf16")}))
    assert same.step_s == pytest.approx(datasheet.step_s)
    slow_mem = timed(MeasuredCeilings(copy_bytes_per_s=0.5e12))  # vs 0.85 × 2 TB/s assumed
    assert slow_mem.memory_bound_s > datasheet.memory_bound_s and slow_mem.step_s > datasheet.step_s


def test_slower_measured_link_slows_tensor_parallel_steps(gpu: GPUSpec, profile: ModelProfile) -> None:
    prof = profile
    strat = Strategy(precision="bf16", mbs=8, tp=8, engine="megatron")
    base = step_time(prof, strat, Cluster(gpu=gpu, gpus=8, gpus_per_node=8))
    slow_link = gpu_with_measured_ceilings(gpu, MeasuredCeilings(allreduce_bus_bytes_per_s=50e9))
    slow = step_time(prof, strat, Cluster(gpu=slow_link, gpus=8, gpus_per_node=8))
    assert slow.tp_comm_s > base.tp_comm_s and slow.step_s > base.step_s


@pytest.mark.parametrize("bad", [
    {"matmul_flops_per_s": {"bf16": 0.0}},
    {"matmul_flops_per_s": {"fp32": -1e12}},
    {"matmul_flops_per_s": {"bf16": float("nan")}},
    {"matmul_flops_per_s": {"int8": 1e12}},
    {"copy_bytes_per_s": 0.0},
    {"copy_bytes_per_s": float("inf")},
    {"allreduce_bus_bytes_per_s": -5.0},
    {"hbm_bytes_per_s": 1e12},
])
def test_validation_rejects_non_positive_or_unknown_figures(bad) -> None:
    with pytest.raises(ValidationError):
        MeasuredCeilings.model_validate(bad)


def test_measured_ceilings_are_frozen() -> None:
    with pytest.raises(ValidationError):
        MEASURED.copy_bytes_per_s = 1.0  # type: ignore[misc]


def test_ceiling_report_lines() -> None:
    gpu = find_gpu("H100-SXM")
    measured = MeasuredCeilings(matmul_flops_per_s={"fp16": 650e12, "bf16": 712e12},
                                copy_bytes_per_s=2.9e12, allreduce_bus_bytes_per_s=370e9)
    lines = ceiling_report(gpu, measured)
    eff = efficiency_for(gpu)
    gemm, hbm, link = (f"{100 * gemm_fraction(eff, 'bf16'):.0f}%", f"{100 * eff.hbm_fraction:.0f}%",
                       f"{100 * eff.intra_node_link_fraction:.0f}%")
    assert lines == [
        f"bf16 matmul: measured 712 TFLOP/s = 72% of datasheet 989.5 (model assumed {gemm})",
        f"fp16 matmul: measured 650 TFLOP/s = 66% of datasheet 989.5 (model assumed {gemm})",
        f"memory copy: measured 2,900 GB/s = 87% of datasheet 3,350 (model assumed {hbm})",
        f"all-reduce bus bandwidth: measured 370 GB/s = 82% of datasheet NVLink4 450 (model assumed {link})",
    ]
    a100 = find_gpu("A100-80GB")
    (fp8,) = ceiling_report(a100, MeasuredCeilings(matmul_flops_per_s={"fp8": 400e12}))
    assert fp8 == "fp8 matmul: measured 400 TFLOP/s (no datasheet figure for fp8)"
    (tiny,) = ceiling_report(gpu, MeasuredCeilings(matmul_flops_per_s={"fp32": 0.4e12}))
    fp32 = f"{100 * gemm_fraction(eff, 'fp32'):.0f}%"  # Hopper's measured fp32 GEMM fraction (gemm_measured.py)
    assert tiny == f"fp32 matmul: measured 0.4 TFLOP/s = 0.6% of datasheet 67 (model assumed {fp32})" and fp32 == "76%"
    assert ceiling_report(gpu, MeasuredCeilings()) == []


def test_ceilings_module_keeps_torch_out() -> None:
    code = ("import sys, optplan.estimators.ceilings; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'textual')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


def test_mfu_stays_quoted_against_the_datasheet(gpu: GPUSpec, profile: ModelProfile) -> None:
    """PaLM's MFU divides by the datasheet peak: measured ceilings change the step time, not the reference."""
    from optplan.estimators.timing import mfu_peak_flops

    measured = gpu_with_measured_ceilings(gpu, MEASURED)
    assert mfu_peak_flops(measured) == mfu_peak_flops(gpu) == gpu.peak_flops_for("bf16")
    cluster = Cluster(gpu=gpu, gpus=8, gpus_per_node=8)
    s = Strategy(precision="bf16", dp=8, mbs=4)
    t0, t1 = step_time(profile, s, cluster), step_time(profile, s, cluster.model_copy(update={"gpu": measured}))
    assert t1.mfu / t0.mfu == pytest.approx(t0.step_s / t1.step_s)


@pytest.mark.parametrize(("slowdown", "dtype", "gamma"), [
    (8.0, "bf16", 1.0), (2.0 ** 0.5, "fp16", 1 / 6), (4.0, "fp32", 1.0), (1.0, "bf16", 0.0), (0.9, "bf16", 0.0),
])
def test_alignment_exponent_reproduces_the_measured_slowdown(slowdown: float, dtype: str, gamma: float) -> None:
    """γ such that the model's (a/16)^γ gives the measured ratio back: a = 2 bytes (16-bit odd), 4 (fp32 odd);
    a measurement where the odd GEMM was not slower (noise) gives 0, never a speed-up."""
    got = alignment_exponent_from(slowdown, dtype)
    assert got == pytest.approx(gamma)
    if slowdown >= 1:
        a = 2 if dtype != "fp32" else 4
        assert (16 / a) ** got == pytest.approx(slowdown)


def test_measured_alignment_prefers_the_16_bit_figure() -> None:
    both = MeasuredCeilings(unaligned_gemm_slowdown={"fp32": 4.0, "fp16": 8.0})
    assert measured_alignment(both) == ("fp16", pytest.approx(1.0))
    assert measured_alignment(MeasuredCeilings(unaligned_gemm_slowdown={"fp32": 2.0})) == ("fp32", pytest.approx(0.5))
    assert measured_alignment(MEASURED) is None and not both.empty


def _gpt2_dims_profile(profile: ModelProfile, vocab: int) -> ModelProfile:
    assert profile.transformer is not None
    return profile.model_copy(update={"transformer": profile.transformer.model_copy(update={"vocab": vocab})})


def test_a_measured_alignment_exponent_prices_unpadded_vocabularies_only(profile: ModelProfile) -> None:
    """The H200 GPT-2 runs (an unpadded 50,257 vocabulary) spent 42 ms in GEMMs where 24 were predicted: a
    microbenchmark that finds odd GEMMs 6x slower makes the head's GEMMs slower in every plan for that machine,
    and leaves a padded vocabulary's step time exactly as it was."""
    gpu = find_gpu("H200")
    strat = Strategy(precision="bf16", mbs=8, engine="torch")
    measured = gpu_with_measured_ceilings(gpu, MeasuredCeilings(unaligned_gemm_slowdown={"bf16": 6.0}))
    assert measured.gemm_alignment_exponent == pytest.approx(alignment_exponent_from(6.0, "bf16"))
    assert "bf16 unaligned GEMM" in measured.source and gpu.gemm_alignment_exponent is None

    def both(prof: ModelProfile):
        return (step_time(prof, strat, Cluster(gpu=gpu, gpus=1, gpus_per_node=1)),
                step_time(prof, strat, Cluster(gpu=measured, gpus=1, gpus_per_node=1)))

    base, slow = both(_gpt2_dims_profile(profile, 50257))
    assert slow.compute_s > base.compute_s and slow.step_s > base.step_s
    assert slow.memory_bound_s == pytest.approx(base.memory_bound_s)
    padded_base, padded = both(_gpt2_dims_profile(profile, 50304))
    assert padded.step_s == pytest.approx(padded_base.step_s)


def test_ceiling_report_states_the_unaligned_slowdown_against_the_model() -> None:
    gpu = find_gpu("H100-SXM")
    (line,) = ceiling_report(gpu, MeasuredCeilings(unaligned_gemm_slowdown={"bf16": 3.5}))
    assumed = 8 ** efficiency_for(gpu).alignment_exponent
    assert line == (f"bf16 GEMMs with an odd dimension (an unpadded vocabulary): measured 3.50x the time per FLOP "
                    f"of padded ones (model assumed {assumed:.2f}x)")

