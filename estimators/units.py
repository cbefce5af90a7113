"""Unit constants. GB is 1e9 bytes, GiB is 2**30 bytes (formulas.md convention)."""

from __future__ import annotations

import math

KIB_BYTES = 1024
MIB_BYTES = 1024**2
GIB_BYTES = 1024**3
GB_BYTES = 10**9
TERA = 1e12


def gib(num_bytes: float) -> float:
    """Bytes -> GiB (2**30 bytes)."""
    return num_bytes / GIB_BYTES


def gib_apart(a_bytes: float, b_bytes: float, *, digits: int = 1, max_digits: int = 3) -> tuple[str, str]:
    """Two byte counts as GiB text with the fewest decimals (``digits`` up to ``max_digits``) that keep unequal
    counts apart, so "needs 78.42 GiB > 78.40 GiB" is never printed as "78.4 GiB > 78.4 GiB"."""
    a, b = gib(a_bytes), gib(b_bytes)
    for d in range(digits, max_digits + 1):
        left, right = f"{a:.{d}f}", f"{b:.{d}f}"
        if left != right or a_bytes == b_bytes:
            break
    return left, right


def margin_text(num_bytes: float) -> str:
    """A headroom or overshoot (sign dropped): GiB with one decimal, or MiB below 0.1 GiB (a 21 MiB overshoot is
    not "0.0 GiB")."""
    size = abs(num_bytes)
    return f"{gib(size):.1f} GiB" if gib(size) >= 0.1 else f"{size / MIB_BYTES:.0f} MiB"


def long_duration(seconds: float) -> str:
    """Training-sized durations: '5.2 h', '31.0 days'; under six minutes '4.5 min' or '38 s' (never '0.0 h')."""
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 360:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def sig3(value: float) -> str:
    """Three significant digits with the trailing zeros kept and no exponent, so a table column reads evenly:
    '0.270', '1.35', '12.3', '951', '1,915' (hundreds and up: whole numbers with thousands separators)."""
    rounded = float(f"{value:.3g}")
    if rounded == 0 or not math.isfinite(rounded):
        return f"{rounded:g}"
    if abs(rounded) >= 100:
        return f"{value:,.0f}"
    return f"{rounded:.{2 - math.floor(math.log10(abs(rounded)))}f}"
