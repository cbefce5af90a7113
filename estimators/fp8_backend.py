"""Which fp8 implementation a plan runs, and the memory that implementation holds beyond the bf16 recipe (bytes).

The ``fp8`` recipe (estimators/precision.py) runs its Linear layers' matmuls in fp8 with bf16 model states. Two
implementations do it, and they hold different memory:

* **Transformer Engine** (Megatron-LM, the ``megatron`` engine; the ``deepspeed`` engine, whose ds_config has no
  fp8 recipe: the export refuses fp8 and names Transformer Engine, planner/export/deepspeed.py; and accelerate's
  ``fp8_config``): every TE ``Linear`` casts its weight to fp8 once per
  step and keeps the fp8 weight and its fp8 transpose through the step (``Recipe.fp8_weight_cache_bytes`` = 2 bytes
  per parameter), and saves its GEMM inputs in fp8 for backward (estimators/fp8_activations.py). TE user guide,
  "Using FP8 with Transformer Engine"; ``transformer_engine/pytorch/module/linear.py``.
* **torchao's** ``Float8Linear`` (optplan's training loop on the ``torch`` engine, train.py under torchrun:
  probes/trainloop.py ``apply_fp8``; torchtitan's float8): ``matmul_with_hp_or_float8_args`` saves the
  high-precision input and weight it was given (``ctx.save_for_backward(input_hp, weight_hp_t)``, references, no
  copies) and casts both to fp8 inside the forward and again inside the backward (torchao
  ``torchao/float8/float8_linear.py``): no fp8 weight copy outlives a matmul and the saved inputs are bf16. The
  casts are transient (one layer's weight and input in fp8 at a time, below the layer's own working set).

Measured: torchtitan's published float8 runs (benchmarks/fidelity_torchtitan.py, max_memory_reserved on H100 and
H200) sit at -10 to +14 % of the estimate priced as torchao holds memory, where Transformer Engine's cache and fp8
inputs put their 405B pipeline runs 12-30 % over (the unsharded pipeline stage doubled by the cache) and the bf16 /
float8 pairs 3 GiB apart where torchtitan measured them within 0.2 GiB.
"""

from __future__ import annotations

from typing import Literal

from optplan.estimators.precision import get_recipe
from optplan.estimators.strategy import Strategy

Fp8Backend = Literal["transformer_engine", "torchao"]


def fp8_backend(strategy: Strategy) -> Fp8Backend | None:
    """The fp8 implementation ``strategy`` runs (module docstring); None without fp8 matmuls."""
    if get_recipe(strategy.precision).compute_dtype != "fp8":
        return None
    return "torchao" if strategy.engine == "torch" else "transformer_engine"


def fp8_weight_cache_bytes_per_param(strategy: Strategy) -> float:
    """Bytes per parameter of fp8 weight copies held through the step beside the recipe's weights: Transformer
    Engine's fp8 W and W^T (``Recipe.fp8_weight_cache_bytes``); 0 for torchao and for recipes without fp8."""
    if fp8_backend(strategy) != "transformer_engine":
        return 0.0
    return float(get_recipe(strategy.precision).fp8_weight_cache_bytes)


def saves_fp8_gemm_inputs(strategy: Strategy) -> bool:
    """Whether the GEMM inputs kept for backward are fp8 (Transformer Engine) rather than bf16 (torchao, bf16)."""
    return fp8_backend(strategy) == "transformer_engine"


__all__ = ["Fp8Backend", "fp8_backend", "fp8_weight_cache_bytes_per_param", "saves_fp8_gemm_inputs"]
