"""Memory per GPU: model states, activations, buffers and overhead, each a named figure in bytes.

Sources
- Model states: Rajbhandari et al. 2019, "ZeRO" (arXiv 1910.02054) §5, Figure 1: with Ψ parameters,
  N_d data-parallel ranks and K bytes/param of optimizer state, DDP holds (2 + 2 + K)Ψ, ZeRO-1
  2Ψ + 2Ψ + KΨ/N_d, ZeRO-2 2Ψ + (2 + K)Ψ/N_d, ZeRO-3 (2 + 2 + K)Ψ/N_d. Here the 2s are the recipe's
  weight and gradient bytes/param and K = master bytes + optimizer moments (precision.py,
  optimizers.py). Frozen parameters hold weights but no gradients or optimizer state.
- ZeRO-Offload (Ren et al. 2021, arXiv 2101.06840 §4): optimizer states (and fp32 master) live in
  host memory; ZeRO-Infinity (Rajbhandari et al. 2021, arXiv 2104.07857) also offloads parameters.
- Activations: the static probe's measured fit (profile.py, ActivationFit) at the micro-batch.
- Buffers: DeepSpeed's gradient reduce / all-gather buckets (reduce_bucket_size, allgather_bucket_size
  elements) and, for ZeRO-3, the gathered working set: one repeated block plus the prefetch bucket,
  capped by stage3_max_live_parameters (DeepSpeed ZeRO-3 docs, "stage3_*" parameters).
- Overhead: CUDA context, cuBLAS workspace and NCCL buffers (a stated default, 1 GiB) plus an
  allocator fragmentation margin (a stated default, 5 % of everything else) until probes calibrate.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, computed_field

from optplan.estimators.buckets import deepspeed_buckets
from optplan.estimators.optimizers import optimizer_state_bytes_per_param
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.units import GIB_BYTES

CUDA_CONTEXT_BYTES = 1 * GIB_BYTES
FRAGMENTATION_FRACTION = 0.05
USABLE_MEMORY_FRACTION = 0.98
"""Share of the datasheet capacity a plan may fill (stated default): drivers report ~1 % less than
nominal (an H100 80 GB shows 79.2 GiB, a V100 32 GB 31.7 GiB in torch.cuda.get_device_properties),
and the rest is a safety margin until probes measure the real peak."""
OFFLOAD_GRAD_BYTES = 4
"""ZeRO-Offload keeps the fp32 gradient partition in host memory beside the optimizer states
(Ren et al. 2021, arXiv 2101.06840 §4.1), bytes/param."""


def usable_capacity_bytes(memory_bytes: int) -> int:
    """The memory a plan may fill on a GPU of ``memory_bytes`` datasheet capacity (bytes)."""
    return int(memory_bytes * USABLE_MEMORY_FRACTION)


class ModelStates(BaseModel):
    """Resident (sharded) model states per GPU and the host-side share under offload, bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    host_bytes: int = 0


class MemoryBreakdown(BaseModel):
    """Per-GPU memory of one strategy, by category (bytes), against the GPU's capacity."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    params_bytes: int = Field(ge=0)
    grads_bytes: int = Field(ge=0)
    optimizer_bytes: int = Field(ge=0)
    activations_bytes: int = Field(ge=0)
    buffers_bytes: int = Field(ge=0)
    overhead_bytes: int = Field(ge=0)
    capacity_bytes: int = Field(gt=0)
    host_bytes: int = Field(default=0, ge=0, description="host (CPU) memory per GPU under offload")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_bytes(self) -> int:
        """Sum of every GPU-side category (bytes)."""
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.buffers_bytes + self.overhead_bytes)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def headroom_bytes(self) -> int:
        """Capacity minus total (bytes; negative when it does not fit)."""
        return self.capacity_bytes - self.total_bytes

    @computed_field  # type: ignore[prop-decorator]
    @property
    def fits(self) -> bool:
        """True when the total fits the usable capacity."""
        return self.total_bytes <= self.capacity_bytes


def model_states(profile: ModelProfile, strategy: Strategy) -> ModelStates:
    """Sharded model states per GPU (ZeRO §5 with the recipe's bytes/param), bytes.

    Weights count every unique parameter; gradients and optimizer state count trainable ones only.
    """
    recipe = get_recipe(strategy.precision)
    psi, psi_train, n_d = profile.params, profile.trainable_params, strategy.dp
    k = recipe.master_bytes + optimizer_state_bytes_per_param(strategy.optimizer, recipe, profile)
    weights = psi * recipe.weight_bytes
    grads = psi_train * recipe.grad_bytes
    optim = psi_train * k
    if strategy.zero >= 1:
        optim = optim / n_d
    if strategy.zero >= 2:
        grads = grads / n_d
    if strategy.zero >= 3:
        weights = weights / n_d
    host = 0.0
    if strategy.offload_optimizer != "none":
        host += optim + psi_train * OFFLOAD_GRAD_BYTES / n_d
        optim = 0.0
    if strategy.offload_params != "none":
        host += weights
        weights = 0.0
    return ModelStates(params_bytes=round(weights), grads_bytes=round(grads),
                       optimizer_bytes=round(optim), host_bytes=round(host))


def activation_bytes(profile: ModelProfile, strategy: Strategy) -> int:
    """Activations + temporaries of one micro-batch's forward/backward (bytes), from the profile fit.

    The 16-bit fits are measured under autocast on fp32 weights, which keeps a 16-bit copy of every
    weight alive through the step (``param_copy_bytes``). Recipes whose weights are already 16-bit
    (bf16, fp16, bf16-pure) use the weights themselves, so those copies are subtracted for them.
    """
    recipe = get_recipe(strategy.precision)
    mode = strategy.checkpointing if profile.supports_checkpointing else "none"
    fit = profile.activation(recipe.activation_precision, mode)
    copies = fit.param_copy_bytes if recipe.weight_bytes == 2 else 0
    return max(0, fit.bytes_at(strategy.mbs) - copies)


def buffer_bytes(profile: ModelProfile, strategy: Strategy) -> int:
    """DeepSpeed communication buckets and the ZeRO-3 gathered working set (bytes).

    ZeRO-0/1/2: one reduce bucket and one all-gather bucket in gradient dtype when dp > 1
    (DeepSpeed ``reduce_bucket_size``/``allgather_bucket_size``, elements). ZeRO-3: the reduce bucket
    plus the gathered parameters of one repeated block and the prefetch bucket in weight dtype,
    capped by ``stage3_max_live_parameters``.
    """
    recipe = get_recipe(strategy.precision)
    buckets = deepspeed_buckets(profile)
    if strategy.dp == 1 and strategy.zero == 0:
        return 0
    reduce = min(buckets.reduce_bucket_size, profile.trainable_params) * recipe.grad_bytes
    if strategy.zero < 3:
        gather = min(buckets.allgather_bucket_size, profile.params) * recipe.weight_bytes
        return reduce + (gather if strategy.zero >= 1 else 0)
    block = profile.repeated_block.params_per_block if profile.repeated_block else profile.params
    live = min(block + buckets.stage3_prefetch_bucket_size, buckets.stage3_max_live_parameters,
               profile.params)
    return reduce + live * recipe.weight_bytes


def memory_breakdown(profile: ModelProfile, strategy: Strategy, capacity_bytes: int, *,
                     gpus_per_node: int = 8) -> MemoryBreakdown:
    """Full per-GPU memory breakdown of ``strategy`` on a GPU with ``capacity_bytes`` (bytes)."""
    states = model_states(profile, strategy)
    acts = activation_bytes(profile, strategy)
    bufs = buffer_bytes(profile, strategy)
    allocated = states.params_bytes + states.grads_bytes + states.optimizer_bytes + acts + bufs
    overhead = CUDA_CONTEXT_BYTES + round(FRAGMENTATION_FRACTION * allocated)
    return MemoryBreakdown(
        params_bytes=states.params_bytes, grads_bytes=states.grads_bytes,
        optimizer_bytes=states.optimizer_bytes, activations_bytes=acts, buffers_bytes=bufs,
        overhead_bytes=overhead, capacity_bytes=capacity_bytes, host_bytes=states.host_bytes,
    )
