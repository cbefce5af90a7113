"""Engine buffers of one rank: communication buckets, gathered working sets and tensors in flight, each in bytes,
with the moments of the step it is alive in (memory.py adds them to the model states and activations).

Sources
- Buffers: DeepSpeed's gradient reduce / all-gather buckets (reduce_bucket_size, allgather_bucket_size
  elements) and, for ZeRO-3, the gathered working set: the parameters reused within
  stage3_max_reuse_distance, one repeated block and the prefetch bucket, capped by
  stage3_max_live_parameters (DeepSpeed ZeRO-3 docs, "stage3_*" parameters); torch DDP's
  gradient buckets (a copy of every gradient unless gradient_as_bucket_view=True, torch DDP docs);
  FSDP's unsharded unit, its prefetched successor and the unit's unsharded gradient for the
  reduce-scatter (FSDP2 ``fully_shard`` docs); pipeline send/receive tensors (s·b·h per direction);
  context-parallel K/V chunks in flight (double-buffered ring, Liu et al. 2023 Ring Attention).
- LoRA under FSDP/ZeRO-3: the frozen base is gathered as held (estimators/finetune.py's formats); fp8 weight caches
  per the recipe (precision.py).
"""

from __future__ import annotations

from optplan.estimators.buckets import deepspeed_buckets
from optplan.estimators.finetune import (
    bnb_kept_input_bytes,
    dequantized_weight_bytes,
    frozen_weight_bytes,
    int8_checkpoint_kept_bytes,
)
from optplan.estimators.fp8_backend import fp8_weight_cache_bytes_per_param
from optplan.estimators.fsdp_grad_sync import (
    accumulated_grad_bytes,
    strategy_reduce_bytes,
    syncs_once_per_step,
)
from optplan.estimators.parallel import layers_per_stage, shard_ranks
from optplan.estimators.params_placement import param_split, stage_params
from optplan.estimators.pipeline_fsdp import keeps_stage_unsharded, unsharded_stage_params_bytes
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import STEP_PHASES, ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.temporaries import DeviceKind


def fp8_cache_bytes(strategy: Strategy) -> float:
    """The fp8 weight copies ``strategy``'s fp8 implementation holds through the step, bytes per parameter
    (estimators/fp8_backend.py: Transformer Engine's W and W^T; none for torchao's Float8Linear)."""
    return fp8_weight_cache_bytes_per_param(strategy)


DEEPSPEED_IPG_BUFFERS = 2
"""Reduce buckets of DeepSpeed ZeRO-1/2 with overlap_comm (stage_1_and_2.py ``setup_buckets``: ``buf_0`` and,
for overlap_comm, ``buf_1``, each reduce_bucket_size elements), count."""


def deepspeed_partitions_grads(strategy: Strategy) -> bool:
    """DeepSpeed ZeRO-1/2 on the device: gradients go to ``grads_in_partition`` (stage 1 as stage 2)."""
    return (strategy.engine == "deepspeed" and strategy.zero in (1, 2) and strategy.offload_optimizer == "none"
            and strategy.offload_params == "none")


DEEPSPEED_ALLREDUCE_ELEMENTS = 500_000_000
"""Elements DeepSpeed's ZeRO-0 gradient all-reduce flattens at a time (``MEMORY_OPT_ALLREDUCE_SIZE`` in
deepspeed/runtime/engine.py: ``allreduce_gradients`` -> ``buffered_allreduce_fallback`` -> ``allreduce_no_retain``),
whatever the config's reduce_bucket_size."""


def deepspeed_frees_grads(strategy: Strategy) -> bool:
    """DeepSpeed ZeRO-0 frees every gradient after each optimizer step (engine.py ``_take_model_step`` ->
    ``zero_grad``: ``param.grad = None``; its 16-bit optimizers ``zero_grad(set_to_none=True)``), so a step of one
    micro-batch has none until its backward makes them; with accumulation the later micro-batches hold them all."""
    return strategy.engine == "deepspeed" and strategy.zero == 0 and strategy.grad_accum == 1


def frozen_base_bytes(profile: ModelProfile, strategy: Strategy) -> float:
    """The whole model's frozen base weights of a LoRA profile (bytes; finetune.frozen_weight_bytes)."""
    assert profile.adapter is not None
    recipe = get_recipe(strategy.precision)
    frozen = max(0, profile.params - profile.trainable_params)
    return frozen_weight_bytes(profile.adapter, frozen, strategy.quant, fp32_base=recipe.compute_dtype == "fp32")


def _mean_gathered_weight_bytes(profile: ModelProfile, strategy: Strategy) -> float:
    """Bytes per parameter of what FSDP/ZeRO-3 gathers for a LoRA model: the frozen base as held (16-bit, or the
    quantised formats of estimators/finetune.py, which FSDP flattens as they are: transformers' FSDP-QLoRA guide,
    ``bnb_4bit_quant_storage``) and the adapters at the recipe's weight bytes, averaged over the parameters."""
    recipe = get_recipe(strategy.precision)
    adapters = profile.trainable_params * recipe.weight_bytes
    return (frozen_base_bytes(profile, strategy) + adapters) / profile.params


def persistent_params(profile: ModelProfile, threshold_elements: int) -> int:
    """Parameters in tensors of at most ``threshold_elements`` elements, which DeepSpeed ZeRO-3 never
    partitions (``partition_parameters.py``: ``param.ds_numel <= param_persistence_threshold``), count.
    Unknown sizes (profiles without ``small_param_counts``) count none."""
    counts = profile.small_param_counts or {}
    return sum(size * n for size, n in counts.items() if size <= threshold_elements)


Moments = frozenset[str] | None
"""The moments of the step a buffer is alive in (profile.STEP_PHASES and "optimizer_step"); None: all."""
WHILE_MODEL_RUNS: Moments = frozenset({"forward", "backward", "grads", "stem_grads"})
WHILE_BLOCKS_RUN: Moments = frozenset({"forward", "backward", "grads"})
WHILE_GRADS: Moments = frozenset({"grads", "stem_grads"})
WHILE_BACKWARD: Moments = frozenset({"backward", "grads", "stem_grads"})
THROUGH_BACKWARD: Moments = frozenset(STEP_PHASES)
UNTIL_STEM_GRADS: Moments = frozenset({"forward", "loss", "backward", "grads"})
BEFORE_GRADS: Moments = frozenset({"forward", "loss", "backward"})
AT_OPTIMIZER_STEP: Moments = frozenset({"optimizer_step"})
AT_BACKWARD_END: Moments = frozenset({"backward_end"})
"""After the last gradient, the activations freed, before the optimizer step (memory.py adds this moment)."""


def buffer_items(profile: ModelProfile, strategy: Strategy, *, stage: int = 0,
                 gpus_per_node: int = 8) -> dict[str, int]:
    """Named communication buffers and gathered working sets of one rank (bytes each; not all alive at
    once: :func:`buffer_moments` says when).

    DeepSpeed (engine "deepspeed"): ZeRO-0 the flat copy of the gradients its all-reduce makes at the end of
    backward (up to :data:`DEEPSPEED_ALLREDUCE_ELEMENTS`, at every world size); ZeRO-1/2 two reduce buckets (overlap_comm) while gradients are reduced; ZeRO-3 the reduce
    bucket plus the parameters it keeps gathered (:func:`zero3_gathered_params`) in weight dtype, its in-flight
    all-gather (:func:`zero3_prefetch_params`), and the unpartitioned tensors under
    ``stage3_param_persistence_threshold``. torch: DDP's gradient buckets (a copy of every gradient), or
    FSDP's gathered parameters (FULL/HYBRID: the root unit while the model runs, one block unit while the blocks
    run and the next one prefetched in the forward and in the blocks' backward after the first gradient: at the
    start of backward, the head's, only the last block's is gathered, measured by benchmarks/fidelity_train.py on
    torch 2.13, fsdp-full fp32 without recomputation; SHARD_GRAD_OP: the whole model) and one unit's reduce-scatter input (in the reduce dtype:
    fsdp_grad_sync.fsdp_reduce_bytes; FSDP2 keeps the last one alive until the next unit reduces:
    ``FSDPCommContext.reduce_scatter_states``, torch 2.13 ``_fsdp_param_group.post_backward``); HSDP with
    more than one replica also keeps every block unit's all-reduce output (reduce dtype) until the end of backward
    (``FSDPParamGroup._all_reduce_state``, cleared in ``finalize_backward``); FSDP that reduces once per step (``fsdp_grad_sync="step"``, fsdp_grad_sync.py) holds the stage's
    unsharded accumulated gradients through the micro-batches. Megatron: its gradient buffer is the
    fp32 main_grad already counted in grads_bytes. Pipeline and context parallelism add their send/receive
    tensors.
    """
    return {k: v for k, (v, _) in buffers_with_moments(profile, strategy, stage, gpus_per_node).items()}


def buffer_moments(profile: ModelProfile, strategy: Strategy, *, stage: int = 0,
                   gpus_per_node: int = 8) -> dict[str, Moments]:
    """When each of :func:`buffer_items` is alive: a set of moments, or None for the whole step."""
    return {k: m for k, (_, m) in buffers_with_moments(profile, strategy, stage, gpus_per_node).items()}


def buffers_with_moments(profile: ModelProfile, strategy: Strategy, stage: int,
                         gpus_per_node: int) -> dict[str, tuple[int, Moments]]:
    recipe = get_recipe(strategy.precision)
    items: dict[str, tuple[int, Moments]] = {}
    dpcp = strategy.dp * strategy.cp
    psi_train = stage_params(profile, strategy, stage) * (
        profile.trainable_params / profile.params if profile.params else 0.0)
    block = profile.repeated_block
    unit = (block.params_per_block if block else profile.params) / strategy.tp
    weight = recipe.weight_bytes + fp8_cache_bytes(strategy)
    trainable_share = 1.0
    if profile.adapter is not None and profile.params:
        # a LoRA model gathers mostly frozen (16-bit or quantised) weights and reduces the adapters' gradients only
        weight = _mean_gathered_weight_bytes(profile, strategy)
        trainable_share = profile.trainable_params / profile.params
    if strategy.engine == "deepspeed":
        buckets = deepspeed_buckets(profile)
        # ZeRO 1-3 allocate whole reduce buckets (torch.empty(reduce_bucket_size)). ZeRO-0 flattens the gradients
        # at the end of backward, up to DEEPSPEED_ALLREDUCE_ELEMENTS at a time whatever reduce_bucket_size says,
        # at world size 1 too (engine.allreduce_gradients -> buffered_allreduce_fallback runs for every world size:
        # measured on the CPU probe, examples/mlp.py fp32 ZeRO-0 at 1 process, +1 flat fp32 gradient), with the
        # activations freed: its own moment, backward_end (memory.py)
        if deepspeed_partitions_grads(strategy):
            bucket = buckets.reduce_bucket_size * recipe.grad_bytes
            items["deepspeed_reduce_buckets"] = (round(DEEPSPEED_IPG_BUFFERS * bucket), WHILE_GRADS)
        elif strategy.zero == 0:
            bucket = min(DEEPSPEED_ALLREDUCE_ELEMENTS, psi_train) * recipe.grad_bytes
            items["deepspeed_reduce_bucket"] = (round(bucket), AT_BACKWARD_END)
        else:
            items["deepspeed_reduce_bucket"] = (round(buckets.reduce_bucket_size * recipe.grad_bytes), None)
        if strategy.zero == 3:
            live = zero3_gathered_params(profile, strategy)
            # released by the end of backward: not alive at the optimizer step (measured, fidelity_train.py)
            items["zero3_working_set"] = (round(live * weight), THROUGH_BACKWARD)
            inflight, moments = zero3_prefetch_params(profile, strategy)
            items["zero3_prefetch_buffer"] = (round(inflight * weight), moments)
            persistent = persistent_params(profile, buckets.stage3_param_persistence_threshold)
            shard = shard_ranks(strategy, gpus_per_node)
            # kept whole on every rank; the sharded states already count 1/shard of them
            items["zero3_persistent_params"] = (round(persistent * recipe.weight_bytes * (1 - 1 / shard)), None)
    elif strategy.engine == "torch" and (dpcp > 1 or strategy.fsdp != "none"):
        reduce_bytes, low = strategy_reduce_bytes(strategy), strategy.fsdp_reduce_dtype
        # FSDP gathers into its own unsharded buffers at world size 1 too (measured by the CPU probe:
        # examples/mlp.py fp32 SHARD_GRAD_OP on one process holds an unsharded copy of every parameter;
        # -19 % before, +2.4 % now, FULL_SHARD +2.6 %: half a unit's gradient over, kept on the safe side)
        if strategy.fsdp == "none":
            items["ddp_gradient_buckets"] = (round(psi_train * recipe.grad_bytes), None)
        elif keeps_stage_unsharded(strategy):  # pipelined: gathered across micro-batches (pipeline_fsdp.py)
            psi_stage = stage_params(profile, strategy, stage)
            items["fsdp_pipeline_unsharded_params"] = (unsharded_stage_params_bytes(psi_stage, weight),
                                                       THROUGH_BACKWARD)
            items["fsdp_pipeline_accumulated_grads"] = (
                accumulated_grad_bytes(psi_stage, trainable_share, strategy.precision, low), WHILE_BACKWARD)
            reduced = unit * trainable_share if block else psi_train
            items["fsdp_reduce_scatter_unit"] = (round(reduced * reduce_bytes), WHILE_GRADS)
        else:
            root = _root_unit_params(profile, strategy, stage)  # the whole stage without repeated blocks
            blocks = stage_params(profile, strategy, stage) - root
            if strategy.fsdp in ("full", "hybrid"):
                if root:
                    items["fsdp_root_unit"] = (round(root * weight), WHILE_MODEL_RUNS)
                if block:
                    items["fsdp_unsharded_units"] = (round(unit * weight), WHILE_BLOCKS_RUN)
                    items["fsdp_prefetched_unit"] = (round(unit * weight), frozenset({"forward", "grads"}))
            else:  # SHARD_GRAD_OP: every unit gathered from its forward to its backward, which reshards it
                items["fsdp_unsharded_params"] = (round(root * weight), THROUGH_BACKWARD)
                items["fsdp_unsharded_block_params"] = (round(blocks * weight), UNTIL_STEM_GRADS)
            reduced = unit * trainable_share if block else psi_train
            items["fsdp_reduce_scatter_unit"] = (round(reduced * reduce_bytes), WHILE_GRADS)
            if syncs_once_per_step(strategy):  # the micro-batches before the last keep their gradients unsharded
                # the last backward moves each block unit's into its reduce-scatter input (fsdp_reduce_scatter_unit)
                # and frees it: one unit fewer while the blocks' gradients are reduced, none by the stem's backward
                moved = min(blocks, unit if block else 0.0)
                items["fsdp_accumulated_grads"] = (
                    accumulated_grad_bytes(blocks - moved, trainable_share, strategy.precision, low), UNTIL_STEM_GRADS)
                items["fsdp_accumulated_unit_grads"] = (
                    accumulated_grad_bytes(moved, trainable_share, strategy.precision, low), BEFORE_GRADS)
                items["fsdp_accumulated_root_grads"] = (
                    accumulated_grad_bytes(root, trainable_share, strategy.precision, low), THROUGH_BACKWARD)
            shard = shard_ranks(strategy, gpus_per_node)
            if strategy.fsdp == "hybrid" and block and dpcp > shard:
                items["hsdp_all_reduce_outputs"] = (round(blocks / shard * reduce_bytes), WHILE_GRADS)
    dequantized = dequantized_weight_bytes(profile.adapter, strategy.quant)
    if dequantized:
        # made while a quantised block layer computes (forward on GPUs, the input gradient in backward): not while
        # the unquantised head and loss run, where the step's peak may be
        items["bnb_dequantized_weight"] = (dequantized, frozenset({"forward", "grads"}))
    shape = profile.transformer
    adapter = profile.adapter
    ckpt = strategy.checkpointing == "full"
    kept_phases = frozenset({"forward", "loss", "backward", "grads"})
    if adapter is not None and adapter.quant_input_elements and block is not None:
        kept = bnb_kept_input_bytes(adapter, strategy.quant, checkpointing=ckpt, tokens=profile.tokens_per_sample or 1,
                                    micro_batch=strategy.mbs, layers=layers_per_stage(block.count, strategy.pp),
                                    tp=strategy.tp)
        name = "bnb_int8_checkpoint_inputs" if strategy.quant == "int8" and ckpt else "bnb_kept_inputs"
        items[name] = (kept, kept_phases)
    elif strategy.quant == "int8" and ckpt and shape is not None and block is not None:
        # a profile from before the quantised layers' inputs were measured: the transformer block's four inputs
        layers = layers_per_stage(block.count, strategy.pp)
        kept = int8_checkpoint_kept_bytes(shape.hidden // strategy.tp, (shape.ffn or 4 * shape.hidden) // strategy.tp,
                                          layers, profile.tokens_per_sample or 1, strategy.mbs)
        items["bnb_int8_checkpoint_inputs"] = (kept, kept_phases)
    moe = profile.transformer.moe if profile.transformer is not None else None
    if moe is not None and strategy.ep > 1:
        # the all-to-all's receive buffer of one MoE layer: the token copies routed here (Megatron-Core
        # MoEAlltoAllTokenDispatcher; the send side is the permuted copies the activations count), the busiest
        # rank's share by the stated imbalance
        scale = 2 if recipe.activation_precision == "fp32" else 1
        tokens = strategy.mbs * (profile.tokens_per_sample or 1) / strategy.cp / (strategy.tp if strategy.sp else 1)
        received = tokens * moe.topk * profile.transformer.hidden * 2 * scale * moe.imbalance  # type: ignore[union-attr]
        items["moe_all_to_all_receive"] = (round(received), frozenset({"forward", "backward", "grads"}))
    if strategy.pp > 1 or strategy.cp > 1:
        scale = 2 if recipe.activation_precision == "fp32" else 1
        seq = profile.tokens_per_sample or 1
        width = profile.transformer.hidden if profile.transformer else 0
        hidden_bytes = strategy.mbs * seq * width * scale / strategy.cp / (strategy.tp if strategy.sp else 1)
        if strategy.pp > 1:
            items["pipeline_p2p"] = (round(2 * hidden_bytes), None)  # one send and one receive tensor
        if strategy.cp > 1 and profile.transformer is not None:
            shape = profile.transformer
            kv_dim = shape.hidden * (shape.kv_heads or shape.heads) // shape.heads
            chunk = strategy.mbs * seq / strategy.cp * kv_dim * scale / strategy.tp
            items["cp_kv_ring_buffers"] = (round(2 * 2 * chunk), None)  # K and V, double-buffered
    return {k: v for k, v in items.items() if v[0] > 0}


def zero3_gathered_params(profile: ModelProfile, strategy: Strategy) -> float:
    """Parameters DeepSpeed ZeRO-3 holds gathered on one rank at the start of backward (count).

    A parameter is released after its forward unless it is used again within ``stage3_max_reuse_distance``
    fetched elements (partitioned_param_coordinator.py); between a block's forward and its backward come
    the forward and the backward of every later block, twice their parameters, so the last
    ``reuse_distance / 2`` parameters of the model stay gathered (the whole model below ~0.5e9
    parameters with DeepSpeed's default of 1e9), plus the block in use and the prefetch bucket, capped by
    ``stage3_max_live_parameters``."""
    buckets = deepspeed_buckets(profile)
    block = profile.repeated_block
    unit = (block.params_per_block if block else profile.params) / strategy.tp
    whole = stage_params(profile, strategy)
    kept = min(whole, buckets.stage3_max_reuse_distance / 2)
    return min(kept + unit + buckets.stage3_prefetch_bucket_size, buckets.stage3_max_live_parameters, whole)


def zero3_prefetch_params(profile: ModelProfile, strategy: Strategy) -> tuple[float, Moments]:
    """Elements of DeepSpeed ZeRO-3's in-flight all-gather (count) and when it is alive.

    Parameters are fetched in coalesced buckets of whole parameters up to ``stage3_prefetch_bucket_size``
    elements into one flat buffer (partition_parameters.py ``_all_gather_dtype``), which lives until the
    fetch is waited on while the previous block computes; gathered parameters are copies out of it. Here
    one bucket (the prefetch size rounded up to whole repeated blocks) beyond the first, which is fetched
    before anything computes: none when the model fits in one bucket. It is alive while the model runs;
    when the whole model stays gathered (:func:`zero3_gathered_params`) backward fetches nothing, so only
    in forward."""
    buckets = deepspeed_buckets(profile)
    block = profile.repeated_block
    unit = (block.params_per_block if block else profile.params) / strategy.tp
    whole = stage_params(profile, strategy)
    size = buckets.stage3_prefetch_bucket_size
    bucket = min(whole, -(-size // unit) * unit if unit else size)
    inflight = min(bucket, max(0.0, whole - bucket))  # the next bucket, fetched while the first computes
    kept_whole = buckets.stage3_max_reuse_distance / 2 >= whole
    return inflight, (frozenset({"forward"}) if kept_whole else WHILE_MODEL_RUNS)


def _root_unit_params(profile: ModelProfile, strategy: Strategy, stage: int) -> float:
    """Parameters of one rank outside the repeated blocks (FSDP's root unit: embedding, head, norms), count."""
    split = param_split(profile)
    if not split.layers:
        return stage_params(profile, strategy, stage)
    blocks = (split.layers if strategy.pp == 1 else layers_per_stage(split.layers, strategy.pp)) * split.per_block
    return max(0.0, stage_params(profile, strategy, stage) - blocks / strategy.tp)


def fsdp_root_reduce_items(profile: ModelProfile, strategy: Strategy, stage: int, device: DeviceKind) -> dict[str, int]:
    """What torch FSDP2 (every sharding) holds beside the sharded states at the root unit's reduce-scatter, the last of
    the backward, when the activations are freed (bytes; empty for other engines and layouts): the root's
    unsharded gradients in the weights' dtype, copied into its reduce-scatter input in the reduce dtype
    (fsdp_grad_sync.fsdp_reduce_bytes), both alive until the collective returns (torch 2.13
    ``FSDPParamGroup.post_backward`` -> ``foreach_reduce``); on CPU ranks gloo's ``reduce_scatter_single`` holds a
    copy of its input too. Measured by benchmarks/fidelity_train.py (fsdp-full bf16, the peak's live tensors
    8.13 + 8.13 + 4.06 MiB: input, gloo's copy, bf16 gradients, every sharded gradient already written). A model
    without repeated blocks is one unit, its root."""
    if strategy.engine != "torch" or strategy.fsdp == "none" or keeps_stage_unsharded(strategy):
        return {}
    recipe = get_recipe(strategy.precision)
    root = _root_unit_params(profile, strategy, stage)
    trainable = root * (profile.trainable_params / profile.params if profile.params else 0.0)
    reduced = round(trainable * strategy_reduce_bytes(strategy))
    items = {"fsdp_root_unsharded_grads": round(trainable * recipe.weight_bytes),
             "fsdp_root_reduce_scatter_input": reduced}
    if device == "cpu":
        items["gloo_reduce_scatter_copy"] = reduced
    return {k: v for k, v in items.items() if v > 0}


def buffer_bytes(profile: ModelProfile, strategy: Strategy, *, stage: int = 0) -> int:
    """Total of :func:`buffer_items` (bytes)."""
    return sum(buffer_items(profile, strategy, stage=stage).values())
