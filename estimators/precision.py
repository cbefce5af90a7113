"""Precision recipes: bytes per parameter of weights, gradients, fp32 master copy and fp8 weight cache.

Sources (all figures are bytes per parameter):
- Rajbhandari et al. 2019 (ZeRO, arXiv 1910.02054, §3.1): mixed-precision Adam keeps 2 bytes of
  fp16/bf16 weights, 2 bytes of fp16/bf16 gradients and K = 12 bytes of optimizer state (4 fp32 master
  weights + 4 momentum + 4 variance): recipes ``bf16`` and ``fp16``.
- PyTorch AMP (autocast, ``torch.amp`` docs) keeps fp32 parameters and gradients and casts to 16 bits
  inside autocast regions: 4 + 4 + 8 (Adam moments) = 16 bytes with AdamW (formulas.md): ``amp-bf16``,
  ``amp-fp16``. ``fp32`` is the same without tensor-core math.
- Pure bf16 (no master copy, 16-bit moments: DeepSpeed's ``bf16_master_weights_and_grads`` +
  ``bf16_optimizer_states``) keeps everything 16-bit: 2 + 2 + 2·2 = 8 bytes with AdamW.
- fp8 follows NVIDIA Transformer Engine as Megatron-Core uses it (TE user guide, "Using FP8 with
  Transformer Engine": FP8 recipe, FP8 weight caching; ``transformer_engine/pytorch/module/linear.py``;
  Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv 2209.05433): the model states are
  those of ``bf16`` (bf16 parameters and gradients, fp32 master weights and Adam moments, K = 12);
  inside ``te.fp8_autocast`` every TE Linear casts its weight to fp8 (E4M3) once per step (the first
  micro-batch, ``is_first_microbatch=True``) and keeps the fp8 weight **and its fp8 transpose** (Hopper's
  fp8 GEMM takes only the TN layout, so dgrad needs W^T materialised) across the step's micro-batches;
  without caching the same two copies are saved for backward, so they are live at the peak either way.
  Matmuls run in fp8 with fp32 accumulation; non-Linear ops (embeddings, norms, softmax/attention core,
  residual adds, loss) stay bf16. ``fp8_weight_cache_bytes`` = 1 (fp8 W) + 1 (fp8 W^T) = 2 bytes.
  It is charged to every parameter, an upper bound: embeddings, norms and biases are not cast
  (2-4 % of a 7B-70B decoder's parameters, but ~30 % of GPT-2 small's). Blackwell MXFP8 adds one E8M0 scale per 32 values per
  copy (+0.0625 bytes), below this integer's resolution. Activations are bf16 except the GEMM inputs TE saves
  in fp8 for backward, which the formula path counts at one byte (estimators/fp8_activations.py).
  That is Transformer Engine's, which the ``megatron`` and ``deepspeed`` engines run; the ``torch`` engine's
  train.py runs torchao's Float8Linear, which caches no fp8 copy and saves bf16 inputs (estimators/fp8_backend.py).
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
    fp8_weight_cache_bytes: int = Field(
        default=0, ge=0,
        description="cached fp8 copies of the weights (fp8 W + fp8 W^T, Transformer Engine), bytes/param, "
                    "held through the step on top of weight_bytes; 0 for recipes without fp8",
    )
    description: str

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element the recipe's non-matmul kernels move: 4 in fp32, 2 in a 16-bit recipe
        (fp8 included: its norms, attention and residual stream stay bf16, Transformer Engine's recipe)."""
        return 4 if self.activation_precision == "fp32" else 2


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
               description="bf16 weights and gradients, fp32 master weights and optimizer states"),
        Recipe(name="fp16", weight_bytes=2, grad_bytes=2, master_bytes=4, state_bytes=4,
               compute_dtype="fp16", activation_precision="bf16",
               description="fp16 weights and gradients with dynamic loss scaling, fp32 master weights and optimizer "
                           "states"),
        Recipe(name="bf16-pure", weight_bytes=2, grad_bytes=2, master_bytes=0, state_bytes=2,
               compute_dtype="bf16", activation_precision="bf16", needs_bf16=True,
               description="everything bf16, no fp32 master copy (cheapest, least stable)"),
        Recipe(name="fp8", weight_bytes=2, grad_bytes=2, master_bytes=4, state_bytes=4,
               compute_dtype="fp8", activation_precision="bf16", needs_bf16=True, fp8_weight_cache_bytes=2,
               description="Transformer Engine fp8: Linear matmuls in fp8 (E4M3/E5M2, fp32 accumulation) from "
                           "cached fp8 weight copies (W and W^T, +2 B/param); bf16 weights, gradients and "
                           "non-Linear ops (embeddings, norms, attention softmax, loss); fp32 master weights "
                           "and optimizer states"),
    )
}


def get_recipe(name: str) -> Recipe:
    """Recipe by name (KeyError for unknown names; Strategy validation prevents those)."""
    return RECIPES[name]


def require_precision(gpu: GPUSpec, name: str) -> Recipe:
    """The recipe ``name`` if ``gpu`` has math for it; else a one-line OptplanError with the fix.

    fp8 needs fp8 tensor cores (Hopper, Ada, Blackwell: a catalogue fp8 peak > 0); on other GPUs the
    fix is bf16 where the GPU has bf16 math, else fp16.
    """
    if name not in RECIPES:
        raise OptplanError(f"unknown precision {name!r}: use one of {', '.join(RECIPES)}")
    recipe = RECIPES[name]
    if gpu.peak_flops_for(recipe.compute_dtype) <= 0:
        if recipe.compute_dtype == "fp8":
            fix = "choose bf16" if gpu.supports_bf16 else "choose fp16 or fp32"
            raise OptplanError(f"{gpu.name} has no fp8 math for precision {name!r} (fp8 tensor cores need "
                               f"Hopper, Ada or Blackwell): {fix} on this GPU")
        raise OptplanError(f"{gpu.name} has no {recipe.compute_dtype} math for precision {name!r}: "
                           "choose fp32 or fp16 on this GPU")
    if recipe.needs_bf16 and not gpu.supports_bf16:  # pragma: no cover - fp8 GPUs all have bf16
        raise OptplanError(f"{gpu.name} has no bf16 math, which precision {name!r} keeps its weights in: "
                           "choose fp32 or fp16 on this GPU")
    return recipe
