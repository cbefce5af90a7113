"""estimators/gemm_published.py: a derived GPU's GEMM fraction follows the published matmul ceilings (MAMF table)."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import ArchSpec, profile_from_arch
from optplan.estimators.compute import layer_time, transformer_dims
from optplan.estimators.efficiency import Derivation, efficiency_for, efficiency_table, resolve
from optplan.estimators.gemm_published import ceiling_ratio, ceiling_share, published_ceilings
from optplan.estimators.hardware import find_gpu
from optplan.estimators.strategy import Strategy


def test_the_table_reads_as_published_shares_of_peak() -> None:
    table = published_ceilings()
    assert "ml-engineering" in table.source and "744d01e" in table.source
    assert ceiling_share("H100-SXM") == pytest.approx(794.5 / 989.0)
    assert ceiling_share("H200") == ceiling_share("H100-SXM")  # the table: "H200 is the same"
    assert ceiling_share("A100-80GB") == pytest.approx(271.2 / 312.0)
    assert ceiling_share("GB200") == pytest.approx(1822.0 / 2500.0)
    assert ceiling_share("GB200", "fp8") == pytest.approx(3615.6 / 5000.0)
    assert ceiling_share("A100-80GB", "fp8") is None  # no fp8 on Ampere
    assert ceiling_share("L40S") is None
    # every row names catalogue GPUs, each at most once, and its datasheet figure is the catalogue's
    names = [n for row in table.gpus.values() for n in row.applies_to]
    assert len(names) == len(set(names))
    for name in names:
        gpu = find_gpu(name)
        for dtype, theory in next(r for r in table.gpus.values() if name in r.applies_to).theory.items():
            assert 0.45 < gpu.peak_flops[dtype] / (theory * 1e12) < 1.05, (name, dtype)
    # Blackwell reaches a smaller share of its datasheet than Hopper, the GB200 the smallest
    assert ceiling_share("GB200") < ceiling_share("B200") < ceiling_share("H100-SXM") < ceiling_share("A100-80GB")


def test_blackwell_gemm_fractions_are_the_h100_fit_scaled_by_the_published_ratio() -> None:
    h100 = efficiency_for(find_gpu("H100-SXM"))
    for name in ("B200", "GB200", "B300"):
        eff = efficiency_for(find_gpu(name))
        ratio = ceiling_ratio(name, "H100-SXM")
        assert ratio is not None and ratio < 1.0
        assert eff.gemm_peak_fraction == pytest.approx(h100.gemm_peak_fraction * ratio)
        assert "published matmul share" in eff.source
        # only the GEMM fraction moves: the rest is the H100's
        assert eff.hbm_fraction == h100.hbm_fraction
        assert eff.flash_attention_fraction == h100.flash_attention_fraction
    # the H200 is the H100's die: no scaling
    assert efficiency_for(find_gpu("H200")).gemm_peak_fraction == h100.gemm_peak_fraction


def test_a_gb200_gemm_runs_at_its_measured_speed_over_a_b200_not_its_datasheet_ratio() -> None:
    """Datasheets: GB200 2,500 vs B200 2,250 TFLOP/s (1.11x); measured matmul 1,822 vs 1,745 (1.044x). A large layer's
    linear GEMMs are priced at the measured ratio."""
    dims = transformer_dims(profile_from_arch(ArchSpec(layers=2, hidden=8192, heads=64, seq=8192, vocab=32000)))
    assert dims is not None
    times = {}
    for name in ("B200", "GB200"):
        gpu = find_gpu(name)
        t = layer_time(dims, Strategy(precision="bf16", engine="megatron", mbs=2), gpu, efficiency_for(gpu))
        times[name] = t.fwd_gemm_s - t.attention_core_fwd_s
    assert times["B200"] / times["GB200"] == pytest.approx(1822.0 / 1745.0, rel=0.01)


def test_a_derivation_asking_for_a_ceiling_the_table_lacks_is_an_error() -> None:
    table = efficiency_table()
    bad = table.model_copy(update={"derived": {**table.derived, "L40S": Derivation(
        from_gpu="H100-SXM", gemm_ceiling=True, reason="test")}})
    with pytest.raises(ValueError, match="no row for L40S"):
        resolve(bad)
    # without the flag the same derivation is the H100's fraction unchanged
    ok = table.model_copy(update={"derived": {**table.derived, "L40S": Derivation(from_gpu="H100-SXM", reason="t")}})
    assert resolve(ok)["L40S"].gemm_peak_fraction == table.gpus["H100-SXM"].gemm_peak_fraction


def test_blackwell_ultra_takes_its_measured_b300_row_and_the_gb300_the_h100_share() -> None:
    """The table measured the B300 (1,769 of 2,250 TFLOP/s in BF16, 78.6 %) but has no GB300 row: the GB300, the same
    die at 1,400 W, keeps the H100's fraction of its own datasheet peak (stated in its derivation), which the
    Megatron-Bridge GB300 runs check (benchmarks/published_sets.py)."""
    assert ceiling_share("B300") == pytest.approx(1769.0 / 2250.0)
    assert ceiling_share("B300", "fp8") == pytest.approx(3353.3 / 4500.0)
    assert ceiling_share("B200") < ceiling_share("B300") < ceiling_share("H100-SXM")
    assert ceiling_share("GB300") is None
    h100 = efficiency_for(find_gpu("H100-SXM"))
    gb300 = efficiency_for(find_gpu("GB300"))
    assert gb300.gemm_peak_fraction == h100.gemm_peak_fraction
    assert "GB300" in gb300.source and "no published matmul ceiling" in gb300.source
    # at equal 16-bit datasheet peaks the GB300's GEMMs are priced faster than the GB200's measured ceiling allows
    gb200 = efficiency_for(find_gpu("GB200"))
    assert find_gpu("GB300").peak_flops_for("bf16") == find_gpu("GB200").peak_flops_for("bf16")
    assert gb300.gemm_peak_fraction > gb200.gemm_peak_fraction

