"""A profile from a parameter count alone (``--params N``): model states only, no activations, no time.

This is what DeepSpeed's ``estimate_zero*_model_states_mem_needs`` count (ZeRO paper §5), plus optplan's
named buffers and overhead; activations need a model FILE or an ``--arch`` shape.
"""

from __future__ import annotations

from optplan.estimators.errors import OptplanError
from optplan.estimators.profile import ActivationFit, ModelProfile

PARAMS_ONLY_CLASS = "ParametersOnly"
MAX_PARAMS = 10**15
"""The largest ``--params`` accepted (a thousand times the largest models trained; beyond it byte counts
overflow the float arithmetic of the estimators)."""


def profile_from_params(params: float) -> ModelProfile:
    """A profile of ``params`` parameters (all trainable) with zero activations and zero FLOPs."""
    if not params == params or params < 1 or params != int(params):  # NaN, zero, negative, fractional
        raise OptplanError(f"--params must be a whole number of parameters >= 1 (got {params:g}): e.g. --params 7e9")
    if params > MAX_PARAMS:
        raise OptplanError(f"--params {params:.3g} is beyond any model (at most {MAX_PARAMS:.0e}): e.g. --params 7e9")
    n = int(params)
    zero = tuple(ActivationFit(precision=p, checkpointing=c, fixed_bytes=0, per_sample_bytes=0)
                 for p in ("fp32", "bf16") for c in ("none", "full"))
    return ModelProfile(
        name=f"params-{n:.3g}", path="--params", model_class=PARAMS_ONLY_CLASS, params=n, trainable_params=n,
        params_by_module={"all": n}, fwd_flops_per_sample=0.0, bwd_flops_per_sample=0.0, activations=zero,
        notes=("--params: model states, buffers and overhead only; no activations and no time "
               "(give a model FILE or --arch for those)",),
    )


def is_params_only(profile: ModelProfile) -> bool:
    """True for a :func:`profile_from_params` profile."""
    return profile.model_class == PARAMS_ONLY_CLASS
