"""Compute-optimal scaling (Chinchilla) and predicted loss.

Sources: Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models" (arXiv 2203.15556).
- Training compute C = 6·N·D FLOPs for N parameters and D tokens (§2; Kaplan et al. 2020).
- Approach 1 rule of thumb: compute-optimal D ≈ 20·N tokens (Table 3: 70B -> 1.4T tokens).
- Approach 3 parametric loss (eq. 2): L(N, D) = E + A/N^α + B/D^β, and its compute-optimal frontier
  (eq. 4): N_opt(C) = G·(C/6)^a, D_opt(C) = G⁻¹·(C/6)^b with a = β/(α+β), b = α/(α+β),
  G = (α·A/(β·B))^(1/(α+β)).
- Constants: Hoffmann (E 1.69, A 406.4, B 410.7, α 0.34, β 0.28) and the Epoch AI refit (Besiroglu et
  al. 2024, arXiv 2404.10102: E 1.8172, A 482.01, B 2085.43, α 0.3478, β 0.3658).
- Fitted domain (§3): 70M-16B parameters, 5B-500B tokens; a loss outside it is flagged as an extrapolation.
Units: parameters, tokens, FLOPs; loss in nats per token.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.errors import OptplanError

TOKENS_PER_PARAM_APPROACH1 = 20.0
FIT_PARAMS_RANGE = (7e7, 1.6e10)
"""Parameters of the runs L(N, D) was fitted on (Hoffmann et al. 2022 §3: "over 400 models ranging from 70 million
to over 16 billion parameters"); the Epoch AI refit (Besiroglu et al. 2024) reuses those runs."""
FIT_TOKENS_RANGE = (5e9, 5e11)
"""Training tokens of those runs ("on 5 to 500 billion tokens", same section)."""


class LossFit(BaseModel):
    """Constants of L(N, D) = E + A/N^alpha + B/D^beta."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, params: float, tokens: float) -> float:
        """Predicted final training loss (nats/token) of N params trained on D tokens (eq. 2)."""
        return self.E + self.A / params**self.alpha + self.B / tokens**self.beta

    @property
    def _g(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))

    def optimal_params(self, flops: float) -> float:
        """N_opt(C) = G·(C/6)^(β/(α+β)) (eq. 4), parameters."""
        return self._g * (flops / 6) ** (self.beta / (self.alpha + self.beta))

    def flops_for_params(self, params: float) -> float:
        """The compute budget whose optimal model has ``params`` parameters (inverse of eq. 4), FLOPs."""
        return 6 * (params / self._g) ** ((self.alpha + self.beta) / self.beta)


LOSS_FITS: dict[str, LossFit] = {
    "hoffmann": LossFit(name="hoffmann", E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28),
    "epoch": LossFit(name="epoch", E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658),
}


class ChinchillaPoint(BaseModel):
    """A compute-optimal (params, tokens, flops) point and its predicted loss."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    params: float = Field(gt=0)
    tokens: float = Field(gt=0)
    flops: float = Field(gt=0)
    loss: float
    method: Literal["approach1", "hoffmann", "epoch", "given"] = Field(
        description="approach1 / hoffmann / epoch: the compute-optimal point of that rule; given: the loss at the "
                    "(params, tokens) asked for, not an optimum")
    outside_fit: tuple[str, ...] = Field(default=(), description="why the loss is an extrapolation: params or tokens "
                                                                 "outside the runs L(N, D) was fitted on")


def outside_fit(params: float, tokens: float) -> tuple[str, ...]:
    """Which of ``params`` / ``tokens`` lie outside :data:`FIT_PARAMS_RANGE` / :data:`FIT_TOKENS_RANGE`."""
    out = []
    for what, value, (low, high) in (("parameters", params, FIT_PARAMS_RANGE), ("tokens", tokens, FIT_TOKENS_RANGE)):
        if not low <= value <= high:
            out.append(f"{value:.3g} {what} is outside the {low:.3g}-{high:.3g} {what} of the runs L(N, D) was "
                       "fitted on (Hoffmann et al. 2022 §3): the loss is an extrapolation")
    return tuple(out)


def loss_at(*, params: float, tokens: float, fit: Literal["hoffmann", "epoch"] | None = None) -> ChinchillaPoint:
    """The predicted loss of ``params`` trained on ``tokens`` (eq. 2 with ``fit``'s constants, Hoffmann's by
    default), C = 6·N·D FLOPs; not an optimum (``method`` "given")."""
    for value in (params, tokens):
        if value <= 0:
            raise OptplanError(f"sizes must be positive (got {value:g})")
    law = LOSS_FITS[fit or "hoffmann"]
    return ChinchillaPoint(params=params, tokens=tokens, flops=6 * params * tokens, loss=law.loss(params, tokens),
                           method="given", outside_fit=outside_fit(params, tokens))


def chinchilla(*, params: float | None = None, flops: float | None = None, tokens: float | None = None,
               fit: Literal["hoffmann", "epoch"] | None = None) -> ChinchillaPoint:
    """The compute-optimal point given exactly one of params, flops or tokens.

    Without ``fit``: Approach 1 (D = 20·N, C = 6·N·D), loss from Hoffmann's law. With ``fit``: the
    Approach 3 frontier of that fit's constants, and its loss.
    """
    given = [v for v in (params, flops, tokens) if v is not None]
    if len(given) != 1:
        raise OptplanError("give exactly one of --params, --compute or --tokens (or --params with --tokens: the "
                           "loss of that model on that many tokens)")
    if given[0] <= 0:
        raise OptplanError(f"sizes must be positive (got {given[0]:g})")
    law = LOSS_FITS[fit or "hoffmann"]
    if fit is None:
        if params is None:
            c = flops if flops is not None else 6 * (tokens / TOKENS_PER_PARAM_APPROACH1) * tokens  # type: ignore[operator]
            params = (c / (6 * TOKENS_PER_PARAM_APPROACH1)) ** 0.5
        tokens = TOKENS_PER_PARAM_APPROACH1 * params
        flops = 6 * params * tokens
        return ChinchillaPoint(params=params, tokens=tokens, flops=flops, loss=law.loss(params, tokens),
                               method="approach1", outside_fit=outside_fit(params, tokens))
    if params is not None:
        flops = law.flops_for_params(params)
    elif flops is None:
        # tokens given: D_opt(C) = C / (6·N_opt(C)); solve C by bisection on the monotone frontier
        lo, hi = 1.0, 1e40
        for _ in range(400):
            mid = (lo * hi) ** 0.5
            if mid / (6 * law.optimal_params(mid)) < tokens:  # type: ignore[operator]
                lo = mid
            else:
                hi = mid
        flops = (lo * hi) ** 0.5
    n = law.optimal_params(flops)
    d = flops / (6 * n)
    return ChinchillaPoint(params=n, tokens=d, flops=flops, loss=law.loss(n, d), method=fit,
                           outside_fit=outside_fit(n, d))
