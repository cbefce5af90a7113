"""FSDP under pipeline parallelism on the torch engine: the stage stays unsharded across its micro-batches.

With ``torch.distributed.pipelining`` a pipeline stage runs many micro-batches per optimizer step. Gathering and
resharding its FSDP units for each of them would repeat the all-gathers and reduce-scatters ``microbatches`` times,
exposed between stages, so the PyTorch stack does not:

- torchtitan shards every block with ``reshard_after_forward=False`` when pipeline parallelism is on
  (``torchtitan/distributed/fsdp.py`` ``get_fsdp_reshard_after_forward_policy``, policy "default": "For PP, by
  default do not reshard after forward to avoid per-microbatch all-gathers, which can be expensive and
  non-overlapped"; the same in its December-2024 ``parallelize_llama.apply_fsdp``);
- the schedule's backward (``torch/distributed/pipelining/stage.py`` ``backward_maybe_with_nosync``, torch 2.4 to
  2.13) calls ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` on the FSDP module
  for every backward but the stage's last: the gradients accumulate unsharded and are reduce-scattered once.

So per optimizer step a stage's FSDP traffic is **one all-gather of its weights and one reduce-scatter of its
gradients** (not ``microbatches`` of each), and its memory holds, from the first forward to the last backward,

- the whole stage's gathered weights in the compute dtype (``fsdp_pipeline_unsharded_params``, bytes =
  stage parameters / tp x weight bytes), instead of FSDP's two in-flight units;
- the whole stage's unsharded, accumulated gradients (``fsdp_pipeline_accumulated_grads``) in the reduce dtype:
  FSDP2 upcasts the first micro-batch's gradient to ``reduce_dtype`` and accumulates into it
  (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py`` ``to_accumulated_grad_if_needed`` /
  ``accumulate_unsharded_grad_if_needed``): fp32 under optplan's mixed recipes, the parameter dtype without a
  policy (fsdp_grad_sync.py, which prices the same once-per-step reduction without pipelining).

Units: seconds and bytes per GPU; the parameter counts are one rank's (after tensor parallelism).
"""

from __future__ import annotations

from optplan.estimators.strategy import Strategy


def keeps_stage_unsharded(strategy: Strategy) -> bool:
    """Whether FSDP keeps the pipeline stage gathered across its micro-batches: torch engine, FSDP (full, grad_op
    or hybrid) and pipeline parallelism (module docstring)."""
    return strategy.engine == "torch" and strategy.fsdp != "none" and strategy.pp > 1


def unsharded_stage_params_bytes(stage_params_per_rank: float, weight_bytes: float) -> int:
    """The gathered weights a pipelined FSDP stage holds from its first forward to its last backward (bytes per
    GPU): ``weight_bytes`` per parameter (the compute dtype, and the fp8 weight cache where the recipe keeps one)."""
    return round(stage_params_per_rank * weight_bytes)

