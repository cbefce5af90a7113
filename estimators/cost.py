"""Time to train a token budget, GPU-hours, money and energy.

Definitions (units in the names): train_time_s = tokens / tokens_per_s; gpu_hours = gpus ·
train_time_s / 3600; cost_usd = gpu_hours · price per GPU-hour; energy_kwh = gpus · GPU power (W) ·
train_time_s / 3.6e6, GPU board power only (default: the datasheet TDP, an upper bound for the GPUs;
host, network and cooling are not counted). The step time's band (``time.step_s_low``-``step_s_high``,
estimators/uncertainty.py) carries over to every figure here, each proportional to the time to train at a fixed GPU
count (and board power): their ends are the nominal figures times step_s_low / step_s and step_s_high / step_s
(planner/goal.py ``band_factor``).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.errors import OptplanError


class CostEstimate(BaseModel):
    """Cost of training ``tokens`` tokens at a given throughput."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens: float = Field(gt=0)
    price_per_gpu_hour: float | None = Field(default=None, ge=0, description="the price the cost was computed at "
                                             "(USD per GPU-hour: --price, else the cluster file's); None: no price")
    gpu_power_w: float | None = Field(default=None, ge=0, description="the board power per GPU the energy was "
                                      "computed at (W: the cluster file's gpu_power_w, else the datasheet TDP)")
    train_time_s: float = Field(ge=0)
    gpu_hours: float = Field(ge=0)
    cost_usd: float | None = Field(default=None, ge=0)
    energy_kwh: float = Field(ge=0)
    train_time_s_low: float | None = Field(default=None, ge=0, description="at the step band's fast end (s)")
    train_time_s_high: float | None = Field(default=None, ge=0, description="at the step band's slow end (s)")
    cost_usd_low: float | None = Field(default=None, ge=0, description="at the step band's fast end (with a price)")
    cost_usd_high: float | None = Field(default=None, ge=0, description="at the step band's slow end (with a price)")
    gpu_hours_low: float | None = Field(default=None, ge=0, description="at the step band's fast end (GPU-h)")
    gpu_hours_high: float | None = Field(default=None, ge=0, description="at the step band's slow end (GPU-h)")
    energy_kwh_low: float | None = Field(default=None, ge=0, description="at the step band's fast end (kWh)")
    energy_kwh_high: float | None = Field(default=None, ge=0, description="at the step band's slow end (kWh)")


def training_cost(*, tokens: float, tokens_per_s: float, gpus: int, gpu_power_w: float,
                  price_per_gpu_hour: float | None = None,
                  step_band: tuple[float, float] | None = None) -> CostEstimate:
    """Time, GPU-hours, money (when a price is given) and energy to train ``tokens`` tokens; with ``step_band``
    (the step time's band ends over the step: step_s_low / step_s, step_s_high / step_s) each of them at those ends
    too."""
    if tokens <= 0 or tokens_per_s <= 0:
        raise OptplanError(f"--tokens and the throughput must be positive (got {tokens:g}, {tokens_per_s:g})")
    if price_per_gpu_hour is not None and price_per_gpu_hour < 0:
        raise OptplanError(f"--price must be >= 0 (got {price_per_gpu_hour:g})")
    seconds = tokens / tokens_per_s
    gpu_hours = gpus * seconds / 3600
    cost_usd = None if price_per_gpu_hour is None else gpu_hours * price_per_gpu_hour
    energy_kwh = gpus * gpu_power_w * seconds / 3.6e6
    if not all(math.isfinite(x) for x in (seconds, gpu_hours, energy_kwh, cost_usd or 0.0)):
        price = "" if price_per_gpu_hour is None else f" at --price {price_per_gpu_hour:g}"
        raise OptplanError(f"--tokens {tokens:g}{price} on {gpus} GPUs gives figures beyond floating point "
                           "(infinite time, GPU-hours, cost or energy): give a smaller budget")
    nominal = {"train_time_s": seconds, "gpu_hours": gpu_hours, "cost_usd": cost_usd, "energy_kwh": energy_kwh}
    ends: dict[str, float | None] = {}
    if step_band is not None:
        for end, factor in zip(("low", "high"), step_band, strict=True):
            ends.update({f"{name}_{end}": None if value is None else value * factor for name, value in nominal.items()})
    return CostEstimate(tokens=tokens, price_per_gpu_hour=price_per_gpu_hour, gpu_power_w=gpu_power_w, **nominal,
                        **ends)
