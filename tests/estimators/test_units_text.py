"""Memory verdict text: a small overshoot or headroom is never rounded into "78.4 GiB > 78.4 GiB" or "0.0 GiB";
table figures at three significant digits."""

from __future__ import annotations

from optplan.estimators.estimate import estimate_reason
from optplan.estimators.memory import MemoryBreakdown
from optplan.estimators.units import GIB_BYTES, MIB_BYTES, gib_apart, margin_text, sig3

CAP = int(78.4 * GIB_BYTES)


def _memory(total_bytes: int) -> MemoryBreakdown:
    return MemoryBreakdown(params_bytes=total_bytes // 2, grads_bytes=0, optimizer_bytes=0,
                           activations_bytes=total_bytes - total_bytes // 2, buffers_bytes=0, overhead_bytes=0,
                           capacity_bytes=CAP)


def test_unequal_sizes_get_the_decimals_that_tell_them_apart() -> None:
    assert gib_apart(CAP + 21 * MIB_BYTES, CAP) == ("78.42", "78.40")
    assert gib_apart(CAP + 1, CAP) == ("78.400", "78.400")  # at most three decimals
    assert gib_apart(CAP, CAP) == ("78.4", "78.4")
    assert gib_apart(19.1 * GIB_BYTES, CAP) == ("19.1", "78.4")


def test_margins_under_a_tenth_of_a_gib_are_in_mib() -> None:
    assert margin_text(-21 * MIB_BYTES) == "21 MiB"
    assert margin_text(59.3 * GIB_BYTES) == "59.3 GiB"


def test_a_21_mib_overshoot_reads_as_one() -> None:
    over = estimate_reason(_memory(CAP + 21 * MIB_BYTES))
    assert over.startswith("does not fit: needs 78.42 GiB > 78.40 GiB per GPU (21 MiB over)"), over
    under = estimate_reason(_memory(CAP - 30 * MIB_BYTES))
    assert under == "fits: 78.37 GiB of 78.40 GiB per GPU (30 MiB free)", under


def test_table_figures_keep_three_significant_digits_and_their_zeros() -> None:
    """PLAN.md's columns: '0.270' beside '0.326', never '0.27'; no exponent; thousands with separators."""
    assert [sig3(x) for x in (0.27, 0.2649, 1.35, 12.34, 99.96, 951.5, 1915.2, 0.00123, 0.0, 2.0)] == [
        "0.270", "0.265", "1.35", "12.3", "100", "952", "1,915", "0.00123", "0", "2.00"]
