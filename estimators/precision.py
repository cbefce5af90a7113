"""Precision recipes: bytes per parameter of weights, gradients and fp32 master copy.

Sources: Rajbhandari et al. 2019 (ZeRO, arXiv 1910.02054, §3.1): mixed-precision Adam keeps 2 bytes
of fp16/bf16 weights, 2 bytes of fp16/bf16 gradients and K = 12 bytes of optimizer state (4 fp32 master
weights + 4 momentum + 4 variance). PyTorch AMP (autocast) keeps fp32 parameters and gradients:
4 + 4 + 8 (Adam moments) = 16 bytes per parameter (formulas.md). Pure bf16 keeps everything 16-bit.
All figures are bytes per parameter.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import Dtype, GPUSpec
from optplan.estimators.profile import ActivationPrecision


class Recipe(BaseModel):
    """One precision recipe (bytes per parameter; compute dtype for peak FLOP/s)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    weight_bytes: int = Field(description="resident model weights, bytes/param")
    grad_bytes: int = Field(description="gradients, bytes/param")
    master_bytes: int = Field(description="fp32 master weights kept by the optimizer, bytes/param")
    state_bytes: int = Field(description="bytes of one optimizer moment (4 fp32, 2 in pure 16-bit)")
    compute_dtype: Dtype
    activation_precision: ActivationPrecision
    needs_bf16: bool = False
    description: str


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(name="fp32", weight_bytes=4, grad_bytes=4, master_bytes=0, state_bytes=4,
               compute_dtype="fp32", activation_precision="fp32",
               description="fp32 weights, gradients and optimizer states (no tensor-core math)"),
        Recipe(name="amp-bf16", weight_bytes=4, grad_bytes=4, master_bytes=0, state_bytes=4,
               compute_dtype="bf16", activation_precision="bf16", needs_bf16=True,
               description="torch autocast bf16: fp32 parameters and gradients, bf16 matmuls"),
        Recipe(name="amp-fp16", weight_bytes=4, grad_bytes=4, master_bytes=0, state_bytes=4,
               compute_dtype="fp16", activation_precision="bf16",
               description="torch autocast fp16 + GradScaler: fp32 parameters and gradients"),
        Recipe(name="bf16", weight_bytes=2, grad_bytes=2, master_bytes=4, state_bytes=4,
               compute_dtype="bf16", activation_precision="bf16", needs_bf16=True,
               description="bf16 weights and gradients, fp32 master weights and Adam moments (K = 12)"),
        Recipe(name="fp16", weight_bytes=2, grad_bytes=2, master_bytes=4, state_bytes=4,
               compute_dtype="fp16", activation_precision="bf16",
               description="fp16 weights and gradients with dynamic loss scaling, fp32 master (K = 12)"),
        Recipe(name="bf16-pure", weight_bytes=2, grad_bytes=2, master_bytes=0, state_bytes=2,
               compute_dtype="bf16", activation_precision="bf16", needs_bf16=True,
               description="everything bf16, no fp32 master copy (cheapest, least stable)"),
    )
}


def get_recipe(name: str) -> Recipe:
    """Recipe by name (KeyError for unknown names; Strategy validation prevents those)."""
    return RECIPES[name]


def require_precision(gpu: GPUSpec, name: str) -> Recipe:
    """The recipe ``name`` if ``gpu`` has math for it; else a one-line OptplanError with the fix."""
    if name not in RECIPES:
        raise OptplanError(f"unknown precision {name!r}: use one of {', '.join(RECIPES)}")
    recipe = RECIPES[name]
    if gpu.peak_flops_for(recipe.compute_dtype) <= 0:
        raise OptplanError(f"{gpu.name} has no {recipe.compute_dtype} math for precision {name!r}: "
                           "choose fp32 or fp16 on this GPU")
    return recipe
