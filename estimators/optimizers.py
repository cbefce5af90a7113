"""Optimizer state sizes, bytes per trainable parameter (excluding the recipe's fp32 master copy).

Sources: Adam/AdamW keep two moments (Kingma & Ba 2015), 4 bytes each in fp32 -> 8 bytes/param
(ZeRO §3.1 counts them with the fp32 master copy as K = 12). 8-bit Adam (Dettmers et al. 2022,
arXiv 2110.02861 §2) stores both moments in 8 bits: 2 bytes/param plus one fp32 absmax per 2048-value
block (+0.004 bytes/param). SGD with momentum keeps one moment buffer.
"""

from __future__ import annotations

from collections.abc import Callable

from optplan.estimators.precision import Recipe
from optplan.estimators.profile import ModelProfile

BLOCKWISE_8BIT_OVERHEAD_BYTES_PER_PARAM = 2 * 4 / 2048  # one fp32 absmax per 2048 values, 2 moments


def _adamw(recipe: Recipe, profile: ModelProfile | None) -> float:
    return 2 * recipe.state_bytes


def _adamw_8bit(recipe: Recipe, profile: ModelProfile | None) -> float:
    return 2 * 1 + BLOCKWISE_8BIT_OVERHEAD_BYTES_PER_PARAM


def _sgd(recipe: Recipe, profile: ModelProfile | None) -> float:
    return recipe.state_bytes


OPTIMIZER_STATE_BYTES: dict[str, Callable[[Recipe, ModelProfile | None], float]] = {
    "adamw": _adamw,
    "adamw8bit": _adamw_8bit,
    "sgd": _sgd,
}


def optimizer_state_bytes_per_param(optimizer: str, recipe: Recipe, profile: ModelProfile | None = None) -> float:
    """Moments' bytes per trainable parameter for ``optimizer`` under ``recipe`` (bytes/param), averaged
    over the trainable parameters of ``profile`` (optimizers with factored state depend on the shapes)."""
    return OPTIMIZER_STATE_BYTES[optimizer](recipe, profile)
