"""Memory per GPU of the worst rank: model states, activations, buffers and overhead, each in bytes.

Sources
- Model states: Rajbhandari et al. 2019, "ZeRO" (arXiv 1910.02054) §5, Figure 1: with Ψ parameters,
  N_d sharding ranks and K bytes/param of optimizer state, DDP holds (2 + 2 + K)Ψ, ZeRO-1
  2Ψ + 2Ψ + KΨ/N_d, ZeRO-2 2Ψ + (2 + K)Ψ/N_d, ZeRO-3 (2 + 2 + K)Ψ/N_d. Here the 2s are the recipe's
  weight and gradient bytes/param and K = master bytes + optimizer moments (precision.py,
  optimizers.py). Frozen parameters hold weights but no gradients or optimizer state (the trainable
  share is assumed uniform over the model). FSDP SHARD_GRAD_OP counts as ZeRO-2, FULL_SHARD as ZeRO-3,
  HYBRID_SHARD as ZeRO-3 over the node-local part of the group (PyTorch FSDP docs). Megatron-LM keeps
  fp32 main gradients for 16-bit parameters (Megatron-Core distributed optimizer docs: "bf16 params,
  fp32 grads: 6 + 12/d bytes per parameter"), so its gradients are 4 bytes/param.
- Model parallelism (Narayanan et al. 2021, arXiv 2104.04473 §2.2-2.3; Shoeybi et al. 2019 Megatron-LM):
  tensor parallelism splits every block's matrices and the vocabulary-parallel embedding and head by t
  (norms and learned positions stay replicated; norms are counted as split, < 0.1 % of a block);
  pipeline parallelism gives each rank ceil(L/p) blocks, the embedding to the first stage and the head
  to the last (a tied embedding is copied to the last stage, as Megatron does). Memory is reported for
  the worst rank: the first and last stages are both priced and the larger total wins.
- ZeRO-Offload (Ren et al. 2021, arXiv 2101.06840 §4): optimizer states and the fp32 gradient
  partition live in host memory; ZeRO-Infinity (Rajbhandari et al. 2021, arXiv 2104.07857) also
  offloads parameters (to CPU or NVMe); torch FSDP's CPUOffload keeps parameters, gradients and the
  optimizer step on the host.
- Activations: estimators/activations.py (measured fits, or Korthikanti et al. 2022 Table 2 under model
  parallelism, with the pipeline's micro-batches in flight); parameters per rank: estimators/params_placement.py;
  the optimizer step's scratch: estimators/step_scratch.py. This module adds them up per moment of the step.
- Buffers: estimators/engine_buffers.py (DeepSpeed's buckets and ZeRO-3 working set, DDP's buckets, FSDP's
  unsharded units, pipeline and context-parallel tensors in flight, and when each is alive).
- Engines as implemented (checked against real CPU runs of the probes, benchmarks/fidelity.py):
  DeepSpeed ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py, with the contiguous_gradients and
  overlap_comm that ds_config.json sets) keeps an fp32 partition of the weights even for fp32 models,
  partitions the gradients in stage 1 as in stage 2, and copies each gradient into
  ``grads_in_partition``, sized to the WHOLE parameters that overlap the rank's partition of the flat
  buffer (:func:`deepspeed_grad_partition_elements`), through two reduce buckets; both live from the
  first gradient of a backward to its end (and the averaged partition across accumulation steps).
  torch FSDP2 (``fully_shard``) keeps sharded parameters; SHARD_GRAD_OP (``reshard_after_forward=
  False``) holds every unit unsharded from its forward to its backward (the blocks' resharded by the stem's
  backward), and at the root unit's reduce-scatter, the last of the backward, its unsharded gradients and
  fp32 reduce-scatter input are alive with the activations freed (``root_reduce``); FULL_SHARD the root unit (the
  parameters outside the repeated blocks) while the model runs and two block units (one prefetched), one
  at the start of backward (engine_buffers.py).
- When: the peak is the largest total over the moments of the step (profile.STEP_PHASES: forward, loss,
  backward until the first parameter gradient, the rest of backward; and the optimizer step), each
  moment's activations (the profile's per-phase envelopes) plus the buffers alive at that moment. A fit
  without phases (formula fits, model parallelism) takes its peak at every moment, which is the sum of
  everything (an upper bound).
- Overhead: the memory outside the allocator (CUDA context, kernel modules, NCCL buffers) plus the caching
  allocator's margin over the allocated peak, both measured on GPU runs (allocator_overhead.py: per class, a
  step with or without recomputation; one process or a process group) until probes on the target calibrate.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from optplan.estimators.activations import (  # noqa: F401  (re-exported: callers import them from here)
    ATTENTION_SCORE_COEFF,
    WEIGHTS_16BIT_ENGINES,
    activation_bytes,
    activation_moments,
    in_flight_micro_batches,
    measured_fit,
    uses_measured_fit,
)
from optplan.estimators.allocator_overhead import context_bytes, fragmentation_fraction
from optplan.estimators.engine_buffers import (  # noqa: F401  (re-exported: callers import them from here)
    buffer_bytes,
    buffer_items,
    buffer_moments,
    buffers_with_moments,
    deepspeed_frees_grads,
    deepspeed_partitions_grads,
    fp8_cache_bytes,
    frozen_base_bytes,
    fsdp_root_reduce_items,
    zero3_gathered_params,
    zero3_prefetch_params,
)
from optplan.estimators.library_workspaces import cublas_workspace_bytes
from optplan.estimators.optimizers import optimizer_sees_flat_params, optimizer_state_bytes_per_param
from optplan.estimators.parallel import shard_ranks
from optplan.estimators.params_placement import (  # noqa: F401  (re-exported: callers import them from here)
    ParamSplit,
    param_split,
    stage_params,
    stage_params_all_experts,
)
from optplan.estimators.precision import Recipe, get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.step_scratch import (  # noqa: F401  (re-exported: callers import them from here)
    DEEPSPEED_SUB_GROUP_ELEMENTS,
    deepspeed_flattens,
    optimizer_step_scratch_bytes,
    step_peak_extra_bytes,
)
from optplan.estimators.strategy import PAGED_OPTIMIZERS, Strategy
from optplan.estimators.temporaries import (
    AdamImpl,
    DeviceKind,
    adam_step_counter_bytes,
    engine_adam_impl,
)
from optplan.estimators.tensor_plan import (
    replicated_grad_bytes_per_rank,
)

USABLE_MEMORY_FRACTION = 0.98
"""Share of the datasheet capacity a plan may fill (stated default): drivers report ~1 % less than
nominal (an H100 80 GB shows 79.2 GiB, a V100 32 GB 31.7 GiB in torch.cuda.get_device_properties),
and the rest is a safety margin until probes measure the real peak."""
OFFLOAD_GRAD_BYTES = 4
"""ZeRO-Offload keeps the fp32 gradient partition in host memory beside the optimizer states
(Ren et al. 2021, arXiv 2101.06840 §4.1), bytes/param."""
MEGATRON_MAIN_GRAD_BYTES = 4
"""Megatron-LM accumulates 16-bit models' gradients in an fp32 ``main_grad`` buffer, bytes/param."""


class ModelStates(BaseModel):
    """Resident (sharded) model states per GPU and the share offloaded to host or NVMe, bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    host_bytes: int = 0
    nvme_bytes: int = 0


class MemoryBreakdown(BaseModel):
    """Per-GPU memory of one strategy on its worst rank, by category (bytes), against the capacity."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    params_bytes: int = Field(ge=0)
    grads_bytes: int = Field(ge=0)
    optimizer_bytes: int = Field(ge=0)
    activations_bytes: int = Field(ge=0)
    buffers_bytes: int = Field(ge=0)
    overhead_bytes: int = Field(ge=0)
    capacity_bytes: int = Field(gt=0)
    host_bytes: int = Field(default=0, ge=0, description="host (CPU) memory per GPU under offload")
    nvme_bytes: int = Field(default=0, ge=0, description="NVMe storage per GPU under NVMe offload")
    host_bytes_per_node: int = Field(default=0, ge=0, description="host memory of one node's GPUs under offload")
    detail_bytes: dict[str, int] = Field(default_factory=dict,
                                         description="each named buffer and overhead item (bytes)")
    rank: str = Field(default="every rank", description="which rank these figures are for (the worst)")
    moment: str = Field(default="", description="the moment of the step these figures are for (the worst): "
                                              "forward, loss, backward, grads, backward_end, root_reduce or "
                                              "optimizer_step; empty when "
                                              "every term's peak is summed")

    @model_validator(mode="before")
    @classmethod
    def _drop_computed(cls, data: Any) -> Any:
        """Accept its own JSON back (plan.json): the computed totals are recomputed, and must agree."""
        if isinstance(data, dict) and "total_bytes" in data:
            data = dict(data)
            given = {k: data.pop(k) for k in ("total_bytes", "headroom_bytes", "fits") if k in data}
            parts = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes",
                     "overhead_bytes")
            if all(isinstance(data.get(k), int) for k in parts) and given["total_bytes"] != sum(data[k] for k in parts):
                raise ValueError(f"total_bytes {given['total_bytes']} is not the sum of the categories")
        return data

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


def usable_capacity_bytes(memory_bytes: int) -> int:
    """The memory a plan may fill on a GPU of ``memory_bytes`` datasheet capacity (bytes)."""
    return int(memory_bytes * USABLE_MEMORY_FRACTION)


def _grad_bytes(recipe: Recipe, strategy: Strategy) -> float:
    if strategy.engine == "megatron" and recipe.master_bytes > 0:
        return MEGATRON_MAIN_GRAD_BYTES
    return recipe.grad_bytes


DEEPSPEED_FP32_PARTITION_BYTES = 4
"""DeepSpeed ZeRO 1-3 keep an fp32 copy of their partition of the weights (``single_partition_of_fp32_groups``
in deepspeed/runtime/zero/stage_1_and_2.py, ``fp32_partitioned_groups_flat`` in stage3.py) for every
precision, an fp32 model's included: bytes per trainable parameter, sharded over the data-parallel ranks."""
@lru_cache(maxsize=256)
def deepspeed_grad_partition_elements(numels: tuple[int, ...], ranks: int) -> int:
    """Elements of DeepSpeed ZeRO-1/2's ``grads_in_partition`` on its largest rank (count).

    DeepSpeed flattens the trainable parameters in order, splits the flat buffer into ``ranks`` equal
    partitions, and sizes each rank's gradient buffer to the whole parameters that overlap its partition
    (stage_1_and_2.py ``copy_grads_in_partition``: the sum of ``params_in_partition`` numels), so a rank
    whose partition cuts into a large embedding holds that whole embedding's gradient.
    """
    total = sum(numels)
    if ranks <= 1 or total == 0:
        return total
    size = -(-total // ranks)
    change: dict[int, int] = {}  # rank -> change of the held elements there (sparse: ranks may be 2**31)
    start = 0
    for n in numels:
        if n:
            first, last = start // size, (start + n - 1) // size
            change[first] = change.get(first, 0) + n
            change[last + 1] = change.get(last + 1, 0) - n
        start += n
    best = running = 0
    for r in sorted(change):
        running += change[r]
        best = max(best, running)
    return best


def _deepspeed_grad_partition_bytes(profile: ModelProfile, strategy: Strategy, stage: int,
                                    gpus_per_node: int) -> float:
    """``grads_in_partition`` of the worst rank (bytes): exact from the parameter sizes when the profile
    has them and there is no model parallelism, else the ideal 1/N share."""
    recipe = get_recipe(strategy.precision)
    n_d = shard_ranks(strategy, gpus_per_node)
    if profile.param_numels and not strategy.model_parallel:
        return deepspeed_grad_partition_elements(tuple(profile.param_numels), n_d) * recipe.grad_bytes
    psi_train = stage_params(profile, strategy, stage) * (
        profile.trainable_params / profile.params if profile.params else 0.0)
    return psi_train * recipe.grad_bytes / n_d


def model_states(profile: ModelProfile, strategy: Strategy, *, stage: int = 0,
                 gpus_per_node: int = 8) -> ModelStates:
    """Sharded model states per GPU of pipeline ``stage`` (ZeRO §5 with the recipe's bytes/param), bytes.

    Weights count every unique parameter; gradients and optimizer state count trainable ones only.
    Sharding runs over the dp·cp ranks (the node-local part of them for HYBRID_SHARD). DeepSpeed ZeRO-1/2's
    gradients are its ``grads_in_partition`` at their largest (they live only from the first gradient of a
    backward to its end: see :func:`memory_breakdown`).
    """
    recipe = get_recipe(strategy.precision)
    psi = stage_params(profile, strategy, stage)
    train_share = profile.trainable_params / profile.params if profile.params else 0.0
    psi_train = psi * train_share
    # what sharding divides: every expert over the dp·cp ranks (expert_parallel.py); = psi without experts
    psi_sharded = stage_params_all_experts(profile, strategy, stage)
    n_d = shard_ranks(strategy, gpus_per_node)
    k = recipe.master_bytes + optimizer_state_bytes_per_param(
        strategy.optimizer, recipe, profile, flat_params=optimizer_sees_flat_params(strategy))
    shard = strategy.shard_stage
    weights = psi * recipe.weight_bytes
    if profile.adapter is not None:  # LoRA: trainable adapters per the recipe, the frozen base 16-bit or quantised
        weights = psi_train * recipe.weight_bytes + frozen_base_bytes(profile, strategy) * (
            psi / profile.params if profile.params else 0.0)
    grads = psi_train * _grad_bytes(recipe, strategy) + replicated_grad_bytes_per_rank(
        profile, strategy, _grad_bytes(recipe, strategy))
    if (strategy.engine == "deepspeed" and strategy.zero > 0 and recipe.master_bytes == 0
            and recipe.weight_bytes == 4):
        k += DEEPSPEED_FP32_PARTITION_BYTES  # its fp32 partition, kept beside fp32 weights too
    optim = psi_train * k
    if shard >= 1:
        optim = psi_sharded * train_share * k / n_d
    if deepspeed_partitions_grads(strategy):
        grads = _deepspeed_grad_partition_bytes(profile, strategy, stage, gpus_per_node)
    elif shard >= 2:
        grads = grads * psi_sharded / psi / n_d if psi else 0.0
    if shard >= 3 or (strategy.engine == "torch" and strategy.fsdp == "grad_op"):
        weights = weights * psi_sharded / psi / n_d if psi else 0.0  # FSDP SHARD_GRAD_OP keeps sharded weights
    if shard < 3:
        weights += psi * fp8_cache_bytes(strategy)
    off: dict[str, float] = {"cpu": 0.0, "nvme": 0.0}
    if strategy.engine == "torch" and strategy.offload_params != "none":
        off["cpu"] += weights + grads + optim
        weights = grads = optim = 0.0
    else:
        if strategy.offload_optimizer != "none":
            off[strategy.offload_optimizer] += optim + psi_train * OFFLOAD_GRAD_BYTES / n_d
            optim = 0.0
        if strategy.offload_params != "none":
            off[strategy.offload_params] += weights
            weights = 0.0
    return ModelStates(params_bytes=round(weights), grads_bytes=round(grads), optimizer_bytes=round(optim),
                       host_bytes=round(off["cpu"]), nvme_bytes=round(off["nvme"]))


def _grad_bytes_by_moment(states: ModelStates, profile: ModelProfile, strategy: Strategy, stage: int,
                          gpus_per_node: int) -> tuple[int, int, int]:
    """Gradient bytes on the device (after the first gradient of a backward, elsewhere in the step, at the
    optimizer step). DeepSpeed ZeRO-1/2: ``grads_in_partition`` from the first gradient to the end of
    backward, then the averaged 1/N partition, which accumulation steps keep. DeepSpeed ZeRO-0 without
    accumulation: none before the first gradient of backward (freed after the last step), all of them after it
    (an upper bound while backward makes them). Every other engine keeps its gradients throughout."""
    if deepspeed_frees_grads(strategy):  # none before this backward makes them (engine_buffers.py)
        return states.grads_bytes, 0, states.grads_bytes
    if not deepspeed_partitions_grads(strategy):
        return states.grads_bytes, states.grads_bytes, states.grads_bytes
    recipe = get_recipe(strategy.precision)
    psi_train = stage_params(profile, strategy, stage) * (
        profile.trainable_params / profile.params if profile.params else 0.0)
    averaged = round(psi_train * recipe.grad_bytes / shard_ranks(strategy, gpus_per_node))
    kept = averaged if strategy.grad_accum > 1 else 0
    return states.grads_bytes + kept, kept, averaged


def _stage_breakdown(profile: ModelProfile, strategy: Strategy, capacity_bytes: int, gpus_per_node: int,
                     stage: int, adam_impl: AdamImpl | None, device: DeviceKind,
                     gpu: str | None = None) -> MemoryBreakdown:
    """The rank's memory at the worst moment of the step (module docstring, "When")."""
    states = model_states(profile, strategy, stage=stage, gpus_per_node=gpus_per_node)
    buffers = buffers_with_moments(profile, strategy, stage, gpus_per_node)
    whole: dict[str, int] = {}
    if strategy.optimizer == "adamw" and strategy.offload_optimizer == "none":
        impl = adam_impl or engine_adam_impl(strategy.engine, device)
        counters = adam_step_counter_bytes(len(profile.param_numels), impl, device)
        if counters:
            whole["adam_step_counters"] = counters
    if profile.buffer_bytes:
        whole["model_buffers"] = profile.buffer_bytes
    if device == "cuda":  # cuBLAS's workspaces, from the first matrix product on (library_workspaces.py)
        whole["cublas_workspaces"] = cublas_workspace_bytes(gpu)

    def live_at(moment: str) -> dict[str, int]:
        return {**{k: v for k, (v, m) in buffers.items() if m is None or moment == "step" or moment in m}, **whole}

    during, outside, at_step = _grad_bytes_by_moment(states, profile, strategy, stage, gpus_per_node)
    moments = [(moment, acts, during if moment in ("grads", "stem_grads", "step") else outside, live_at(moment))
               for moment, acts in activation_moments(profile, strategy, stage=stage).items()]
    if deepspeed_partitions_grads(strategy):
        # the end of backward (independent_gradient_partition_epilogue): the averaged 1/N partition is built
        # while grads_in_partition and the reduce buckets are still alive, the activations freed
        moments.append(("backward_end", 0, during + at_step, live_at("grads")))
    elif strategy.engine == "deepspeed" and strategy.zero == 0:
        # the end of backward (allreduce_gradients): every gradient and their flat copy, the activations freed
        moments.append(("backward_end", 0, during, live_at("backward_end")))
    root_reduce = fsdp_root_reduce_items(profile, strategy, stage, device)
    if root_reduce:  # FSDP2's last reduce-scatter, the activations freed (engine_buffers.fsdp_root_reduce_items)
        kept = {k: v for k, (v, m) in buffers.items() if m is None}
        moments.append(("root_reduce", 0, during, {**kept, **whole, **root_reduce}))
    peak_acts = max(acts for _, acts, _, _ in moments)
    moment, acts, grads, items = max(moments, key=lambda m: m[1] + m[2] + sum(m[3].values()))
    scratch = optimizer_step_scratch_bytes(profile, strategy, stage=stage, gpus_per_node=gpus_per_node,
                                           adam_impl=adam_impl, device=device)
    step_grads, step_items = at_step, live_at("optimizer_step")
    optimizer_bytes, paged_out = states.optimizer_bytes, 0
    run_total = grads + acts + sum(items.values())
    if strategy.optimizer in PAGED_OPTIMIZERS and not _fits_beside(states.params_bytes + run_total + optimizer_bytes,
                                                                    capacity_bytes, strategy):
        # paged state (optimizers.py): pushed to the host by the forward/backward peak, back for the step
        optimizer_bytes, paged_out = 0, states.optimizer_bytes
        scratch += states.optimizer_bytes  # what the step holds on top of its gradients and buffers
    if step_grads + sum(step_items.values()) + scratch > run_total:
        # the optimizer step is the worst moment: report the activation peak (what a user reads as "the
        # activations") and what the step's scratch adds above it, so the categories still sum to the peak
        moment, grads, items = "optimizer_step", step_grads, dict(step_items)
        acts = min(peak_acts, scratch)
        if paged_out:  # the paged state is back on the GPU for the step
            optimizer_bytes, scratch = paged_out, scratch - paged_out
            acts = min(peak_acts, scratch)
        name = "deepspeed_step_fp32_grad_flatten" if deepspeed_flattens(strategy) else "optimizer_step_scratch"
        if scratch > acts:
            items[name] = scratch - acts
    allocated = states.params_bytes + grads + optimizer_bytes + acts + sum(items.values())
    fragmentation = round(fragmentation_fraction(strategy) * allocated)
    context = context_bytes(strategy)
    detail = {**items, "cuda_context": context, "fragmentation_margin": fragmentation}
    if paged_out:
        detail["paged_optimizer_state_off_gpu"] = paged_out  # at the forward/backward peak: held by the host
    p = strategy.pp
    if p == 1:
        rank = "every rank"
    elif strategy.dualpipe:
        held = in_flight_micro_batches(strategy, stage)
        rank = (f"DualPipe rank {stage} of {p} (stages {stage} and {p - 1 - stage}: embedding, output head and loss, "
                f"{held:g} chunk-micro-batches in flight)")
    elif stage == 0:
        held = in_flight_micro_batches(strategy, 0)
        rank = f"pipeline stage 0 of {p} (embedding, {held:g} micro-batches in flight)"
    else:
        rank = f"pipeline stage {stage} of {p} (output head and loss)"
    ranks_per_node = min(gpus_per_node, strategy.world_size)
    host = states.host_bytes + paged_out
    return MemoryBreakdown(
        params_bytes=states.params_bytes, grads_bytes=grads,
        optimizer_bytes=optimizer_bytes, activations_bytes=acts, buffers_bytes=sum(items.values()),
        overhead_bytes=context + fragmentation, capacity_bytes=capacity_bytes,
        host_bytes=host, nvme_bytes=states.nvme_bytes,
        host_bytes_per_node=host * ranks_per_node, detail_bytes=detail, rank=rank,
        moment="" if moment == "step" else moment,
    )


def _fits_beside(allocated_bytes: int, capacity_bytes: int, strategy: Strategy) -> bool:
    """Whether ``allocated_bytes`` of tensors, with the allocator's margin and the context
    (allocator_overhead.py), fit ``capacity_bytes``: a paged optimizer's state stays on the GPU then
    (optimizers.py)."""
    return (allocated_bytes * (1 + fragmentation_fraction(strategy)) + context_bytes(strategy)
            <= capacity_bytes)


def memory_breakdown(profile: ModelProfile, strategy: Strategy, capacity_bytes: int, *,
                     gpus_per_node: int = 8, adam_impl: AdamImpl | None = None,
                     device: DeviceKind = "cuda", gpu: str | None = None) -> MemoryBreakdown:
    """Per-GPU memory of ``strategy`` on its worst rank (the first or last pipeline stage), bytes.

    ``adam_impl`` overrides the engine's default AdamW implementation and ``device`` says where the step
    runs ("cpu" for a real CPU step, e.g. the exact-accounting benchmark). ``gpu`` (a catalogue name) sizes
    the CUDA libraries' workspaces (library_workspaces.py; None: their default size)."""
    stages = (0,) if strategy.pp == 1 else (0,) if strategy.dualpipe else (0, strategy.pp - 1)
    worst = [_stage_breakdown(profile, strategy, capacity_bytes, gpus_per_node, s, adam_impl, device, gpu)
             for s in stages]
    return max(worst, key=lambda m: m.total_bytes)
