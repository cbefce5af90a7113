"""benchmarks/fidelity_tp_cpu.py --quick: real CPU steps of a 2-layer Llama split by its own tp_plan (transformers'
DistributedConfig under torchrun, gloo: tp2 and tp2 x FSDP2 dp2, fp32 / amp-bf16 / bf16, checkpointing none and
full) against optplan's memory prediction. One quick run (8 cases in 4 launches, about 65 s on 2 cores with the
prototype's extra profile) serves every test here. The ``full`` tier only (``python -m pytest -m full``).

The bounds come from that benchmark's measurements (benchmarks/results/fidelity_tp_cpu.txt):

* the measurement is exact: the benchmark's prototype (the rank-local profile, the whole embedding gradient
  without FSDP, FSDP2's tail unit held twice through forward) lands within 0.5 % of every measured peak (+0.04 %
  .. +0.48 %); the bound, 1 %, is that with room for what is left, the fake-tensor profile's causal mask (the --hf
  file's ``use_cache=False`` makes transformers build an explicit mask on fake tensors that a real step skips:
  +0.23 % .. +0.48 % on the rows without checkpointing, 0.04 % .. 0.07 % on the others);
* optplan's raw prediction is NOT within the project's 2 % CPU target yet under FSDP2. After the fixes this
  benchmark led to (the embedding's replicated gradient, the read MLP width and gating, max rather than sum of the
  recomputed layer and the loss, FSDP buffers at their own moments) the quick run gives +0.09 % .. +3.98 % for tp2
  alone (the rest: kept layer inputs are fp32 under autocast, priced 16-bit) and +20.0 % .. +24.9 % under FSDP2
  (HF's FSDP plan wraps the embedding alone and keeps [norm, lm_head] gathered; optplan prices one root unit and
  one or two block units); bounds 5 % and 30 %. The 2 % target is kept as an expected failure.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.distributed", reason="transformers >= 5 (DistributedConfig) is needed")

pytestmark = [pytest.mark.slow, pytest.mark.full]

PROTOTYPE_BOUND_PCT = 1.0
PROTOTYPE_FSDP_BOUND_PCT = 7.0
"""Under FSDP2 (dp 2) the measured peak depends on timing: on a loaded machine FSDP2's prefetched all-gather of the
next block unit can still be alive at the peak (a clean-clone CI run, with other tests on the same 2 cores, measured
tp2 x FSDP2 bf16 at -5.9 % against the prototype: about one gathered block unit of this small model). The bound is
the 1 % plus that unit; the unloaded runs stay within 0.5 %."""
TP_ONLY_BOUND_PCT = 5.0
TP_FSDP_BOUND_PCT = 30.0
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
        bound = PROTOTYPE_FSDP_BOUND_PCT if row.dp > 1 else PROTOTYPE_BOUND_PCT
        assert abs(row.prototype_error_pct) <= bound, row


def test_optplan_tp_prediction_within_the_measured_bounds(rows) -> None:  # type: ignore[no-untyped-def]
    for row in rows:
        bound = TP_ONLY_BOUND_PCT if row.dp == 1 else TP_FSDP_BOUND_PCT
        assert abs(row.error_pct) <= bound, row


@pytest.mark.xfail(reason="under FSDP2 optplan prices one root unit and two block units where HF's FSDP plan wraps "
                          "the embedding alone and keeps [norm, lm_head] gathered; kept layer inputs are fp32 under "
                          "autocast (benchmarks/results/fidelity_tp_cpu.txt)", strict=False)
def test_optplan_tp_prediction_meets_the_cpu_target(rows) -> None:  # type: ignore[no-untyped-def]
    assert max(abs(r.error_pct) for r in rows) <= TARGET_PCT
