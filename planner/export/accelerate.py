"""``accelerate.yaml``: an accelerate config file for a plan (its check by accelerate's own code is ``accelerate_check``).

``render_accelerate_yaml`` is a pure function ``ExportPlan -> text`` (accelerate is not imported);
``optplan.planner.export.accelerate_check.validate_accelerate_yaml`` loads the text with accelerate's config loader and runs accelerate's
launch-argument processing and plugin dataclasses on it, short of starting a process. Key names,
defaults and behaviours follow accelerate 1.15.0:

- ``commands/config/config_args.py`` (``ClusterConfig``, ``load_config_from_file``): the top-level
  keys; unknown top-level keys are refused, nested sections (``fsdp_config``, ``deepspeed_config``,
  ``megatron_lm_config``, ``parallelism_config``, ``fp8_config``) are not checked at all.
- ``commands/config/cluster.py`` (``get_cluster_input``): which keys ``accelerate config`` writes for
  each distributed type (and ``'NO'`` quoted: a bare ``NO`` is a YAML 1.1 boolean).
- ``commands/launch.py`` (``launch_command_parser``, ``_validate_launch_command``): every nested key
  is copied onto the launch arguments (``fsdp_config`` and ``fp8_config`` keys gain an ``fsdp_`` /
  ``fp8_`` prefix when they lack one) and only the arguments the parser defines are ever read, so a
  misspelt nested key is silently ignored by accelerate; the validator refuses it.
- ``utils/launch.py`` (``prepare_multi_gpu_env``, ``prepare_deepspeed_cmd_env``,
  ``prepare_simple_launcher_cmd_env``): the environment variables the launched processes read.
  Multi-node torchrun launches use ``rdzv_endpoint = main_process_ip:main_process_port`` when
  ``same_network`` is false; a DeepSpeed multi-node launch with the ``standard`` launcher does the
  same, with the ``pdsh`` launcher it runs ``deepspeed --hostfile`` once, on the first host.
- ``utils/dataclasses.py`` (``FullyShardedDataParallelPlugin``, ``DeepSpeedPlugin``,
  ``MegatronLMPlugin``) and ``parallelism_config.py`` (``ParallelismConfig``): how those variables
  become the run's settings. Facts the exporter relies on:

  * FSDP2 takes ``fsdp_reshard_after_forward`` as a bool (true = FULL_SHARD, false = SHARD_GRAD_OP);
    FSDP1 takes its sharding from ``fsdp_sharding_strategy`` (launch always exports
    ``FSDP_SHARDING_STRATEGY``, default FULL_SHARD, and the FSDP1 plugin prefers it to
    ``fsdp_reshard_after_forward``), so FSDP1 files state both.
  * HSDP under FSDP2 is ``parallelism_config`` with ``dp_replicate_size`` (replicas, one per node) x
    ``dp_shard_size`` (GPUs per node); tensor and context parallelism on the torch engine are
    ``tp_size``/``cp_size`` there too, which needs FSDP2 (TP alone also runs under MULTI_GPU;
    ``ParallelismConfig`` refuses TP/CP next to pure replication, and the Accelerator refuses FSDP2
    with nothing to shard).
  * With ``deepspeed_config_file``, ``DeepSpeedPlugin._deepspeed_config_checks`` refuses
    ``mixed_precision``, ``gradient_accumulation_steps``, ``zero_stage``, offload and clipping keys in
    the accelerate file: they live in ds_config.json.
  * ``MegatronLMPlugin`` always passes ``recompute_granularity`` (default full), ``recompute_method``
    (uniform) and ``recompute_num_layers`` (1) to Megatron-LM, so activations are always recomputed
    and selective recompute is refused by Megatron-core (recompute_num_layers must be None); its
    ``context_parallel_size`` defaults to 2 when the variable is unset, so the file always states it.
  * Gradient accumulation has no key outside ``deepspeed_config``/``megatron_lm_config``: the
    training script passes ``Accelerator(gradient_accumulation_steps=N)`` (or the environment sets
    ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``).

Plans accelerate cannot run as planned raise ``NotExportable`` with one line naming the fix: pipeline
parallelism outside Megatron-LM, tensor/context parallelism on the DeepSpeed engine or under FSDP1,
DDP composed with TP, context parallelism without FSDP, Megatron plans with interleaved pipelines,
without full recompute or in an autocast/pure/fp8 precision, DeepSpeed plans whose ds_config.json
the DeepSpeed exporter refuses, and torch plans without FSDP in the ``bf16``/``fp16`` recipes (16-bit weights with
fp32 masters: accelerate's ``mixed_precision`` is autocast there, ``context.refuse_autocast_for_16bit_weights``).
"""

from __future__ import annotations

import shlex
import textwrap
from dataclasses import dataclass
from typing import Any

import yaml

from optplan.estimators.errors import OptplanError
from optplan.estimators.fsdp_grad_sync import fsdp_reduce_bytes
from optplan.estimators.strategy import Strategy
from optplan.planner.export.context import (
    ASYNC_TP_HOWTO,
    FILE_NAMES,
    SELECTIVE_CHECKPOINTING_HOWTO,
    ExportPlan,
    NotExportable,
    refuse_autocast_for_16bit_weights,
)

ACCELERATE_VERSION = "1.15.0"
"""The accelerate release whose key names and behaviours this module follows."""
DEFAULT_MAIN_PROCESS_PORT = 29500
"""accelerate's default rendezvous port (``utils/launch.py``, ``prepare_multi_gpu_env``)."""
MAIN_PROCESS_IP_PLACEHOLDER = "MAIN_NODE_IP"
"""Written as ``main_process_ip`` of multi-node files unless an address is given: replace it, or pass
``--main_process_ip`` on every node (command-line flags win over the file)."""
DEEPSPEED_LAUNCHERS = ("standard", "pdsh")
"""DeepSpeed multi-node launchers the exporter writes (``DEEPSPEED_MULTINODE_LAUNCHERS`` in
``accelerate/utils/constants.py``): ``standard`` (the default) runs torchrun on every node, like the
other distributed types, so the file needs nothing else; ``pdsh`` runs ``deepspeed --hostfile`` once,
on the first host, and needs the hostfile and passwordless ssh between the nodes."""
COMMENT_WIDTH = 100
"""Comment lines are wrapped at this many characters."""
MIN_WRAP_PARAMS = 1_000_000
"""Floor of ``fsdp_min_num_params`` when the exporter has to wrap by size."""
FP8_BACKEND = "TE"
"""The fp8 backend written for fp8 plans (Transformer Engine: accelerate swaps nn.Linear for te.Linear)."""
SELECTIVE_NOTE = SELECTIVE_CHECKPOINTING_HOWTO

_MIXED_PRECISION = {
    "fp32": "no", "amp-bf16": "bf16", "bf16": "bf16", "bf16-pure": "bf16",
    "amp-fp16": "fp16", "fp16": "fp16", "fp8": "fp8",
}
"""Plan precision -> accelerate ``mixed_precision`` (``PrecisionType`` in ``utils/dataclasses.py``)."""
_FSDP1_STRATEGY = {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD_OP", "hybrid": "HYBRID_SHARD"}
_MEGATRON_PRECISIONS = ("fp32", "bf16", "fp16")
_TOP_LEVEL_ORDER = (
    "compute_environment", "debug", "deepspeed_config", "distributed_type", "downcast_bf16", "dynamo_config",
    "enable_cpu_affinity", "fp8_config", "fsdp_config", "gpu_ids", "machine_rank", "main_process_ip",
    "main_process_port", "main_training_function", "megatron_lm_config", "mixed_precision", "num_machines",
    "num_processes", "parallelism_config", "rdzv_backend", "same_network", "use_cpu",
)
"""Alphabetical, as ``ClusterConfig.to_yaml_file`` (``yaml.safe_dump``) writes them."""


# ----------------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """How a plan maps onto accelerate: the distributed type and the process-group sizes."""

    distributed_type: str
    fsdp_version: int | None = None
    sharding: str | None = None  # "full" | "grad_op" | "hybrid" as the file expresses it
    dp_replicate: int = 1
    dp_shard: int = 1
    parallelism: bool = False  # write a parallelism_config section


def _degrees(strategy: Strategy) -> str:
    return ", ".join(f"{name}={getattr(strategy, name)}" for name in ("tp", "pp", "cp") if getattr(strategy, name) > 1)


def _check_nodes(plan: ExportPlan) -> None:
    if plan.multi_node and plan.world_size % plan.gpus_per_node:
        raise NotExportable(
            f"the plan uses {plan.world_size} GPUs, not a whole number of {plan.gpus_per_node}-GPU nodes "
            "(accelerate starts num_processes / num_machines processes on every node): re-plan with a GPU "
            "count that fills whole nodes"
        )


def _deepspeed_layout(plan: ExportPlan) -> _Layout:
    strategy = plan.strategy
    if strategy.pp > 1 or strategy.tp > 1 or strategy.cp > 1:
        raise NotExportable(
            f"accelerate's DeepSpeed plugin runs ZeRO data parallelism from ds_config.json, and this plan uses "
            f"{_degrees(strategy)}: launch it with Megatron-DeepSpeed arguments, or plan with --tp 1 --pp 1 --cp 1"
        )
    from optplan.planner.export.deepspeed import render_ds_config  # light: deepspeed is not imported

    try:
        render_ds_config(strategy, plan.buckets)  # accelerate.yaml points at ds_config.json: it must exist
    except OptplanError as exc:
        raise NotExportable(f"accelerate.yaml needs ds_config.json, which cannot be written: {exc}") from exc
    return _Layout("DEEPSPEED")


def _megatron_layout(plan: ExportPlan) -> _Layout:
    strategy = plan.strategy
    if plan.transformer is not None and (plan.transformer.moe is not None or plan.transformer.mla is not None):
        raise NotExportable(
            "accelerate's Megatron-LM plugin has no keys for experts, expert parallelism or latent attention "
            "(MegatronLMPlugin builds a dense GPT): launch it with Megatron-LM's launch.sh"
        )
    if strategy.vpp > 1:
        raise NotExportable(
            f"accelerate's Megatron-LM plugin has no launch key for interleaved pipelines (vpp={strategy.vpp}; "
            "MegatronLMPlugin.num_layers_per_virtual_pipeline_stage is set in code only): launch it with "
            "Megatron-LM's launch.sh, or plan with --vpp 1"
        )
    if strategy.checkpointing != "full":
        raise NotExportable(
            f"accelerate {ACCELERATE_VERSION}'s Megatron-LM plugin always passes recompute_granularity/"
            "recompute_method/recompute_num_layers (full recompute by default; Megatron-core refuses selective "
            f"recompute with recompute_num_layers set), so checkpointing={strategy.checkpointing} cannot run as "
            "planned: plan with --checkpointing full, or launch with Megatron-LM's launch.sh"
        )
    if strategy.comm_overlap:
        raise NotExportable(
            "accelerate's Megatron-LM plugin has no keys for Megatron's tensor/data-parallel communication overlap "
            "(--tp-comm-overlap, --overlap-grad-reduce, --overlap-param-gather), which this plan's step time counts "
            "on: launch it with Megatron-LM's launch.sh"
        )
    if strategy.precision not in _MEGATRON_PRECISIONS:
        raise NotExportable(
            f"accelerate's Megatron-LM plugin knows bf16, fp16 and fp32 only (MegatronLMPlugin."
            f"set_mixed_precision), not {strategy.precision}: plan with --precision bf16, or launch with "
            "Megatron-LM's launch.sh"
        )
    return _Layout("MEGATRON_LM")


def _torch_layout(plan: ExportPlan, fsdp_version: int) -> _Layout:
    strategy = plan.strategy
    if strategy.pp > 1:
        raise NotExportable(
            f"accelerate runs pipeline parallelism only through its Megatron-LM plugin, and this plan uses "
            f"pp={strategy.pp} on the torch engine: launch it with Megatron-LM's launch.sh (plan with --engine "
            "megatron), or plan with --pp 1"
        )
    model_parallel = strategy.tp > 1 or strategy.cp > 1
    if strategy.fsdp == "none":
        refuse_autocast_for_16bit_weights(plan, f"accelerate's mixed_precision: {_MIXED_PRECISION[strategy.precision]}")
        if strategy.cp > 1:
            raise NotExportable(
                f"accelerate's context parallelism needs FSDP2 (Accelerator.maybe_context_parallel), and this "
                f"plan has cp={strategy.cp} without FSDP: plan with --fsdp full, or launch with Megatron-LM's "
                "launch.sh"
            )
        if strategy.tp > 1 and strategy.dp > 1:
            raise NotExportable(
                f"accelerate cannot compose DDP with tensor parallelism (ParallelismConfig refuses "
                f"dp_replicate_size={strategy.dp} with dp_shard_size=1 and tp_size={strategy.tp}): plan with "
                "--fsdp full, or launch with Megatron-LM's launch.sh"
            )
        if strategy.tp > 1:
            return _Layout("MULTI_GPU", parallelism=True)
        return _Layout("NO" if plan.world_size == 1 else "MULTI_GPU")

    if model_parallel and fsdp_version != 2:
        raise NotExportable(
            f"tensor/context parallelism under accelerate needs FSDP2's parallelism_config, and this plan uses "
            f"{_degrees(strategy)}: export with fsdp_version=2"
        )
    sharding = strategy.fsdp
    if sharding == "hybrid" and not plan.multi_node:
        sharding = "full"  # one node holds one replica: HSDP is FULL_SHARD
    if not model_parallel:
        if sharding != "hybrid":
            return _Layout("FSDP", fsdp_version=fsdp_version, sharding=sharding)
        if fsdp_version == 1:
            return _Layout("FSDP", fsdp_version=1, sharding="hybrid")
        return _Layout("FSDP", fsdp_version=2, sharding="hybrid", dp_replicate=plan.nodes,
                       dp_shard=plan.procs_per_node, parallelism=True)

    # FSDP2 with TP and/or CP: mesh (dp_replicate, dp_shard, cp, tp), TP and CP innermost (accelerate's
    # ParallelismConfig._get_mesh orders dp_replicate, dp_shard, cp, sp, tp).
    if sharding == "hybrid":
        per_node = plan.procs_per_node // (strategy.tp * strategy.cp)
        if per_node < 1 or strategy.dp % per_node:
            raise NotExportable(
                f"HSDP shards inside a node, but tp x cp = {strategy.tp * strategy.cp} does not divide the "
                f"{plan.procs_per_node} processes of a node into data-parallel shards of the dp={strategy.dp} "
                "replicas: plan with --fsdp full"
            )
        dp_replicate, dp_shard = strategy.dp // per_node, per_node
    else:
        dp_replicate, dp_shard = 1, strategy.dp
    if dp_shard == 1 and strategy.cp == 1:
        raise NotExportable(
            f"FSDP2 needs a data-parallel (dp_shard) or context-parallel dimension to shard across, and this plan "
            f"puts all {plan.world_size} GPUs into tp={strategy.tp} (the Accelerator refuses it): plan with "
            "--fsdp none for pure tensor parallelism, or with dp > 1"
        )
    if dp_replicate > 1 and dp_shard == 1:
        raise NotExportable(
            "accelerate's ParallelismConfig refuses tensor/context parallelism next to pure replication "
            "(dp_replicate_size > 1 with dp_shard_size = 1): plan with --fsdp full"
        )
    return _Layout("FSDP", fsdp_version=2, sharding=sharding, dp_replicate=dp_replicate, dp_shard=dp_shard,
                   parallelism=True)


def _layout(plan: ExportPlan, fsdp_version: int) -> _Layout:
    """The distributed type and group sizes for ``plan``; NotExportable when accelerate cannot run it."""
    _check_nodes(plan)
    engine = plan.strategy.engine
    if engine == "deepspeed":
        return _deepspeed_layout(plan)
    if engine == "megatron":
        return _megatron_layout(plan)
    return _torch_layout(plan, fsdp_version)


def _wrap_class(block_class: str) -> str:
    name = block_class.rsplit(".", 1)[-1].strip()
    if not name.isidentifier():
        raise NotExportable(
            f"the repeated block class {block_class!r} is no Python class name, which "
            "fsdp_transformer_layer_cls_to_wrap needs: re-profile the model, or give the block class by name"
        )
    return name


def _min_wrap_params(plan: ExportPlan) -> int:
    """Size-based wrap threshold: 90% of one transformer block when the shape is known, else 1% of the model.

    A module is wrapped (bottom-up) once its not-yet-wrapped parameters reach the threshold
    (``torch.distributed.fsdp.wrap.size_based_auto_wrap_policy``); 90% of a block wraps whole blocks,
    not their attention or MLP alone.
    """
    shape = plan.transformer
    if shape is not None:
        h, kv, ffn = shape.hidden, shape.kv_dim, shape.ffn or 4 * shape.hidden
        block = 2 * h * h + 2 * h * kv + (3 if shape.gated else 2) * h * ffn
        return max(MIN_WRAP_PARAMS, int(0.9 * block))
    return max(MIN_WRAP_PARAMS, plan.params // 100)


def _reduce_dtype_notes(strategy: Strategy, fsdp_version: int | None) -> list[str]:
    """What the script must do for FSDP to reduce gradients in the plan's dtype (estimators/fsdp_grad_sync.py).

    accelerate's FSDP plugin without a ``mixed_precision_policy`` reduces in the ``mixed_precision`` dtype
    (``FullyShardedDataParallelPlugin.set_mixed_precision``: ``param_dtype = reduce_dtype``, accelerate 1.16), and
    accelerate.yaml has no key for the policy: a plan that reduces in fp32 (``auto`` under bf16, fp16 and fp8, or
    ``fp32``) needs it passed in code; a plan that reduces in the 16-bit dtype runs as accelerate does by default."""
    mixed = _MIXED_PRECISION[strategy.precision]
    low = {"bf16": "bfloat16", "fp8": "bfloat16", "fp16": "float16"}.get(mixed)
    if low is None or fsdp_reduce_bytes(strategy.precision, strategy.fsdp_reduce_dtype) != 4:
        return []
    if strategy.precision in ("amp-bf16", "amp-fp16") and strategy.fsdp_reduce_dtype == "auto":
        param = "float32"  # autocast over fp32 parameters: the plan gathers and reduces in fp32
    else:
        param = low
    buffer = f", 'buffer_dtype': torch.{low}" if fsdp_version == 1 else ""  # FSDP2's policy has none
    return [f"FSDP gradient reduction in fp32, as the plan counts it: Accelerator(fsdp_plugin="
            f"FullyShardedDataParallelPlugin(mixed_precision_policy={{'param_dtype': torch.{param}, "
            f"'reduce_dtype': torch.float32{buffer}}})); accelerate.yaml's mixed_precision alone reduces in {mixed} (set_mixed_precision), half the bytes "
            f"(or plan with --fsdp-reduce-dtype {'fp16' if mixed == 'fp16' else 'bf16'} to price that)"]


def _fsdp_section(plan: ExportPlan, layout: _Layout, notes: dict[str, list[str]]) -> dict[str, Any]:
    strategy = plan.strategy
    section: dict[str, Any] = {
        # accelerate's key wraps every FSDP unit: partial checkpointing is the script's (train.py's) own
        "fsdp_activation_checkpointing": strategy.checkpointing == "full" and strategy.checkpoint_layers is None,
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": strategy.offload_params == "cpu",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_version": layout.fsdp_version,
    }
    if plan.block_class:
        section["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        section["fsdp_transformer_layer_cls_to_wrap"] = _wrap_class(plan.block_class)
    else:
        section["fsdp_auto_wrap_policy"] = "SIZE_BASED_WRAP"
        section["fsdp_min_num_params"] = _min_wrap_params(plan)
        notes["fsdp_config.fsdp_auto_wrap_policy"] = [
            "no repeated block class is known: wrap modules by size (about one transformer block, or 1% "
            "of the model); set TRANSFORMER_BASED_WRAP with fsdp_transformer_layer_cls_to_wrap if you know it",
        ]
    if layout.fsdp_version == 2:
        section["fsdp_reshard_after_forward"] = layout.sharding != "grad_op"
    else:
        strategy_name = _FSDP1_STRATEGY[layout.sharding or "full"]
        section.update(
            fsdp_backward_prefetch="BACKWARD_PRE",
            fsdp_forward_prefetch=False,
            fsdp_reshard_after_forward=strategy_name,
            fsdp_sharding_strategy=strategy_name,
            fsdp_sync_module_states=True,
            fsdp_use_orig_params=True,
        )
        notes["fsdp_config.fsdp_sharding_strategy"] = [
            "FSDP1 reads its sharding from fsdp_sharding_strategy (accelerate always exports it, default "
            "FULL_SHARD); fsdp_reshard_after_forward repeats it",
        ]
        if layout.sharding == "hybrid":
            notes["fsdp_config.fsdp_sharding_strategy"].append(
                "HYBRID_SHARD: FULL_SHARD inside each node (torch groups the GPUs of a node), replicas across nodes")
    if strategy.fsdp == "hybrid" and layout.sharding == "full":
        notes["fsdp_config.fsdp_version"] = ["one node holds a single HSDP replica, so hybrid sharding is FULL_SHARD"]
    if strategy.checkpointing == "full" and strategy.checkpoint_layers is not None:
        notes["fsdp_config.fsdp_activation_checkpointing"] = [
            f"partial checkpointing: accelerate's key would wrap every FSDP unit, so it is off; wrap the first "
            f"{strategy.checkpoint_layers} repeated blocks in torch.utils.checkpoint in the script (train.py does)"]
    elif strategy.checkpointing == "full":
        notes["fsdp_config.fsdp_activation_checkpointing"] = [
            "full activation checkpointing: accelerate wraps every FSDP unit in torch's checkpoint_wrapper"]
    elif strategy.checkpointing == "selective":
        notes["fsdp_config.fsdp_activation_checkpointing"] = [SELECTIVE_NOTE]
    notes["fsdp_config.fsdp_state_dict_type"] = [
        "sharded checkpoints (fast, no rank-0 gather); `accelerate merge-weights` makes one file from them"]
    return dict(sorted(section.items()))


def _parallelism_section(plan: ExportPlan, layout: _Layout, notes: dict[str, list[str]]) -> dict[str, Any]:
    strategy = plan.strategy
    prefix = "parallelism_config_"
    section: dict[str, Any] = {
        prefix + "cp_size": strategy.cp,
        prefix + "dp_replicate_size": layout.dp_replicate,
        prefix + "dp_shard_size": layout.dp_shard,
        prefix + "tp_size": strategy.tp,
    }
    if strategy.cp > 1:
        section[prefix + "cp_comm_strategy"] = "allgather"
    lines = [f"device mesh dp_replicate {layout.dp_replicate} x dp_shard {layout.dp_shard} x cp {strategy.cp} x "
             f"tp {strategy.tp} = {plan.world_size} processes"]
    if layout.sharding == "hybrid":
        lines.append("HSDP: parameters sharded across the GPUs of a node, replicated across nodes")
    if strategy.tp > 1:
        lines.append("tensor parallelism shards the model by its transformers tp_plan: load it with "
                     "from_pretrained(..., tp_plan=\"auto\")")
        if strategy.sp:
            lines.append("sequence parallelism inside the TP group follows the model's tp_plan; this file "
                         "cannot switch it")
        if strategy.async_tp:
            lines.append(f"accelerate has no switch for it: {ASYNC_TP_HOWTO}")
    if strategy.cp > 1:
        lines.append("context parallelism: run forward/backward inside accelerator.maybe_context_parallel(...)")
    notes["parallelism_config"] = lines
    return dict(sorted(section.items()))


def megatron_recompute_keys(checkpoint_layers: int | None, prefix: str = "megatron_lm_") -> dict[str, Any]:
    """Megatron-LM's recompute method for full checkpointing of every block (``uniform``, groups of 1 layer) or of
    the first ``checkpoint_layers`` blocks of each pipeline stage (``block``: --recompute-method block
    --recompute-num-layers N, what launch.sh passes for a partial plan)."""
    if checkpoint_layers is None:
        return {prefix + "recompute_method": "uniform", prefix + "recompute_num_layers": 1}
    return {prefix + "recompute_method": "block", prefix + "recompute_num_layers": checkpoint_layers}


def _megatron_section(plan: ExportPlan, notes: dict[str, list[str]]) -> dict[str, Any]:
    strategy = plan.strategy
    prefix = "megatron_lm_"
    section: dict[str, Any] = {
        prefix + "context_parallel_size": strategy.cp,
        prefix + "gradient_clipping": 1.0,
        prefix + "num_micro_batches": strategy.grad_accum,
        prefix + "pp_degree": strategy.pp,
        prefix + "recompute_granularity": "full",
        # every layer (uniform groups of one), or the first N of each stage (Megatron's block method: partial)
        **megatron_recompute_keys(strategy.checkpoint_layers, prefix),
        prefix + "sequence_parallelism": strategy.sp,
        prefix + "tp_degree": strategy.tp,
        prefix + "use_distributed_optimizer": strategy.zero == 1,
    }
    notes["megatron_lm_config"] = [
        "accelerate's Megatron-LM plugin builds Megatron GPT/BERT/T5/Llama models from a transformers config "
        "(MODEL_CONFIGS_TO_MEGATRON_PARSERS); Megatron-LM must be installed on every node",
        f"num_micro_batches = gradient-accumulation steps ({strategy.grad_accum}); keep "
        "Accelerator(gradient_accumulation_steps=1)",
        "context_parallel_size is always written: MegatronLMPlugin defaults it to 2 when unset",
    ]
    return section


def _deepspeed_section(plan: ExportPlan, ds_config_name: str, launcher: str,
                       notes: dict[str, list[str]]) -> dict[str, Any]:
    section: dict[str, Any] = {
        "deepspeed_config_file": ds_config_name,
        "zero3_init_flag": plan.strategy.zero == 3,
    }
    if plan.multi_node:
        section["deepspeed_multinode_launcher"] = launcher
        if launcher == "pdsh":
            section["deepspeed_hostfile"] = FILE_NAMES["hostfile"]
    lines = [f"precision, batch sizes, ZeRO stage and offload live in {ds_config_name}; accelerate refuses "
             "mixed_precision, gradient_accumulation_steps, zero_stage and offload keys next to "
             "deepspeed_config_file (DeepSpeedPlugin._deepspeed_config_checks)"]
    if plan.strategy.zero == 3:
        lines.append("zero3_init_flag: the model is built under deepspeed.zero.Init (partitioned at creation)")
    if plan.multi_node and launcher == "pdsh":
        lines.append(f"pdsh launcher: one `accelerate launch` on the first host of {FILE_NAMES['hostfile']} "
                     "('host slots=N' per node) starts every node over passwordless ssh")
    notes["deepspeed_config"] = lines
    return dict(sorted(section.items()))


def _scalar(value: Any) -> str:
    """One YAML scalar, quoted where YAML would read it as something else (``'NO'``, ``'no'``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = yaml.safe_dump(str(value), default_flow_style=True, width=1_000_000, allow_unicode=False)
    text = text.strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    return text


def _comment(text: str, indent: str = "", *, wrap: bool = True) -> list[str]:
    """YAML comment lines for ``text`` (control characters flattened; wrapped at ``COMMENT_WIDTH``)."""
    flat = "".join(ch if ch.isprintable() else " " for ch in text).rstrip()
    if not wrap:
        return [f"{indent}# {flat}".rstrip()]
    width = max(40, COMMENT_WIDTH - len(indent) - 2)
    body = textwrap.wrap(" ".join(flat.split()), width=width, subsequent_indent="  ",
                         break_long_words=False, break_on_hyphens=False) or [""]
    return [f"{indent}# {line}".rstrip() for line in body]


def _emit(config: dict[str, Any], notes: dict[str, list[str]]) -> list[str]:
    lines: list[str] = []
    for key in _TOP_LEVEL_ORDER:
        if key not in config:
            continue
        value = config[key]
        for note in notes.get(key, ()):
            lines.extend(_comment(note))
        if isinstance(value, dict):
            lines.append(f"{key}:")
            for sub, sub_value in value.items():
                for note in notes.get(f"{key}.{sub}", ()):
                    lines.extend(_comment(note, "  "))
                lines.append(f"  {sub}: {_scalar(sub_value)}")
        else:
            lines.append(f"{key}: {_scalar(value)}")
    return lines


def render_accelerate_yaml(plan: ExportPlan, *, fsdp_version: int = 2, ds_config_name: str = "ds_config.json",
                           train_script: str = "train.py", main_process_ip: str | None = None,
                           main_process_port: int = DEFAULT_MAIN_PROCESS_PORT,
                           deepspeed_multinode_launcher: str = "standard") -> str:
    """The ``accelerate.yaml`` text for ``plan`` (``accelerate launch --config_file accelerate.yaml train.py``).

    ``fsdp_version`` (1 or 2) picks the FSDP keys for torch-engine FSDP plans; ``ds_config_name`` is the
    DeepSpeed config the file points at (resolved from the launch directory). ``train_script`` appears
    in the launch command of the header only. Multi-node torchrun launches name ``main_process_ip``
    (default: the ``MAIN_NODE_IP`` placeholder, overridden per node with ``--main_process_ip``);
    DeepSpeed multi-node plans use ``deepspeed_multinode_launcher`` (``standard``: torchrun on every
    node; ``pdsh``: ``deepspeed --hostfile hostfile`` launched once, on the first host). The text starts with comment lines naming optplan, the
    plan's label and the launch command, and ends with a newline.

    Raises NotExportable (one line naming the fix) for plans accelerate 1.15.0 cannot run as planned
    (see the module docstring) and for bad arguments.
    """
    if fsdp_version not in (1, 2) or isinstance(fsdp_version, bool):
        raise NotExportable(f"fsdp_version must be 1 or 2 (got {fsdp_version!r}): accelerate knows FSDP1 and FSDP2")
    if deepspeed_multinode_launcher not in DEEPSPEED_LAUNCHERS:
        raise NotExportable(f"deepspeed_multinode_launcher must be one of {', '.join(DEEPSPEED_LAUNCHERS)} "
                            f"(got {deepspeed_multinode_launcher!r})")
    for label, text in (("ds_config name", ds_config_name), ("training script", train_script)):
        if not isinstance(text, str) or not text.strip():
            raise NotExportable(f"{label} must be a non-empty string (got {text!r})")
    if isinstance(main_process_port, bool) or not isinstance(main_process_port, int) or not 0 < main_process_port < 65536:
        raise NotExportable(f"main_process_port must be a TCP port 1-65535 (got {main_process_port!r})")
    if main_process_ip is not None and (not isinstance(main_process_ip, str) or not main_process_ip.strip()):
        raise NotExportable(f"main_process_ip must be a host name or address (got {main_process_ip!r})")

    strategy = plan.strategy
    layout = _layout(plan, fsdp_version)
    notes: dict[str, list[str]] = {}
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": layout.distributed_type,
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "gpu_ids": "all",
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": plan.nodes,
        "num_processes": plan.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if layout.distributed_type == "DEEPSPEED":
        config["deepspeed_config"] = _deepspeed_section(plan, ds_config_name, deepspeed_multinode_launcher, notes)
    else:
        config["mixed_precision"] = _MIXED_PRECISION[strategy.precision]
    if layout.distributed_type == "FSDP":
        config["fsdp_config"] = _fsdp_section(plan, layout, notes)
    if layout.parallelism:
        config["parallelism_config"] = _parallelism_section(plan, layout, notes)
    if layout.distributed_type == "MEGATRON_LM":
        config["megatron_lm_config"] = _megatron_section(plan, notes)
    if strategy.compile:
        config["dynamo_config"] = {"dynamo_backend": "INDUCTOR", "dynamo_use_regional_compilation": True}
        notes["dynamo_config"] = ["the plan compiles each repeated block (torch.compile, priced as fused kernels): "
                                  "accelerate's regional compilation compiles the model's repeated blocks"
                                  + ("; train.py compiles the loss function (torch.compile(loss_fn))"
                                     if strategy.loss_compiled else "")]
    if strategy.precision == "fp8":
        config["fp8_config"] = {"backend": FP8_BACKEND, "fp8_format": "HYBRID"}
        notes["fp8_config"] = ["fp8 through Transformer Engine (accelerate swaps nn.Linear for te.Linear): "
                               "install transformer_engine on every node; TE keeps an fp8 copy of each Linear weight "
                               "and its transpose through the step (+2 bytes per parameter) and saves fp8 inputs, "
                               "where the plan priced torchao's Float8Linear, train.py's (no copies, bf16 inputs)"]

    pdsh = layout.distributed_type == "DEEPSPEED" and deepspeed_multinode_launcher == "pdsh"
    if plan.multi_node:
        config["main_process_port"] = main_process_port
        if pdsh:
            if main_process_ip is not None:
                config["main_process_ip"] = main_process_ip
        else:
            config["main_process_ip"] = main_process_ip or MAIN_PROCESS_IP_PLACEHOLDER
            config["rdzv_backend"] = "c10d"
            config["same_network"] = False
            notes["main_process_ip"] = [
                f"the main node's address{' (placeholder)' if main_process_ip is None else ''}: every node "
                "passes --machine_rank <its rank> and --main_process_ip <main node address>, which override "
                "this file; c10d rendezvous at main_process_ip:main_process_port",
            ]

    script: list[str] = []
    if layout.distributed_type == "FSDP":
        script.extend(_reduce_dtype_notes(strategy, layout.fsdp_version))
    if layout.distributed_type not in ("DEEPSPEED", "MEGATRON_LM") and strategy.grad_accum > 1:
        if strategy.fsdp != "none" and strategy.fsdp_grad_sync == "step":
            script.append(f"gradient accumulation: Accelerator(gradient_accumulation_steps={strategy.grad_accum}) "
                          "(accelerate.yaml has no key for it outside DeepSpeed/Megatron-LM), and step inside "
                          "accelerator.accumulate(model): FSDP's gradients stay unsharded until the last "
                          "micro-batch, as the plan (fsdp_grad_sync step) holds them")
        elif strategy.fsdp != "none":
            script.append("gradient accumulation: Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin("
                          f"num_steps={strategy.grad_accum}, sync_each_batch=True)) (accelerate.yaml has no key for "
                          "it outside DeepSpeed/Megatron-LM), and step inside accelerator.accumulate(model); "
                          "sync_each_batch keeps FSDP's gradients sharded (without it accumulate() holds them "
                          "unsharded until the last micro-batch, more memory than the plan's)")
        else:
            script.append(f"gradient accumulation: Accelerator(gradient_accumulation_steps={strategy.grad_accum}) "
                          "(accelerate.yaml has no key for it outside DeepSpeed/Megatron-LM), and step inside "
                          "accelerator.accumulate(model)")
    if layout.distributed_type in ("NO", "MULTI_GPU") and strategy.checkpointing == "full":
        which = ("each repeated block" if strategy.checkpoint_layers is None else
                 f"the first {strategy.checkpoint_layers} repeated blocks (partial checkpointing; train.py does)")
        script.append(f"full activation checkpointing: wrap {which} in torch.utils.checkpoint "
                      + ("(transformers: model.gradient_checkpointing_enable()); " if strategy.checkpoint_layers is None
                         else "") + "accelerate.yaml has no key for it")
    if layout.distributed_type in ("NO", "MULTI_GPU") and strategy.checkpointing == "selective":
        script.append(SELECTIVE_NOTE)
    if strategy.precision == "bf16-pure" and layout.distributed_type != "DEEPSPEED":
        script.append("bf16-pure: cast the model with model.to(torch.bfloat16) before accelerator.prepare; "
                      "accelerate's bf16 autocasts but keeps the parameter dtype it is given")

    file_name = FILE_NAMES["accelerate"]
    nodes, per_node, world = plan.nodes, plan.procs_per_node, plan.world_size
    header = [
        *_comment(f"Generated by optplan: accelerate {ACCELERATE_VERSION} config for "
                  f"{plan.model or 'the model'} on {plan.gpu}"),
        *_comment(f"Plan: {strategy.label()}"),
        *_comment(f"{_count(nodes, 'node')} x {_count(per_node, 'GPU')} = {_count(world, 'process', 'es')}"),
        *_comment(f"Global batch {strategy.global_batch} = micro-batch {strategy.mbs} x accumulation "
                  f"{strategy.grad_accum} x data-parallel {strategy.dp}"),
    ]
    command = f"accelerate launch --config_file {file_name}"
    train_script = shlex.quote(train_script)  # the lines below are shell commands a user copies
    if not plan.multi_node:
        header += _comment("Launch from the folder holding this file:")
        header += _comment(f"  {command} {train_script}", wrap=False)
    elif pdsh:
        header += _comment(f"Launch once, on the first host of {FILE_NAMES['hostfile']}, from the folder holding "
                           "this file (DeepSpeed starts the other nodes):")
        header += _comment(f"  {command} {train_script}", wrap=False)
    else:
        header += _comment(f"Launch on each of the {nodes} nodes, from the folder holding this file "
                           f"(NODE_RANK 0..{nodes - 1}, 0 on the main node, whose address is MAIN_NODE_IP):")
        header += _comment(f"  {command} --machine_rank $NODE_RANK --main_process_ip $MAIN_NODE_IP {train_script}",
                           wrap=False)
    footer: list[str] = []
    if script:
        footer += _comment("In the training script:")
        for note in script:
            footer += _comment(f"- {note}")
    return "\n".join(header + _emit(config, notes) + footer) + "\n"


def _count(n: int, word: str, plural: str = "s") -> str:
    return f"{n} {word}{plural if n != 1 else ''}"

