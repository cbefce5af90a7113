"""What came back from the H200 (benchmarks/results/2026-11-26-H200) keeps judging the model: the committed files
are results files ``optplan calibrate`` reads, and today's memory model meets them (deterministic: allocated bytes,
not times)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optplan.estimators.uncertainty import model_kind
from optplan.planner.results import read_results
from optplan.tui.cli import app

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "benchmarks" / "results" / "2026-11-26-H200"
SCRIPT = ROOT / "benchmarks" / "fidelity_gpu_results.py"


@pytest.fixture(scope="module")
def campaign_rows() -> list:
    """Every committed GPU run as fidelity_gpu_results.campaign_rows() prices it: computed once for this file's tests
    (it profiles each model the campaigns ran, about 12 s apiece on this CPU)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fidelity_gpu_results

    return fidelity_gpu_results.campaign_rows()


def test_the_committed_h200_results_are_results_files_with_measured_runs() -> None:
    files = sorted(H200.rglob("fidelity.json")) + sorted(H200.rglob("grid.json"))
    assert len(files) == 3
    cases = [c for f in files for c in read_results(f)]
    assert len(cases) >= 35 and {c.gpu for c in cases} == {"H200"}
    assert all(c.comparison.result.peak_allocated_bytes for c in cases if c.comparison.result.ok)


def test_optplan_calibrate_folds_them_into_a_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cal.json"
    files = [str(p) for p in sorted(H200.rglob("fidelity.json"))]
    result = CliRunner().invoke(app, ["calibrate", *files, "--cache", str(cache)])
    assert result.exit_code == 0, result.output
    assert cache.exists() and "H200" in cache.read_text()


def test_todays_memory_model_meets_the_h200_gpt2_runs() -> None:
    """GPT-2 small on one H200, single-process torch runs in fp32 and 16-bit weights: allocated bytes within 1%
    (before cuBLAS's two 32 MiB workspaces were counted: 0.4-2.7% under). The AMP runs are printed, not held to
    it (CPU and CUDA autocast differ at the loss: see the results README)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), str(H200), "--models", "gpt2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("gpu results: memory median") and lines[-1].endswith("(H200)")
    rows = [line.split() for line in lines if line.startswith("H200   gpt2") and "[torch]" in line
            and not line.split()[2].startswith("amp")]
    assert len(rows) >= 8
    for row in rows:
        mem = next(tok for tok in row if tok.endswith("%"))
        assert abs(float(mem.rstrip("%"))) < 1.0, row


@pytest.mark.full
def test_the_committed_domain_holds_the_campaigns_sets_as_the_benchmark_writes_them(campaign_rows: list) -> None:
    """estimators/data/time_domain.yaml's H200 sets are fidelity_published.py --write-domain's, from these runs, and
    the host time per eager kernel is fit_eager_host.py's."""
    import yaml

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fidelity_published

    rows = campaign_rows  # every committed visit
    committed = [s for s in yaml.safe_load((ROOT / "estimators" / "data" / "time_domain.yaml").read_text())["sets"]
                 if "benchmarks/results" in s["source"]]
    groups: dict[tuple[str, str, str], list] = {}
    for r in rows:
        groups.setdefault((r.gpu, r.strategy.engine, model_kind(r.profile)), []).append(r)
    by_key = {(s["gpu"], s["engine"], s.get("kind", "transformer")): s for s in committed}
    assert set(groups) == set(by_key) and ("H200", "torch", "transformer") in by_key
    for key, rs in groups.items():
        fresh = fidelity_published._domain_entry("x", rs, rs)
        mine = by_key[key]
        assert mine["runs"] == fresh["runs"], key
        assert mine["ratio_low"] == pytest.approx(fresh["ratio_low"], abs=2e-3), key
        assert mine["ratio_high"] == pytest.approx(fresh["ratio_high"], abs=2e-3), key
    # and estimators/eager_host.py's HOST_KERNEL_S and CHECKPOINT_BLOCK_HOST_S are what benchmarks/fit_eager_host.py
    # fits on the same runs (the eager torch-engine ones, transformers among them), pricing them better than the fixed
    # host constants they replaced
    import fit_eager_host

    from optplan.estimators.eager_host import CHECKPOINT_BLOCK_HOST_S, HOST_KERNEL_S

    eager = fit_eager_host.eager_rows(rows)
    assert len({r.label.split(" ", 1)[0] for r in eager}) >= 5 and len(eager) >= 40
    assert any(r.strategy.checkpointing == "full" for r in eager)
    best, block, fixed_pct, fitted_pct = fit_eager_host.fit(eager)
    assert best == pytest.approx(HOST_KERNEL_S, abs=0.6e-6)
    assert block == pytest.approx(CHECKPOINT_BLOCK_HOST_S, abs=0.06e-3)
    assert fitted_pct < 0.6 * fixed_pct



@pytest.mark.full
def test_hoppers_channels_first_passes_are_what_fit_conv_layout_fits_on_the_committed_runs(campaign_rows: list) -> None:
    """estimators/data/conv_layout.yaml's H200 passes are benchmarks/fit_conv_layout.py's on the committed runs, and
    they price the channels-first ResNet-50 runs better than the RTX 3090's fit."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fit_conv_layout

    from optplan.estimators.conv_layout import measured_layout

    first, _ = fit_conv_layout.layout_rows(campaign_rows)
    assert {fit_conv_layout.math_of(r) for r in first} == {"16bit", "tf32"} and len(first) >= 8
    found = fit_conv_layout.fit(first)
    h200 = measured_layout()["H200"]
    assert found["16bit"] == pytest.approx(h200.passes_16bit, abs=0.26)
    assert found["tf32"] == pytest.approx(h200.passes_tf32, abs=0.26)
    before = fit_conv_layout._pct([fit_conv_layout._log_error(r, None, None) for r in first])
    after = fit_conv_layout._pct([fit_conv_layout._log_error(r, h200.passes_16bit, h200.passes_tf32) for r in first])
    assert after < 0.5 * before


def test_the_host_speed_line_says_whether_host_op_s_explains_the_errors() -> None:
    """fit_eager_host.py's diagnostic: too few runs carrying host_op_s say so; with them, Pearson's r of the log error
    against log host_op_s (a slow host's runs measured slower than predicted: r < 0) and their spread."""
    import math
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fit_eager_host
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def row(op_us: float | None) -> SimpleNamespace:
        return SimpleNamespace(extra={"source": "x", **({"host_op_s": f"{op_us * 1e-6:.6g}"} if op_us else {})})

    old = [row(None)] * 4
    assert fit_eager_host.host_speed_line(old, [0.1] * 4).startswith("host speed: 0 of 4 runs carry host_op_s (too few")
    ops = [2.0, 3.0, 4.0, 6.0]
    errors = [-0.5 * math.log(op / 3.0) for op in ops]  # the slower the host, the more the run is under-predicted
    line = fit_eager_host.host_speed_line([*map(row, ops), row(None)], [*errors, 0.0])
    assert "4 of 5 runs carry host_op_s (2.00-6.00 µs, median 3.50)" in line and line.endswith("r = -1.00")
