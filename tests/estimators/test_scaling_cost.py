"""Chinchilla scaling and training cost against hand-worked cases."""

from __future__ import annotations

import pytest

from optplan.estimators.cost import training_cost
from optplan.estimators.errors import OptplanError
from optplan.estimators.scaling import LOSS_FITS, chinchilla, loss_at


def test_approach1_is_twenty_tokens_per_parameter() -> None:
    p = chinchilla(params=70e9)
    assert (p.tokens, p.flops, p.method) == (1.4e12, 6 * 70e9 * 1.4e12, "approach1")
    assert chinchilla(tokens=1.4e12).params == pytest.approx(70e9)
    assert chinchilla(flops=6 * 70e9 * 1.4e12).params == pytest.approx(70e9)


def test_hoffmann_loss_formula_by_hand() -> None:
    n, d = 70e9, 1.4e12
    expected = 1.69 + 406.4 / n**0.34 + 410.7 / d**0.28
    assert LOSS_FITS["hoffmann"].loss(n, d) == pytest.approx(expected)
    assert chinchilla(params=n).loss == pytest.approx(expected)


@pytest.mark.parametrize("fit", ["hoffmann", "epoch"])
def test_approach3_frontier_is_consistent(fit: str) -> None:
    law = LOSS_FITS[fit]
    c = 5.76e23
    p = chinchilla(flops=c, fit=fit)  # type: ignore[arg-type]
    assert p.flops == c and p.params * p.tokens * 6 == pytest.approx(c)
    # the frontier minimises loss at fixed compute
    for scale in (0.8, 1.25):
        n = p.params * scale
        assert law.loss(n, c / (6 * n)) > p.loss
    assert chinchilla(params=p.params, fit=fit).flops == pytest.approx(c, rel=1e-9)  # type: ignore[arg-type]
    assert chinchilla(tokens=p.tokens, fit=fit).params == pytest.approx(p.params, rel=1e-6)  # type: ignore[arg-type]


def test_epoch_refit_recovers_chinchilla_70b() -> None:
    """Besiroglu et al. 2024: the refit's optimum at Chinchilla's budget is close to 70B / 1.4T."""
    p = chinchilla(flops=5.76e23, fit="epoch")
    assert p.params == pytest.approx(70e9, rel=0.05)
    assert p.tokens == pytest.approx(1.4e12, rel=0.06)


def test_chinchilla_rejects_ambiguous_or_bad_input() -> None:
    with pytest.raises(OptplanError, match="exactly one"):
        chinchilla(params=1e9, tokens=1e10)
    with pytest.raises(OptplanError, match="positive"):
        chinchilla(params=-1)
    with pytest.raises(OptplanError, match="positive"):
        loss_at(params=1e9, tokens=0)


def test_the_fitted_domain_is_stated_not_silently_extrapolated() -> None:
    assert chinchilla(params=1e9).outside_fit == ()  # 1B on 20B tokens: inside 70M-16B x 5B-500B
    assert len(chinchilla(params=70e9).outside_fit) == 2  # Chinchilla itself lies beyond the runs it was fitted on
    assert loss_at(params=1e9, tokens=1e10).outside_fit == ()
    assert loss_at(params=1e9, tokens=1e10, fit="epoch").loss == pytest.approx(LOSS_FITS["epoch"].loss(1e9, 1e10))


def test_training_cost_by_hand() -> None:
    c = training_cost(tokens=1e12, tokens_per_s=1e6, gpus=8, gpu_power_w=700, price_per_gpu_hour=2.0)
    assert c.train_time_s == pytest.approx(1e6)
    assert c.gpu_hours == pytest.approx(8e6 / 3600)
    assert c.cost_usd == pytest.approx(2 * 8e6 / 3600)
    assert c.energy_kwh == pytest.approx(8 * 700 * 1e6 / 3.6e6)
    assert training_cost(tokens=1e9, tokens_per_s=1e5, gpus=1, gpu_power_w=300).cost_usd is None
    assert c.train_time_s_low is None and c.cost_usd_high is None  # no band given
    banded = training_cost(tokens=1e12, tokens_per_s=1e6, gpus=8, gpu_power_w=700, price_per_gpu_hour=2.0,
                           step_band=(0.8, 1.3))
    assert (banded.train_time_s_low, banded.train_time_s_high) == pytest.approx((0.8e6, 1.3e6))
    assert (banded.cost_usd_low, banded.cost_usd_high) == pytest.approx((0.8 * c.cost_usd, 1.3 * c.cost_usd))
    assert (banded.gpu_hours_low, banded.gpu_hours_high) == pytest.approx((0.8 * c.gpu_hours, 1.3 * c.gpu_hours))
    assert (banded.energy_kwh_low, banded.energy_kwh_high) == pytest.approx((0.8 * c.energy_kwh, 1.3 * c.energy_kwh))
    assert c.gpu_hours_low is None and c.energy_kwh_high is None
    unpriced = training_cost(tokens=1e9, tokens_per_s=1e5, gpus=1, gpu_power_w=300, step_band=(0.8, 1.3))
    assert unpriced.train_time_s_high == pytest.approx(1.3e4) and unpriced.cost_usd_high is None
    assert (c.price_per_gpu_hour, c.gpu_power_w) == (2.0, 700)  # the inputs a reader needs to redo the sums
    assert (unpriced.price_per_gpu_hour, unpriced.gpu_power_w) == (None, 300)
    assert unpriced.energy_kwh_high == pytest.approx(300 * 1.3e4 / 3.6e6)
    with pytest.raises(OptplanError):
        training_cost(tokens=0, tokens_per_s=1, gpus=1, gpu_power_w=1)
