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
- Activations: measured fits from the static probe (profile.py) when no model parallelism is used; with
  tensor/sequence/context/pipeline parallelism (or for ``--arch`` shapes) Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198) Table 2 per layer:
  s·b·h·(34 + 5·a·s/h) bytes without parallelism; with tensor parallelism the 10·s·b·h of layer-norm
  inputs, block inputs and dropout masks stays replicated and 24·s·b·h + 5·a·s²·b is split by t; with
  sequence parallelism all of it is split by t; selective recomputation drops the 5·a·s²·b term (which
  flash attention never stores); full recomputation keeps 2·s·b·h per layer (its input) plus one layer's
  working set. A measured profile keeps its measured per-layer bytes and its measured non-layer part
  (embedding, logits, loss: split by t as Megatron's vocabulary-parallel cross entropy does); the split
  between the two takes the Table 2 per-layer figure (generalised to GQA and the MLP width, and to
  gated Llama MLPs: TransformerShape.layer_bytes_per_token). Context parallelism divides the sequence by cp.
  Pipeline: under 1F1B the first stage holds min(p, m) micro-batches in flight, the last one
  (Narayanan et al. 2021 §2.2.1); interleaving with v virtual stages multiplies the first stage's
  activations by 1 + (p−1)/(p·v) (Korthikanti et al. §4.2.3).
- Buffers: DeepSpeed's gradient reduce / all-gather buckets (reduce_bucket_size, allgather_bucket_size
  elements) and, for ZeRO-3, the gathered working set: one repeated block plus the prefetch bucket,
  capped by stage3_max_live_parameters (DeepSpeed ZeRO-3 docs, "stage3_*" parameters); torch DDP's
  gradient buckets (a copy of every gradient unless gradient_as_bucket_view=True, torch DDP docs);
  FSDP's unsharded unit, its prefetched successor and the unit's unsharded gradient for the
  reduce-scatter (FSDP2 ``fully_shard`` docs); pipeline send/receive tensors (s·b·h per direction);
  context-parallel K/V chunks in flight (double-buffered ring, Liu et al. 2023 Ring Attention).
- Overhead: CUDA context, cuBLAS workspace and NCCL buffers (a stated default, 1 GiB) plus an
  allocator fragmentation margin (a stated default, 5 % of everything else) until probes calibrate.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from optplan.estimators.buckets import deepspeed_buckets
from optplan.estimators.optimizers import optimizer_sees_flat_params, optimizer_state_bytes_per_param
from optplan.estimators.parallel import layers_per_stage, placement
from optplan.estimators.pipeline import in_flight_microbatches
from optplan.estimators.precision import Recipe, get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.temporaries import (
    AdamImpl,
    DeviceKind,
    adam_step_counter_bytes,
    adamw_step_temp_bytes,
    engine_adam_impl,
    optimizer_temp_excess_bytes,
)
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
MEGATRON_MAIN_GRAD_BYTES = 4
"""Megatron-LM accumulates 16-bit models' gradients in an fp32 ``main_grad`` buffer, bytes/param."""
ATTENTION_SCORE_COEFF = 5
"""Korthikanti et al. Table 2: 5·a·s² bytes per sample per layer of attention scores, softmax and
dropout, 16-bit (dropped by flash attention and by selective recomputation)."""


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


class ParamSplit(BaseModel):
    """Where a model's parameters sit: repeated blocks, input embedding, output head, the rest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: int
    per_block: int
    embed: int
    head: int
    tied: bool
    other: int


def usable_capacity_bytes(memory_bytes: int) -> int:
    """The memory a plan may fill on a GPU of ``memory_bytes`` datasheet capacity (bytes)."""
    return int(memory_bytes * USABLE_MEMORY_FRACTION)


def param_split(profile: ModelProfile) -> ParamSplit:
    """Split the parameters into blocks, embedding (V·h), head (V·h when untied) and the rest.

    Without a transformer shape every non-block parameter is "other" (placed on the first stage).
    """
    block = profile.repeated_block
    layers, per_block = (block.count, block.params_per_block) if block else (0, 0)
    rest = max(0, profile.params - layers * per_block)
    shape = profile.transformer
    if shape is None or not shape.vocab:
        return ParamSplit(layers=layers, per_block=per_block, embed=0, head=0, tied=False, other=rest)
    table = shape.vocab * shape.hidden
    embed = min(table, rest)
    head = table if rest - embed >= table else 0
    return ParamSplit(layers=layers, per_block=per_block, embed=embed, head=head, tied=head == 0,
                      other=rest - embed - head)


def stage_params(profile: ModelProfile, strategy: Strategy, stage: int = 0) -> float:
    """Parameters held by one rank of pipeline ``stage`` after tensor parallelism (count, before ZeRO)."""
    split = param_split(profile)
    t, p = strategy.tp, strategy.pp
    if p == 1:
        return (split.layers * split.per_block + split.embed + split.head) / t + split.other
    n = layers_per_stage(split.layers, p) * split.per_block / t
    if stage == 0:
        n += split.embed / t + split.other
    if stage == p - 1:
        n += (split.head or (split.embed if split.tied else 0)) / t
    return n


def _grad_bytes(recipe: Recipe, strategy: Strategy) -> float:
    if strategy.engine == "megatron" and recipe.master_bytes > 0:
        return MEGATRON_MAIN_GRAD_BYTES
    return recipe.grad_bytes


def _fp8_cache_bytes(recipe: Recipe) -> float:
    return float(recipe.fp8_weight_cache_bytes)


def model_states(profile: ModelProfile, strategy: Strategy, *, stage: int = 0,
                 gpus_per_node: int = 8) -> ModelStates:
    """Sharded model states per GPU of pipeline ``stage`` (ZeRO §5 with the recipe's bytes/param), bytes.

    Weights count every unique parameter; gradients and optimizer state count trainable ones only.
    Sharding runs over the dp·cp ranks (the node-local part of them for HYBRID_SHARD).
    """
    recipe = get_recipe(strategy.precision)
    psi = stage_params(profile, strategy, stage)
    psi_train = psi * (profile.trainable_params / profile.params if profile.params else 0.0)
    n_d = placement(strategy, gpus_per_node).shard.ranks
    k = recipe.master_bytes + optimizer_state_bytes_per_param(
        strategy.optimizer, recipe, profile, flat_params=optimizer_sees_flat_params(strategy))
    shard = strategy.shard_stage
    weights = psi * recipe.weight_bytes
    grads = psi_train * _grad_bytes(recipe, strategy)
    optim = psi_train * k
    if shard >= 1:
        optim = optim / n_d
    if shard >= 2:
        grads = grads / n_d
    if shard >= 3:
        weights = weights / n_d
    else:
        weights += psi * _fp8_cache_bytes(recipe)
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


def in_flight_micro_batches(strategy: Strategy, stage: int = 0) -> float:
    """Micro-batches whose activations pipeline ``stage`` holds at its peak (count, may be fractional).

    1F1B: stage i holds min(p − i, m) (Narayanan et al. 2021 §2.2.1); interleaved with v virtual stages
    the first stage holds p·(1 + (p−1)/(p·v)) stage-loads (Korthikanti et al. 2022 §4.2.3), which is
    Megatron's warm-up count, computed per stage by :func:`optplan.estimators.pipeline.in_flight_microbatches`.
    """
    return in_flight_microbatches(strategy.pp, stage, strategy.grad_accum, strategy.vpp)


def _uses_measured_fit(profile: ModelProfile, strategy: Strategy) -> bool:
    if strategy.model_parallel:
        return False
    if profile.activation_source == "measured":
        return True
    return strategy.flash or strategy.checkpointing != "none"


def _fixed_stage_bytes(profile: ModelProfile, strategy: Strategy, fixed: int, copies: int, stage: int) -> float:
    """The fit's fixed bytes on one rank: autocast weight copies scale with the rank's parameters and
    vanish for 16-bit weights; the rest stays."""
    recipe = get_recipe(strategy.precision)
    share = stage_params(profile, strategy, stage) / profile.params if profile.params else 1.0
    kept_copies = 0 if recipe.weight_bytes == 2 else copies * share
    return max(0.0, fixed - copies + kept_copies)


def activation_bytes(profile: ModelProfile, strategy: Strategy, *, stage: int = 0) -> int:
    """Activations + temporaries held by one rank of pipeline ``stage`` at its peak (bytes).

    Without model parallelism: the profile's measured fit at the micro-batch (selective recomputation
    keeps the measured bytes: the profile's attention kernel stores no s×s scores). The 16-bit fits are
    measured under autocast on fp32 weights, which keeps a 16-bit copy of every weight alive
    (``param_copy_bytes``); recipes whose weights are already 16-bit drop those copies. With
    tensor/sequence/context/pipeline parallelism, Korthikanti et al. Table 2 (module docstring).
    """
    recipe = get_recipe(strategy.precision)
    mode = strategy.checkpointing if profile.supports_checkpointing else "none"
    fit_mode = "full" if mode == "full" else "none"
    fit = profile.activation(recipe.activation_precision, fit_mode)
    if _uses_measured_fit(profile, strategy):
        return fit.bytes_at(strategy.mbs, param_copies=recipe.weight_bytes != 2)
    fixed = _fixed_stage_bytes(profile, strategy, fit.fixed_at(strategy.mbs), fit.param_copies_at(strategy.mbs), stage)
    per_sample = _per_sample_stage_bytes(profile, strategy, mode, stage)
    return max(0, round(fixed + per_sample * strategy.mbs))


def _per_sample_stage_bytes(profile: ModelProfile, strategy: Strategy, mode: str, stage: int) -> float:
    """Activation bytes per sample of one rank of ``stage`` under model parallelism (Korthikanti Table 2)."""
    recipe = get_recipe(strategy.precision)
    scale = 2 if recipe.activation_precision == "fp32" else 1
    t, cp, p = strategy.tp, strategy.cp, strategy.pp
    measured = profile.activation(recipe.activation_precision, "none").per_sample_bytes
    last = stage == p - 1
    held = in_flight_micro_batches(strategy, stage)
    block, shape = profile.repeated_block, profile.transformer
    if block is None:  # no layers to split: the whole model is one stage's work
        return measured / cp
    layers = block.count
    on_stage = layers_per_stage(layers, p)
    if shape is None or not profile.tokens_per_sample:
        # not a transformer: the measured bytes spread evenly over the blocks, no ends
        if mode == "full":
            full = profile.activation(recipe.activation_precision, "full").per_sample_bytes
            per_layer_input = full / (layers + 1)
            return (on_stage * per_layer_input * held + measured / layers) / cp
        return on_stage * measured / layers * held / cp
    s, h, a = profile.tokens_per_sample, shape.hidden, shape.heads
    formula_layer = shape.layer_bytes_per_token() * s * scale
    ends = max(0.0, measured - layers * formula_layer)
    layer = (measured - ends) / layers
    replicated = layer * shape.replicated_bytes_per_token() / shape.layer_bytes_per_token()
    layer_tp = (replicated / t if strategy.sp else replicated) + (layer - replicated) / t
    if profile.activation_source == "formula" and not strategy.flash and mode == "none":
        layer_tp += ATTENTION_SCORE_COEFF * a * s * s * scale / t
    layer_input = 2 * s * h * scale / (t if strategy.sp else 1)
    if mode == "full":
        per_sample = on_stage * layer_input * held + layer_tp
    else:
        per_sample = on_stage * layer_tp * held
    if last:
        per_sample += ends / t
    return per_sample / cp


def persistent_params(profile: ModelProfile, threshold_elements: int) -> int:
    """Parameters in tensors of at most ``threshold_elements`` elements, which DeepSpeed ZeRO-3 never
    partitions (``partition_parameters.py``: ``param.ds_numel <= param_persistence_threshold``), count.
    Unknown sizes (profiles without ``small_param_counts``) count none."""
    counts = profile.small_param_counts or {}
    return sum(size * n for size, n in counts.items() if size <= threshold_elements)


def buffer_items(profile: ModelProfile, strategy: Strategy, *, stage: int = 0,
                 gpus_per_node: int = 8) -> dict[str, int]:
    """Named communication buffers and gathered working sets of one rank (bytes each).

    DeepSpeed (engine "deepspeed"): ZeRO-0/1/2 one reduce bucket (and an all-gather bucket from ZeRO-1)
    in gradient dtype when there is data parallelism; ZeRO-3 the reduce bucket plus the gathered
    parameters of one repeated block (÷ t) and the prefetch bucket in weight dtype, capped by
    ``stage3_max_live_parameters``, and the unpartitioned tensors under
    ``stage3_param_persistence_threshold``. torch: DDP's gradient buckets (a copy of every gradient), or FSDP's
    unsharded unit + prefetched unit (FULL/HYBRID) and the unit's unsharded gradients. Megatron: its
    gradient buffer is the fp32 main_grad already counted in grads_bytes. Pipeline and context
    parallelism add their send/receive tensors.
    """
    recipe = get_recipe(strategy.precision)
    items: dict[str, int] = {}
    dpcp = strategy.dp * strategy.cp
    psi_train = stage_params(profile, strategy, stage) * (
        profile.trainable_params / profile.params if profile.params else 0.0)
    block = profile.repeated_block
    unit = (block.params_per_block if block else profile.params) / strategy.tp
    if strategy.engine == "deepspeed" and (dpcp > 1 or strategy.zero > 0):
        buckets = deepspeed_buckets(profile)
        items["deepspeed_reduce_bucket"] = round(min(buckets.reduce_bucket_size, psi_train) * recipe.grad_bytes)
        if strategy.zero in (1, 2):
            items["deepspeed_allgather_bucket"] = round(
                min(buckets.allgather_bucket_size, profile.params) * recipe.weight_bytes)
        if strategy.zero == 3:
            live = min(unit + buckets.stage3_prefetch_bucket_size, buckets.stage3_max_live_parameters,
                       profile.params)
            items["zero3_working_set"] = round(live * (recipe.weight_bytes + _fp8_cache_bytes(recipe)))
            persistent = persistent_params(profile, buckets.stage3_param_persistence_threshold)
            shard = placement(strategy, gpus_per_node).shard.ranks
            # kept whole on every rank; the sharded states already count 1/shard of them
            items["zero3_persistent_params"] = round(persistent * recipe.weight_bytes * (1 - 1 / shard))
    elif strategy.engine == "torch" and dpcp > 1:
        if strategy.fsdp == "none":
            items["ddp_gradient_buckets"] = round(psi_train * recipe.grad_bytes)
        else:
            if strategy.fsdp in ("full", "hybrid"):
                items["fsdp_unsharded_units"] = round(2 * unit * (recipe.weight_bytes + _fp8_cache_bytes(recipe)))
            items["fsdp_reduce_scatter_unit"] = round(unit * recipe.grad_bytes)
    if strategy.pp > 1 or strategy.cp > 1:
        scale = 2 if recipe.activation_precision == "fp32" else 1
        seq = profile.tokens_per_sample or 1
        width = profile.transformer.hidden if profile.transformer else 0
        hidden_bytes = strategy.mbs * seq * width * scale / strategy.cp / (strategy.tp if strategy.sp else 1)
        if strategy.pp > 1:
            items["pipeline_p2p"] = round(2 * hidden_bytes)  # one send and one receive tensor
        if strategy.cp > 1 and profile.transformer is not None:
            shape = profile.transformer
            kv_dim = shape.hidden * (shape.kv_heads or shape.heads) // shape.heads
            chunk = strategy.mbs * seq / strategy.cp * kv_dim * scale / strategy.tp
            items["cp_kv_ring_buffers"] = round(2 * 2 * chunk)  # K and V, double-buffered
    return {k: v for k, v in items.items() if v > 0}


def buffer_bytes(profile: ModelProfile, strategy: Strategy, *, stage: int = 0) -> int:
    """Total of :func:`buffer_items` (bytes)."""
    return sum(buffer_items(profile, strategy, stage=stage).values())


DEEPSPEED_STEP_FLATTEN_BYTES = 8
"""DeepSpeed ZeRO-0 with 16-bit weights (FP16_Optimizer, also used for bf16 as DDP_BFLOAT16) converts every
gradient to fp32 and flattens the copies at ``step()`` (deepspeed/runtime/fp16/fused_optimizer.py,
``FP16_Optimizer.step``: ``_flatten_dense_tensors([p.grad.to(fp32) ...])``): 4 bytes/param of copies plus
4 of the flat buffer live at once, after the activations are freed. Bytes per trainable parameter."""


def _deepspeed_flattens(strategy: Strategy) -> bool:
    recipe = get_recipe(strategy.precision)
    return (strategy.engine == "deepspeed" and strategy.zero == 0 and recipe.weight_bytes == 2
            and recipe.master_bytes > 0)


def optimizer_step_scratch_bytes(profile: ModelProfile, strategy: Strategy, *, stage: int = 0,
                                 gpus_per_node: int = 8, adam_impl: AdamImpl | None = None,
                                 device: DeviceKind = "cuda") -> int:
    """Transient bytes the optimizer step allocates on the device, after backward (bytes).

    DeepSpeed ZeRO-0 with 16-bit weights: the fp32 gradient flattening (DEEPSPEED_STEP_FLATTEN_BYTES per
    parameter; its FusedAdam then updates in place). AdamW otherwise, over this rank's (sharded)
    parameter tensors: nothing for fused kernels (DeepSpeed, Megatron), Σ n_i · moment bytes for torch's
    foreach default on CUDA, max(2·n_i + n_{i−1}) · moment bytes for its CPU loop (temporaries.py).
    Offloaded optimizers step on the host: nothing on the device.
    """
    recipe = get_recipe(strategy.precision)
    share = stage_params(profile, strategy, stage) / profile.params if profile.params else 0.0
    trainable = profile.trainable_params * share
    if _deepspeed_flattens(strategy):
        return round(DEEPSPEED_STEP_FLATTEN_BYTES * trainable)
    if strategy.optimizer != "adamw" or strategy.offload_optimizer != "none" or strategy.offload_params != "none":
        return 0
    impl = adam_impl or engine_adam_impl(strategy.engine, device)
    if strategy.shard_stage >= 1:
        share /= placement(strategy, gpus_per_node).shard.ranks
    numels = [round(n * share) for n in profile.param_numels] or [round(profile.trainable_params * share)]
    return adamw_step_temp_bytes(numels, impl, state_bytes=recipe.state_bytes)


def step_peak_extra_bytes(profile: ModelProfile, strategy: Strategy, activations_bytes: int, stage: int = 0,
                          *, gpus_per_node: int = 8, adam_impl: AdamImpl | None = None,
                          device: DeviceKind = "cuda") -> int:
    """What the optimizer step's scratch adds above the backward-pass peak (bytes, >= 0): the step runs
    when the activations are freed and every gradient is alive, so the peak is states + max(activations,
    scratch) (temporaries.optimizer_temp_excess_bytes)."""
    scratch = optimizer_step_scratch_bytes(profile, strategy, stage=stage, gpus_per_node=gpus_per_node,
                                           adam_impl=adam_impl, device=device)
    return optimizer_temp_excess_bytes(activations_bytes, scratch)


def _stage_breakdown(profile: ModelProfile, strategy: Strategy, capacity_bytes: int, gpus_per_node: int,
                     stage: int, adam_impl: AdamImpl | None, device: DeviceKind) -> MemoryBreakdown:
    states = model_states(profile, strategy, stage=stage, gpus_per_node=gpus_per_node)
    acts = activation_bytes(profile, strategy, stage=stage)
    items = buffer_items(profile, strategy, stage=stage, gpus_per_node=gpus_per_node)
    step_extra = step_peak_extra_bytes(profile, strategy, acts, stage, gpus_per_node=gpus_per_node,
                                       adam_impl=adam_impl, device=device)
    if step_extra:
        name = "deepspeed_step_fp32_grad_flatten" if _deepspeed_flattens(strategy) else "optimizer_step_scratch"
        items[name] = step_extra
    if strategy.optimizer == "adamw" and strategy.offload_optimizer == "none":
        impl = adam_impl or engine_adam_impl(strategy.engine, device)
        counters = adam_step_counter_bytes(len(profile.param_numels), impl, device)
        if counters:
            items["adam_step_counters"] = counters
    if profile.buffer_bytes:
        items["model_buffers"] = profile.buffer_bytes
    bufs = sum(items.values())
    allocated = states.params_bytes + states.grads_bytes + states.optimizer_bytes + acts + bufs
    fragmentation = round(FRAGMENTATION_FRACTION * allocated)
    detail = {**items, "cuda_context": CUDA_CONTEXT_BYTES, "fragmentation_margin": fragmentation}
    p = strategy.pp
    if p == 1:
        rank = "every rank"
    elif stage == 0:
        held = in_flight_micro_batches(strategy, 0)
        rank = f"pipeline stage 0 of {p} (embedding, {held:g} micro-batches in flight)"
    else:
        rank = f"pipeline stage {stage} of {p} (output head and loss)"
    ranks_per_node = min(gpus_per_node, strategy.world_size)
    return MemoryBreakdown(
        params_bytes=states.params_bytes, grads_bytes=states.grads_bytes,
        optimizer_bytes=states.optimizer_bytes, activations_bytes=acts, buffers_bytes=bufs,
        overhead_bytes=CUDA_CONTEXT_BYTES + fragmentation, capacity_bytes=capacity_bytes,
        host_bytes=states.host_bytes, nvme_bytes=states.nvme_bytes,
        host_bytes_per_node=states.host_bytes * ranks_per_node, detail_bytes=detail, rank=rank,
    )


def memory_breakdown(profile: ModelProfile, strategy: Strategy, capacity_bytes: int, *,
                     gpus_per_node: int = 8, adam_impl: AdamImpl | None = None,
                     device: DeviceKind = "cuda") -> MemoryBreakdown:
    """Per-GPU memory of ``strategy`` on its worst rank (the first or last pipeline stage), bytes.

    ``adam_impl`` overrides the engine's default AdamW implementation and ``device`` says where the step
    runs ("cpu" for a real CPU step, e.g. the exact-accounting benchmark)."""
    stages = (0,) if strategy.pp == 1 else (0, strategy.pp - 1)
    worst = [_stage_breakdown(profile, strategy, capacity_bytes, gpus_per_node, s, adam_impl, device)
             for s in stages]
    return max(worst, key=lambda m: m.total_bytes)
