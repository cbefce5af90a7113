"""When torch FSDP reduces gradients under gradient accumulation, and what it holds until then.

FSDP can synchronise (reduce-scatter) each unit's gradients after every micro-batch's backward, or only after the
last micro-batch of the optimizer step (``Strategy.fsdp_grad_sync``: ``"micro_batch"`` or ``"step"``):

- ``"micro_batch"``: each backward reduce-scatters every unit and the sharded gradients accumulate. FSDP2's
  default (``fully_shard`` without ``set_requires_gradient_sync(False)``: torchtitan, optplan's train.py) and what
  accelerate's ``GradientAccumulationPlugin(sync_each_batch=True)`` makes the Hugging Face Trainer do.
- ``"step"``: the micro-batches before the last skip the reduction, and every unit's *unsharded* gradient stays
  alive and accumulates until the last backward reduce-scatters it: FSDP1's ``no_sync()`` (``FullyShardedDataParallel
  .no_sync`` docstring: "gradients are accumulated ... in the unsharded state ... may use more GPU memory"), FSDP2's
  ``set_requires_gradient_sync(False)``, Lightning Fabric's ``no_backward_sync`` (LitGPT's fine-tuning loops),
  accelerate's ``accumulate()`` without ``sync_each_batch`` (the Hugging Face Trainer's default, which accelerate's
  docs name as the FSDP memory trap that ``sync_each_batch`` fixes), and torch pipelining (pipeline_fsdp.py).

``"step"`` trades memory for communication: one reduce-scatter per optimizer step instead of ``grad_accum``, for
a whole stage's unsharded gradients held from the first micro-batch's backward to the last one's reduction
(bytes = trainable parameters of the stage / tp x :func:`accumulated_grad_bytes`). With ``grad_accum == 1`` the two
are the same run.

Gradient dtype (torch ``_fully_shard/_fsdp_param.py`` ``to_accumulated_grad_if_needed``, torch 2.4 to 2.13): FSDP2
upcasts the unsharded gradient to ``reduce_dtype`` before accumulating when the policy has one, fp32 under
optplan's mixed recipes (``MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)``, probes/trainloop.py);
without a policy (fp32, and ``bf16-pure``: 16-bit parameters, no fp32 master) it stays in the parameter dtype,
which is also the dtype FSDP reduce-scatters in (``_fsdp_collectives.foreach_reduce`` allocates the reduce-scatter
input in ``reduce_dtype``, else the gradients' dtype). ``Strategy.fsdp_reduce_dtype`` sets it: ``auto`` is the
above; ``bf16``/``fp16`` reduce in the dtype the weights are gathered in, as accelerate's and the Hugging Face
Trainer's FSDP plugin does by default (``FullyShardedDataParallelPlugin.set_mixed_precision``: ``param_dtype =
reduce_dtype`` = the mixed-precision dtype, accelerate 1.16), Lightning's ``bf16-mixed``/``bf16-true`` FSDP precision,
IBM's fms-fsdp (``MixedPrecisionPolicy(param_dtype=reduce_dtype=torch.bfloat16)``) and Composer's ``PURE``: half the
bytes of fp32 on the wire and in the unsharded accumulators.

Units: bytes per element and bytes per GPU; counts of collectives per optimizer step.
"""

from __future__ import annotations

from optplan.estimators.precision import get_recipe
from optplan.estimators.strategy import Strategy


def fsdp_reduce_bytes(precision: str, reduce_dtype: str = "auto") -> int:
    """Bytes per element FSDP2 reduce-scatters and accumulates unsharded gradients in, for optplan's recipe
    ``precision`` and the plan's ``reduce_dtype`` (``Strategy.fsdp_reduce_dtype``): ``auto`` is 4 (fp32 reduce
    dtype) where the recipe keeps fp32 master weights or computes in fp32, else the recipe's gradient bytes
    (``bf16-pure``: 2); ``fp32`` is 4; ``bf16``/``fp16`` are 2 (module docstring)."""
    if reduce_dtype == "fp32":
        return 4
    if reduce_dtype in ("bf16", "fp16"):
        return 2
    recipe = get_recipe(precision)
    return 4 if recipe.master_bytes > 0 else recipe.grad_bytes


def strategy_reduce_bytes(strategy: Strategy) -> int:
    """:func:`fsdp_reduce_bytes` of ``strategy``'s recipe and reduce dtype (bytes per element)."""
    return fsdp_reduce_bytes(strategy.precision, strategy.fsdp_reduce_dtype)


def syncs_once_per_step(strategy: Strategy) -> bool:
    """Whether FSDP reduce-scatters the gradients once per optimizer step (holding them unsharded until then)
    rather than after every micro-batch: ``fsdp_grad_sync == "step"`` with accumulation, or torch pipelining
    (pipeline_fsdp.py), torch engine with FSDP only."""
    if strategy.engine != "torch" or strategy.fsdp == "none":
        return False
    return strategy.pp > 1 or (strategy.fsdp_grad_sync == "step" and strategy.grad_accum > 1)


def accumulated_grad_bytes(stage_params_per_rank: float, trainable_share: float, precision: str,
                           reduce_dtype: str = "auto") -> int:
    """A stage's unsharded gradients held across the micro-batches of a step (bytes per GPU): its trainable
    parameters (``stage_params_per_rank`` x ``trainable_share``, after tensor parallelism) at
    :func:`fsdp_reduce_bytes` each."""
    return round(stage_params_per_rank * trainable_share * fsdp_reduce_bytes(precision, reduce_dtype))
