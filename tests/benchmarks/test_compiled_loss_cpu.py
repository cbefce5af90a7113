"""benchmarks/compiled_loss_cpu.py measures what estimators/compiled_loss.py states: a compiled cross entropy holds
the 16-bit logits' gradient beyond the logits (2 bytes per logit) where the eager one holds 12, and Inductor's
kernels move 8 bytes per logit."""

from __future__ import annotations

import pytest

from benchmarks import compiled_loss_cpu as bench
from optplan.estimators.compiled_loss import (
    COMPILED_LOSS_PEAK_BYTES_PER_LOGIT,
    COMPILED_LOSS_TRAFFIC_BYTES_PER_LOGIT,
)


def test_the_measured_compiled_loss_holds_and_moves_what_optplan_prices() -> None:
    got = bench.measure(logits=2**25, dtypes=("bf16",))["bf16"]
    assert got["compiled"] == pytest.approx(COMPILED_LOSS_PEAK_BYTES_PER_LOGIT["bf16"] - 2, abs=0.3)
    assert got["moved"] == pytest.approx(COMPILED_LOSS_TRAFFIC_BYTES_PER_LOGIT["bf16"], abs=0.1)
    assert got["eager"] > 10  # the eager composite's fp32 copy, log-probabilities and gradients
