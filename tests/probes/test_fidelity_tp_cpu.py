"""benchmarks/fidelity_tp_cpu.py --quick: real CPU steps of a 2-layer Llama split by its own tp_plan (transformers'
DistributedConfig under torchrun, gloo: tp2 and tp2 x FSDP2 dp2, fp32 / amp-bf16 / bf16, checkpointing none and
full) against optplan's memory prediction. One quick run (8 cases, about 75 s on 2 cores) serves every test here.

The bounds come from that benchmark's measurements (benchmarks/results/fidelity_tp_cpu.txt):

* the measurement is exact: the benchmark's prototype (the rank-local profile, the whole embedding gradient
  without FSDP, FSDP2's tail unit held twice through forward) lands within 0.5 % of every measured peak; the
  bound, 1 %, leaves room for the fake-tensor profile's causal mask (the --hf file's ``use_cache=False`` makes
  transformers build an explicit mask on fake tensors that a real step skips: +0.3 % here);
* optplan's raw prediction is NOT within the project's 2 % CPU target yet, for the mechanisms listed in the
  benchmark's results file; its quick-run errors are -4.0 % .. +2.1 % for tp2 alone (the embedding's
  Replicate() gradient it misses is -5.6 % of the smallest peak, the formula's checkpointing terms over-count) and
  +28 % .. +40 % under FSDP2 (every buffer summed with the activation peak). The asserted bounds, 6 % and 45 %,
  are those errors with the room the mechanisms' sizes leave; the 2 % target is kept as an expected failure.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.distributed", reason="transformers >= 5 (DistributedConfig) is needed")

pytestmark = pytest.mark.slow

PROTOTYPE_BOUND_PCT = 1.0
TP_ONLY_BOUND_PCT = 6.0
TP_FSDP_BOUND_PCT = 45.0
TARGET_PCT = 2.0


@pytest.fixture(scope="module")
def rows():  # type: ignore[no-untyped-def]
    from benchmarks.fidelity_tp_cpu import run

    return run(quick=True, log=lambda _line: None, detail=True)


def test_quick_matrix_ran(rows) -> None:  # type: ignore[no-untyped-def]
    assert len(rows) == 8
    assert {(r.dp, r.precision) for r in rows} == {(1, "fp32"), (1, "amp-bf16"), (2, "fp32"), (2, "bf16")}
    assert all(r.measured > 0 for r in rows)


def test_measured_peaks_are_explained_by_the_mechanisms(rows) -> None:  # type: ignore[no-untyped-def]
    for row in rows:
        assert row.prototype_error_pct is not None
        assert abs(row.prototype_error_pct) <= PROTOTYPE_BOUND_PCT, row


def test_optplan_tp_prediction_within_the_measured_bounds(rows) -> None:  # type: ignore[no-untyped-def]
    for row in rows:
        bound = TP_ONLY_BOUND_PCT if row.dp == 1 else TP_FSDP_BOUND_PCT
        assert abs(row.error_pct) <= bound, row


@pytest.mark.xfail(reason="optplan's HF tensor-parallel memory model misses the Replicate() embedding gradient, "
                          "splits a formula's layer bytes from the logits, sums FSDP buffers with the activation "
                          "peak (benchmarks/results/fidelity_tp_cpu.txt)", strict=False)
def test_optplan_tp_prediction_meets_the_cpu_target(rows) -> None:  # type: ignore[no-untyped-def]
    assert max(abs(r.error_pct) for r in rows) <= TARGET_PCT
