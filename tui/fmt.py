"""Number formatting shared by the terminal faces (CLI tables, dashboard); ``long_duration`` is estimators/units.py's
(PLAN.md writes durations with it too)."""

from __future__ import annotations

from optplan.estimators.cost import CostEstimate
from optplan.estimators.units import gib, long_duration


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


def amount(x: float) -> str:
    """A budget figure: '1,234', or two significant digits below 10 ('0.33', not '0')."""
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


def gpu_hours_text(gpu_hours: float) -> str:
    """'1,234 GPU-hours', '0.33 GPU-hours' (:func:`amount`)."""
    return f"{amount(gpu_hours)} GPU-hours"


def usd_text(usd: float) -> str:
    """'$1,234', or cents below $10 ('$0.83', not '$1')."""
    return f"${usd:,.0f}" if usd >= 10 else f"${usd:.2f}"


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


def cost_band_text(cost: CostEstimate) -> str:
    """The time to train, its GPU-hours, price and energy at the ends of the step time's band
    (``CostEstimate.train_time_s_low``...): ' (over the step's band: 92.6-162.0 days, 142,222-248,889 GPU-hours,
    $284,444-$497,778, 99,556-174,222 kWh)'; '' without a band (or one of no width)."""
    if cost.train_time_s_low is None or cost.train_time_s_high is None or (
            cost.train_time_s_low == cost.train_time_s == cost.train_time_s_high):
        return ""
    parts = [span(long_duration(cost.train_time_s_low), long_duration(cost.train_time_s_high))]
    if cost.gpu_hours_low is not None and cost.gpu_hours_high is not None:
        parts.append(span(gpu_hours_text(cost.gpu_hours_low), gpu_hours_text(cost.gpu_hours_high)))
    if cost.cost_usd_low is not None and cost.cost_usd_high is not None:
        parts.append(span(usd_text(cost.cost_usd_low), usd_text(cost.cost_usd_high)))
    if cost.energy_kwh_low is not None and cost.energy_kwh_high is not None:
        parts.append(span(amount(cost.energy_kwh_low), amount(cost.energy_kwh_high)) + " kWh")
    return f" (over the step's band: {', '.join(parts)})"


def span(low: str, high: str) -> str:
    """'101-187 days' from '101 days' and '187 days' (one unit named once when both ends share it), else
    '14 h-2.1 days'."""
    low_value, _, low_unit = low.partition(" ")
    high_value, _, high_unit = high.partition(" ")
    if low_unit and low_unit == high_unit:
        return f"{low_value}-{high_value} {high_unit}"
    return f"{low}-{high}"
