"""Number formatting shared by the terminal faces (CLI tables, dashboard)."""

from __future__ import annotations

from optplan.estimators.units import gib


def gib_text(n: float) -> str:
    """Bytes as GiB with one decimal ('12.3')."""
    return f"{gib(n):.1f}"


def si(n: float) -> str:
    """1.23G, 45.60M, 7.00K or the plain number."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def duration(seconds: float) -> str:
    """Step-sized durations: '12 ms', '3.40 s', '250 s'."""
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s" if seconds < 100 else f"{seconds:.0f} s"


def long_duration(seconds: float) -> str:
    """Training-sized durations: '5.2 h', '31.0 days'."""
    return f"{seconds / 86400:.1f} days" if seconds >= 86400 else f"{seconds / 3600:.1f} h"


def si3(n: float) -> str:
    """Three significant digits with a unit: '394K', '4.75M', '12.3G', '950'."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if value < 1000 else f"{value:,.0f}{unit}"
    return f"{n:.3g}"


def band_text(step_s: float, low_s: float, high_s: float) -> str:
    """A step-time band relative to the estimate, in %: '-12/+19' (fast end, slow end); '' without a band."""
    if step_s <= 0 or high_s <= 0 or (low_s == step_s == high_s):
        return ""
    return f"{100 * (low_s / step_s - 1):+.0f}/{100 * (high_s / step_s - 1):+.0f}"
