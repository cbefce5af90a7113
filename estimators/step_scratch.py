"""What the optimizer step allocates beside the model states on one rank (bytes): DeepSpeed's flattened fp32
gradient partition and its conversions, torch's fp32 master gradients, and the AdamW step's own temporaries.

Sources: DeepSpeed ``deepspeed/runtime/zero/stage_1_and_2.py`` and ``stage3.py`` (``_flatten_dense_tensors`` of the
fp32 gradients before the inner optimizer steps; ZeRO-3 steps one ``sub_group_size`` at a time), torch's
``torch/optim/adamw.py`` (foreach/fused/single-tensor temporaries, estimators/temporaries.py), each checked
against real CPU runs of the probes (benchmarks/fidelity.py). memory.py adds the result at the step moment.
"""

from __future__ import annotations

from functools import lru_cache

from optplan.estimators.optimizers import optimizer_sees_flat_params
from optplan.estimators.parallel import shard_ranks
from optplan.estimators.params_placement import stage_params
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.temporaries import (
    AdamImpl,
    DeviceKind,
    adamw_step_temp_bytes,
    engine_adam_impl,
    optimizer_temp_excess_bytes,
)

DEEPSPEED_STEP_FLATTEN_BYTES = 8
"""DeepSpeed ZeRO-0 with 16-bit weights (FP16_Optimizer, also used for bf16 as DDP_BFLOAT16) converts every
gradient to fp32 and flattens the copies at ``step()`` (deepspeed/runtime/fp16/fused_optimizer.py,
``FP16_Optimizer.step``: ``_flatten_dense_tensors([p.grad.to(fp32) ...])``): 4 bytes/param of copies plus
4 of the flat buffer live at once, after the activations are freed. Bytes per trainable parameter."""


DEEPSPEED_ZERO12_STEP_FP32_BYTES = 4
"""DeepSpeed ZeRO-1/2/3 with 16-bit weights and fp32 master weights, at ``step()``: the averaged 16-bit
gradient partition is flattened into a new 16-bit buffer (ZeRO-1/2; ZeRO-3's partition is one flat tensor,
which flattening returns as is) and converted to an fp32 gradient for the fp32
master partition, all alive at once (deepspeed/runtime/zero/stage_1_and_2.py,
``DeepSpeedZeroOptimizer.step``: ``flatten_dense_tensors_aligned(...)``, ``.to(single_partition_of_fp32_groups
[i].dtype)``; stage3.py ``_prepare_fp32_grad_for_sub_group``, one sub-group of at most
``DEEPSPEED_SUB_GROUP_ELEMENTS`` at a time): above the averaged partition already counted, grad bytes + this
many bytes per parameter of the rank's partition. Measured by the CPU probe (examples/mlp.py bf16, one
process): ZeRO-1/2 -24 % without it, -12 % with it; ZeRO-3 -31 %, -11 %. The rest (about 1.5 × the 16-bit
gradients in both) is not explained yet (reduce buckets kept to the step, gradient-clipping temporaries?):
the GPU campaign's bf16 ZeRO cases will measure it."""
DEEPSPEED_SUB_GROUP_ELEMENTS = 1_000_000_000
"""ZeRO-3's default ``sub_group_size`` (DeepSpeed's config docs; optplan's ds_config keeps the default)."""


def _deepspeed_zero12_converts(strategy: Strategy) -> bool:
    recipe = get_recipe(strategy.precision)
    return (strategy.engine == "deepspeed" and strategy.zero in (1, 2, 3) and recipe.weight_bytes == 2
            and recipe.master_bytes > 0 and strategy.offload_optimizer == "none")


TORCH_MASTER_GRAD_BYTES = 4
"""torch without FSDP, 16-bit weights with fp32 master weights (recipes bf16/fp16): optplan's train.py keeps
fp32 masters (``probes/trainloop.MasterWeights``, the master-weight scheme of Micikevicius et al. 2018,
"Mixed Precision Training", arXiv 1710.03740 §3.1) and at ``step()`` makes an fp32 gradient for every master
from the 16-bit one before the inner optimizer steps, freeing them after: 4 bytes per trainable parameter,
alive at the optimizer step (measured: benchmarks/fidelity_train.py, DDP bf16). Bytes per parameter."""


def _torch_master_weights(strategy: Strategy) -> bool:
    recipe = get_recipe(strategy.precision)
    return (strategy.engine == "torch" and strategy.fsdp == "none" and recipe.weight_bytes == 2
            and recipe.master_bytes > 0)


def deepspeed_flattens(strategy: Strategy) -> bool:
    recipe = get_recipe(strategy.precision)
    return (strategy.engine == "deepspeed" and strategy.zero == 0 and recipe.weight_bytes == 2
            and recipe.master_bytes > 0)


def optimizer_step_scratch_bytes(profile: ModelProfile, strategy: Strategy, *, stage: int = 0,
                                 gpus_per_node: int = 8, adam_impl: AdamImpl | None = None,
                                 device: DeviceKind = "cuda") -> int:
    """Transient bytes the optimizer step allocates on the device, after backward (bytes).

    DeepSpeed ZeRO-0 with 16-bit weights: the fp32 gradient flattening (DEEPSPEED_STEP_FLATTEN_BYTES per
    parameter; its FusedAdam then updates in place). DeepSpeed ZeRO-1/2/3 with 16-bit weights: the fp32
    gradient of the rank's partition (DEEPSPEED_ZERO12_STEP_FP32_BYTES; ZeRO-3 one sub-group at a time),
    made from a flat 16-bit copy in ZeRO-1/2, which then free the 16-bit gradients before the optimizer
    steps (stage_1_and_2.py ``step``: ``free_grad_in_param_list``, ``averaged_gradients[i] = None``): the
    larger of the conversion and the optimizer's own scratch on the fp32 gradient less the freed 16-bit
    partition. torch without FSDP with 16-bit weights and fp32 masters: the fp32 gradients the
    master-weight step makes from the 16-bit ones, all before the inner optimizer steps
    (TORCH_MASTER_GRAD_BYTES). AdamW, over this rank's (sharded) parameter tensors (DeepSpeed ZeRO >= 1:
    one flat partition): nothing for fused kernels (DeepSpeed and Megatron on GPUs), Σ n_i · moment bytes for
    torch's foreach default on CUDA, max(2·n_i + n_{i−1}) · moment bytes for its CPU loop (temporaries.py).
    Offloaded optimizers step on the host: nothing on the device.
    """
    recipe = get_recipe(strategy.precision)
    share = stage_params(profile, strategy, stage) / profile.params if profile.params else 0.0
    trainable = profile.trainable_params * share
    if deepspeed_flattens(strategy):
        return round(DEEPSPEED_STEP_FLATTEN_BYTES * trainable)
    fp32_grad = flat_copy = freed = 0.0
    if _deepspeed_zero12_converts(strategy):
        elements = trainable / shard_ranks(strategy, gpus_per_node)
        if strategy.zero == 3:  # the partition is already one flat tensor, kept through the step
            elements = min(elements, DEEPSPEED_SUB_GROUP_ELEMENTS)
        else:
            flat_copy = freed = recipe.grad_bytes * elements
        fp32_grad = DEEPSPEED_ZERO12_STEP_FP32_BYTES * elements
    if _torch_master_weights(strategy):
        fp32_grad = TORCH_MASTER_GRAD_BYTES * trainable
    adam = _adam_step_scratch(profile, strategy, share, gpus_per_node, adam_impl, device)
    return round(max(flat_copy + fp32_grad, fp32_grad + adam - freed))


def _adam_step_scratch(profile: ModelProfile, strategy: Strategy, share: float, gpus_per_node: int,
                       adam_impl: AdamImpl | None, device: DeviceKind) -> int:
    """AdamW's own step temporaries on the device (bytes; 0 for other optimizers, offload, fused kernels)."""
    if strategy.optimizer != "adamw" or strategy.offload_optimizer != "none" or strategy.offload_params != "none":
        return 0
    impl = adam_impl or engine_adam_impl(strategy.engine, device)
    if impl == "fused":  # no scratch: skip the per-tensor sizes (the search's hot path, deep models)
        return 0
    if strategy.shard_stage >= 1:
        share /= shard_ranks(strategy, gpus_per_node)
    # DeepSpeed ZeRO >= 1 hands the optimizer one flat fp32 partition: a single tensor of the rank's share
    numels = () if optimizer_sees_flat_params(strategy) else tuple(profile.param_numels)
    recipe = get_recipe(strategy.precision)
    return _adamw_scratch(numels, round(profile.trainable_params * share), share, impl, recipe.state_bytes)


@lru_cache(maxsize=1024)
def _adamw_scratch(param_numels: tuple[int, ...], whole: int, share: float, impl: AdamImpl, state_bytes: int) -> int:
    """``adamw_step_temp_bytes`` over the rank's ``share`` of each tensor (``whole`` when no sizes are known);
    cached: the search asks it for every candidate of one model."""
    numels = [round(n * share) for n in param_numels] or [whole]
    return adamw_step_temp_bytes(numels, impl, state_bytes=state_bytes)


def step_peak_extra_bytes(profile: ModelProfile, strategy: Strategy, activations_bytes: int, stage: int = 0,
                          *, gpus_per_node: int = 8, adam_impl: AdamImpl | None = None,
                          device: DeviceKind = "cuda") -> int:
    """What the optimizer step's scratch adds above the backward-pass peak (bytes, >= 0): the step runs
    when the activations are freed and every gradient is alive, so the peak is states + max(activations,
    scratch) (temporaries.optimizer_temp_excess_bytes)."""
    scratch = optimizer_step_scratch_bytes(profile, strategy, stage=stage, gpus_per_node=gpus_per_node,
                                           adam_impl=adam_impl, device=device)
    return optimizer_temp_excess_bytes(activations_bytes, scratch)
