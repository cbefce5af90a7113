"""Optimizer state sizes, bytes per trainable parameter (excluding the recipe's fp32 master copy).

Every registry function takes ``(recipe, profile)`` and returns the optimizer's own state in bytes per
trainable parameter, averaged over the model's trainable parameters. One moment element takes
``recipe.state_bytes`` bytes (4 in fp32, 2 under ``bf16-pure``). The recipe's fp32 master copy
(``recipe.master_bytes``) is added by the memory estimator, not here.

Sources
- AdamW (Loshchilov & Hutter 2019, arXiv 1711.05101; Adam: Kingma & Ba 2015, arXiv 1412.6980) keeps two
  moments per parameter: 2 × 4 = 8 bytes in fp32 (ZeRO, arXiv 1910.02054 §3.1, counts them with the fp32
  master copy as K = 12), 2 × 2 = 4 bytes under bf16-pure.
- 8-bit AdamW (``adamw8bit``; Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization",
  arXiv 2110.02861 §2, bitsandbytes ``AdamW8bit``): both moments stored as 8-bit codes, 2 bytes/param,
  plus one fp32 absmax per 2048-value block per moment, 2 × 4 / 2048 = 0.0039 bytes/param. The recipe
  does not change it (the state is quantised whatever the weights' dtype). bitsandbytes keeps tensors
  under 4096 elements in 32-bit state (``min_8bit_size``); that is ignored here (norms and biases are a
  negligible share of a large model).
- Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
  arXiv 1804.04235 §3; ``torch.optim.Adafactor``; Hugging Face ``transformers.optimization.Adafactor``):
  the second moment of a parameter with >= 2 dims is factored into a row vector and a column vector
  over its last two dims, leading dims kept (torch: ``row_var`` of shape ``shape[:-1] + (1,)``,
  ``col_var`` of ``shape[:-2] + (1, shape[-1])``), i.e. ``prod(shape[:-2]) × (rows + cols)`` elements;
  a 0-D or 1-D parameter keeps a full second moment (``numel`` elements). No first moment: torch's
  Adafactor has none and Hugging Face's defaults to ``beta1=None`` (with ``beta1`` set it would add a
  full first moment, ``state_bytes`` per parameter, not modelled). The per-parameter ``step`` scalars are
  ignored. Bytes/param = ``state_bytes × profile.factored_state_elements / profile.trainable_params``.
  Fallback when the profile does not carry ``factored_state_elements`` (older cached profiles, or no
  profile): one full second moment, ``state_bytes`` per parameter, the unfactored upper bound
  (``ADAFACTOR_FALLBACK_NOTE``).
  Factoring needs the optimizer to see the parameters' shapes. DeepSpeed ZeRO stages 1-3 hand the
  optimizer flat 1-D fp32 partitions instead (deepspeed 0.19.8 ``runtime/zero/stage_1_and_2.py``:
  ``param_group['params'] = [self.single_partition_of_fp32_groups[i]]``; ``zero/stage3.py`` likewise;
  ``bf16_optimizer.py`` for bf16 at ZeRO-1), and so does Megatron's distributed optimizer: there
  Adafactor keeps a full second moment (``flat_params=True``, see ``optimizer_sees_flat_params``). At
  ZeRO-0 DeepSpeed keeps the shapes (fp32 params: the client optimizer itself; bf16/fp16:
  ``FP16_UnfusedOptimizer`` with per-parameter fp32 copies), as do torch DDP and FSDP2 (per-parameter
  DTensor shards). Checked on CPU with deepspeed 0.19.8 and the exported ds_config: a 16-32-8 MLP
  (808 parameters) gave torch Adafactor 128 state elements at ZeRO-0 (fp32 and bf16, as counted here)
  and 808 at ZeRO-1, 2 and 3.
- SGD with momentum (``torch.optim.SGD``, ``momentum > 0``): one momentum buffer per parameter,
  ``state_bytes`` (4 bytes in fp32).
- Paged AdamW (``paged_adamw``, ``paged_adamw8bit``; Dettmers et al. 2023, "QLoRA", arXiv 2305.14314 §3, "Paged
  Optimizers"; bitsandbytes ``PagedAdamW`` / ``PagedAdamW8bit``): the same state as AdamW (32-bit moments,
  ``state_bytes`` each; bitsandbytes' paged 32-bit optimizer keeps fp32 moments whatever the weights' dtype, so
  bf16-pure's 2-byte moments do not apply) and 8-bit AdamW, allocated in CUDA unified memory
  (``cudaMallocManaged``), outside torch's caching allocator: the driver moves their pages to the host when the
  GPU runs out of memory and back when the optimizer step touches them. memory.py counts them on the GPU only
  at the optimizer step (the forward/backward peak can push them out: host memory holds them then), and
  timing.py prices a round trip of the state over the host link per step whenever they do not fit beside the
  forward/backward peak.
"""

from __future__ import annotations

from collections.abc import Callable

from optplan.estimators.precision import Recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy

BLOCKWISE_8BIT_BLOCK = 2048
"""Values per quantisation block in bitsandbytes' blockwise 8-bit optimizers (arXiv 2110.02861 §2)."""
BLOCKWISE_8BIT_OVERHEAD_BYTES_PER_PARAM = 2 * 4 / BLOCKWISE_8BIT_BLOCK
"""One fp32 absmax per 2048 values, for each of the two moments (bytes/param)."""
ADAFACTOR_FALLBACK_NOTE = (
    "Adafactor state counted as one full second moment per parameter (the unfactored upper bound): this "
    "profile has no parameter shapes (factored_state_elements); profile the model again for the factored size"
)


def _adamw(recipe: Recipe, profile: ModelProfile | None) -> float:
    return 2 * recipe.state_bytes


def _adamw_8bit(recipe: Recipe, profile: ModelProfile | None) -> float:
    return 2 * 1 + BLOCKWISE_8BIT_OVERHEAD_BYTES_PER_PARAM


def _paged_adamw(recipe: Recipe, profile: ModelProfile | None) -> float:
    return 2 * 4.0  # fp32 moments (module docstring)


def _adafactor(recipe: Recipe, profile: ModelProfile | None) -> float:
    if not adafactor_uses_shapes(profile):
        return float(recipe.state_bytes)
    assert profile is not None and profile.factored_state_elements is not None
    if profile.trainable_params == 0:
        return 0.0
    return recipe.state_bytes * profile.factored_state_elements / profile.trainable_params


def _sgd(recipe: Recipe, profile: ModelProfile | None) -> float:
    return recipe.state_bytes


OPTIMIZER_STATE_BYTES: dict[str, Callable[[Recipe, ModelProfile | None], float]] = {
    "adamw": _adamw,
    "adamw8bit": _adamw_8bit,
    "adafactor": _adafactor,
    "sgd": _sgd,
    "paged_adamw": _paged_adamw,
    "paged_adamw8bit": _adamw_8bit,
}


def adafactor_uses_shapes(profile: ModelProfile | None) -> bool:
    """True when ``profile`` carries the factored element count Adafactor's size needs."""
    return profile is not None and profile.factored_state_elements is not None


def optimizer_sees_flat_params(strategy: Strategy) -> bool:
    """True when the engine hands the optimizer flat 1-D partitions instead of the parameters' shapes:
    DeepSpeed ZeRO stage >= 1 and Megatron's distributed optimizer (``--zero 1``); see the module docstring."""
    return strategy.engine in ("deepspeed", "megatron") and strategy.zero >= 1


def optimizer_state_bytes_per_param(optimizer: str, recipe: Recipe, profile: ModelProfile | None = None, *,
                                    flat_params: bool = False) -> float:
    """Moments' bytes per trainable parameter for ``optimizer`` under ``recipe`` (bytes/param), averaged
    over the trainable parameters of ``profile`` (optimizers with factored state depend on the shapes).

    ``flat_params``: the optimizer sees flat 1-D partitions (``optimizer_sees_flat_params(strategy)``),
    so Adafactor cannot factor and keeps a full second moment (``recipe.state_bytes``).
    """
    if flat_params and optimizer == "adafactor":
        return float(recipe.state_bytes)
    return OPTIMIZER_STATE_BYTES[optimizer](recipe, profile)


ADAFACTOR_FLAT_NOTE = (
    "Adafactor under DeepSpeed ZeRO (or Megatron's distributed optimizer) sees flat 1-D partitions, so its "
    "second moment is not factored: counted as one full moment per parameter; ZeRO-0 keeps the factored size"
)


def optimizer_state_note(optimizer: str, profile: ModelProfile | None, *, flat_params: bool = False) -> str | None:
    """A line for the plan's notes when the optimizer's size rests on a fallback rule, else None."""
    if optimizer != "adafactor":
        return None
    if flat_params:
        return ADAFACTOR_FLAT_NOTE
    if not adafactor_uses_shapes(profile):
        return ADAFACTOR_FALLBACK_NOTE
    return None


def optimizer_state_text(optimizer: str, recipe: Recipe) -> str:
    """What the plan's optimizer keeps per trainable parameter beside the weights and gradients (bytes/param), for
    the precision line of a plan: the recipe's fp32 master copy plus the optimizer's moments (ZeRO, arXiv
    1910.02054 §3.1, calls the sum K: 12 for AdamW with an fp32 master copy). Adafactor's factored second moment
    depends on the parameters' shapes and is named, not sized."""
    master = f"{recipe.master_bytes} B fp32 master copy" if recipe.master_bytes else ""
    if optimizer == "adafactor":
        return f"{optimizer}: {master + ' + ' if master else ''}a factored second moment per parameter"
    moments = OPTIMIZER_STATE_BYTES[optimizer](recipe, None)
    k = recipe.master_bytes + moments
    parts = " + ".join(p for p in (master, f"{moments:.3g} B of optimizer state") if p)
    return f"{optimizer}: K = {k:.3g} B/param ({parts})" if moments or master else f"{optimizer}: no state"

