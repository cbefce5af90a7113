"""``accelerate.yaml``: an accelerate config file for a plan, and its check by accelerate's own code.

``render_accelerate_yaml`` is a pure function ``ExportPlan -> text`` (accelerate is not imported);
``validate_accelerate_yaml`` loads the text with accelerate's config loader and runs accelerate's
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
without full recompute or in an autocast/pure/fp8 precision, and DeepSpeed plans whose ds_config.json
the DeepSpeed exporter refuses.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import logging
import os
import shlex
import tempfile
import textwrap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from optplan.estimators.errors import OptplanError
from optplan.estimators.strategy import Strategy
from optplan.planner.export.context import (
    FILE_NAMES,
    SELECTIVE_CHECKPOINTING_HOWTO,
    ExportPlan,
    NotExportable,
)
from optplan.planner.validate import ExportValidationError

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


def _fsdp_section(plan: ExportPlan, layout: _Layout, notes: dict[str, list[str]]) -> dict[str, Any]:
    strategy = plan.strategy
    section: dict[str, Any] = {
        "fsdp_activation_checkpointing": strategy.checkpointing == "full",
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
    if strategy.checkpointing == "full":
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
    if strategy.cp > 1:
        lines.append("context parallelism: run forward/backward inside accelerator.maybe_context_parallel(...)")
    notes["parallelism_config"] = lines
    return dict(sorted(section.items()))


def _megatron_section(plan: ExportPlan, notes: dict[str, list[str]]) -> dict[str, Any]:
    strategy = plan.strategy
    prefix = "megatron_lm_"
    section: dict[str, Any] = {
        prefix + "context_parallel_size": strategy.cp,
        prefix + "gradient_clipping": 1.0,
        prefix + "num_micro_batches": strategy.grad_accum,
        prefix + "pp_degree": strategy.pp,
        prefix + "recompute_granularity": "full",
        prefix + "recompute_method": "uniform",
        prefix + "recompute_num_layers": 1,
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
                                  "accelerate's regional compilation compiles the model's repeated blocks"]
    if strategy.precision == "fp8":
        config["fp8_config"] = {"backend": FP8_BACKEND, "fp8_format": "HYBRID"}
        notes["fp8_config"] = ["fp8 through Transformer Engine (accelerate swaps nn.Linear for te.Linear): "
                               "install transformer_engine on every node"]

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
        script.append("full activation checkpointing: wrap each repeated block in torch.utils.checkpoint "
                      "(transformers: model.gradient_checkpointing_enable()); accelerate.yaml has no key for it")
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


# ----------------------------------------------------------------------------------------------------
# Validation with accelerate's own machinery
# ----------------------------------------------------------------------------------------------------

_SECTION_GROUPS = {
    "deepspeed_config": "DeepSpeed Arguments",
    "fsdp_config": "FSDP Arguments",
    "megatron_lm_config": "Megatron-LM Arguments",
    "fp8_config": "FP8 Arguments",
    "parallelism_config": "ParallelismConfig Arguments",
}
"""Nested section -> the ``launch_command_parser`` argument group whose destinations it may set."""
_SECTION_PREFIX = {"fsdp_config": "fsdp_", "fp8_config": "fp8_", "dynamo_config": "dynamo_"}
"""Prefixes ``_validate_launch_command`` adds to nested keys that lack them."""
_EXTRA_NESTED = {"fsdp_config": {"fsdp_ignored_modules"}, "dynamo_config": set()}
"""Nested keys launch reads without a parser argument (``prepare_multi_gpu_env``: ``fsdp_ignored_modules``)."""
_ENV_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_", "MEGATRON_LM_")
"""Environment variables launch writes and the plugins read."""
_ACCELERATE_LOGGERS = ("accelerate.commands.launch", "accelerate.utils.dataclasses", "accelerate.utils.launch")
_DISTRIBUTED_TYPES = ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED", "MEGATRON_LM")


class _QuietFilter(logging.Filter):
    """Drops accelerate records below ERROR while it is used here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextlib.contextmanager
def _quiet_accelerate() -> Iterator[None]:
    """Hold back accelerate's INFO/WARNING log records and Python warnings; both are restored after."""
    quiet = _QuietFilter()
    loggers = [logging.getLogger(name) for name in _ACCELERATE_LOGGERS]
    for log in loggers:
        log.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for log in loggers:
            log.removeFilter(quiet)


@contextlib.contextmanager
def _launch_environment() -> Iterator[None]:
    """A clean slate for accelerate's variables (``_ENV_PREFIXES``); ``os.environ`` is restored exactly after.

    Launch builds the environment of the training processes from the file, and the plugin dataclasses
    read it back from ``os.environ``; variables already set in this shell are hidden meanwhile so that
    only the file speaks. Not thread-safe (``os.environ`` is process-wide).
    """
    saved = {key: value for key, value in os.environ.items() if key.startswith(_ENV_PREFIXES)}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(_ENV_PREFIXES)]:
            del os.environ[key]
        os.environ.update(saved)


def _import_launch() -> Any:
    """``accelerate.commands.launch``; it may call ``logging.basicConfig`` when imported: root is restored."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import accelerate.commands.launch as launch
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise ExportValidationError(
            f"cannot import accelerate to validate accelerate.yaml ({type(exc).__name__}: {exc}): "
            f"pip install accelerate=={ACCELERATE_VERSION}"
        ) from exc
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)
    return launch


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _hint(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)


def _fail(message: str) -> ExportValidationError:
    return ExportValidationError(f"accelerate.yaml: {message}")


def _load(text: str, path: Path) -> tuple[dict[str, Any], Any]:
    """The raw mapping and accelerate's ``ClusterConfig`` for ``text`` (written to ``path``)."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise _fail(f"is not valid YAML ({_one_line(exc)}): re-export it") from exc
    if not isinstance(raw, dict):
        raise _fail(f"must be a YAML mapping of accelerate config keys, got {type(raw).__name__}")
    if raw.get("compute_environment", "LOCAL_MACHINE") != "LOCAL_MACHINE":
        raise _fail(f"compute_environment is {raw['compute_environment']!r}: set LOCAL_MACHINE "
                    "(optplan launches on your own machines, not SageMaker)")
    path.write_text(text, encoding="utf-8")
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    try:
        loaded = load_config_from_file(str(path))
    except Exception as exc:  # ValueError for unknown keys/enum values, TypeError for bad fields
        known = set(ClusterConfig.__dataclass_fields__)
        unknown = sorted(str(k) for k in raw if k not in known)
        if unknown:
            raise _fail(f"top-level keys accelerate {ACCELERATE_VERSION} does not know: "
                        f"{', '.join(_hint(k, known) for k in unknown)}; rename or remove them") from exc
        raise _fail(f"accelerate's config loader rejects it ({_one_line(exc)}): fix the named key") from exc
    return raw, loaded


def _section_keys(parser: Any) -> dict[str, set[str]]:
    """Per nested section, the launch-argument destinations its keys may set."""
    by_title = {group.title: {action.dest for action in group._group_actions} for group in parser._action_groups}
    out = {section: set(by_title.get(title, set())) for section, title in _SECTION_GROUPS.items()}
    out["dynamo_config"] = {dest for dests in by_title.values() for dest in dests if dest.startswith("dynamo_")}
    for section, extra in _EXTRA_NESTED.items():
        out.setdefault(section, set()).update(extra)
    return out


def _check_nested(raw: dict[str, Any], parser: Any) -> None:
    """Refuse nested keys that ``accelerate launch`` would copy onto its arguments and never read."""
    allowed = _section_keys(parser)
    for section, keys in allowed.items():
        body = raw.get(section)
        if body is None:
            continue
        if not isinstance(body, dict):
            raise _fail(f"{section} must be a mapping of keys, got {type(body).__name__}")
        prefix = _SECTION_PREFIX.get(section, "")
        for key in body:
            name = str(key)
            dest = name if not prefix or name.startswith(prefix) else prefix + name
            if dest not in keys:
                raise _fail(f"{section} has {_hint(name, keys)}, which accelerate launch never reads "
                            f"(the key would be ignored silently): use one of its {section} keys")


def _check_values(raw: dict[str, Any]) -> None:
    """Enumerated and boolean values against accelerate's own constants (``utils/constants.py``)."""
    from accelerate.utils import constants

    fsdp = raw.get("fsdp_config") or {}
    version = fsdp.get("fsdp_version", 1)
    if "fsdp_version" in fsdp and version not in (1, 2, "1", "2"):
        raise _fail(f"fsdp_config.fsdp_version is {version!r}: use 1 or 2")
    states = constants.FSDP2_STATE_DICT_TYPE if str(version) == "2" else constants.FSDP_STATE_DICT_TYPE
    choices = {
        "fsdp_auto_wrap_policy": constants.FSDP_AUTO_WRAP_POLICY,
        "fsdp_backward_prefetch": constants.FSDP_BACKWARD_PREFETCH,
        "fsdp_sharding_strategy": constants.FSDP_SHARDING_STRATEGY,
        "fsdp_state_dict_type": states,
    }
    for key, allowed in choices.items():
        if key in fsdp and str(fsdp[key]).upper() not in allowed:
            raise _fail(f"fsdp_config.{key} is {fsdp[key]!r}: use one of {', '.join(allowed)}")
    flags = ("fsdp_activation_checkpointing", "fsdp_cpu_ram_efficient_loading", "fsdp_offload_params",
             "fsdp_sync_module_states", "fsdp_use_orig_params", "fsdp_forward_prefetch")
    for key in flags:
        if key in fsdp and not isinstance(fsdp[key], bool):
            raise _fail(f"fsdp_config.{key} is {fsdp[key]!r}: use true or false")
    reshard = fsdp.get("fsdp_reshard_after_forward")
    if str(version) == "2" and reshard is not None and not isinstance(reshard, bool):
        raise _fail(f"fsdp_config.fsdp_reshard_after_forward is {reshard!r} under FSDP2: "
                    "use true (FULL_SHARD) or false (SHARD_GRAD_OP)")
    if str(version) == "1" and reshard is not None and str(reshard).upper() not in constants.FSDP_SHARDING_STRATEGY:
        raise _fail(f"fsdp_config.fsdp_reshard_after_forward is {reshard!r} under FSDP1: use one of "
                    f"{', '.join(constants.FSDP_SHARDING_STRATEGY)}")
    ds = raw.get("deepspeed_config") or {}
    launcher = ds.get("deepspeed_multinode_launcher")
    if launcher is not None and launcher not in constants.DEEPSPEED_MULTINODE_LAUNCHERS:
        raise _fail(f"deepspeed_config.deepspeed_multinode_launcher is {launcher!r}: use one of "
                    f"{', '.join(constants.DEEPSPEED_MULTINODE_LAUNCHERS)}")


def _expected_precision(plan: ExportPlan) -> str | None:
    return None if plan.strategy.engine == "deepspeed" else _MIXED_PRECISION[plan.strategy.precision]


def _file_layout(raw: dict[str, Any], plan: ExportPlan) -> _Layout:
    """The layout the plan needs under the FSDP version the file states (accelerate's default is 1)."""
    version = 2
    if raw.get("distributed_type") == "FSDP":
        version = int((raw.get("fsdp_config") or {}).get("fsdp_version", 1))
    try:
        return _layout(plan, version)
    except NotExportable as exc:
        raise _fail(f"the plan cannot run under accelerate as written ({exc})") from exc


def _check_plan(loaded: Any, plan: ExportPlan, layout: _Layout) -> str:
    """The file against the plan; returns accelerate's distributed type name."""
    strategy = plan.strategy
    dtype = getattr(loaded.distributed_type, "value", str(loaded.distributed_type))
    if dtype not in _DISTRIBUTED_TYPES:
        raise _fail(f"distributed_type {dtype} is not a GPU launch optplan exports: use one of "
                    f"{', '.join(_DISTRIBUTED_TYPES)}")
    if dtype != layout.distributed_type:
        where = f"the {strategy.engine} engine" + (f" with FSDP {strategy.fsdp}" if strategy.fsdp != "none" else "")
        raise _fail(f"distributed_type is {dtype}, but the plan ({plan.world_size} GPUs on {where}) runs as "
                    f"{layout.distributed_type}: set distributed_type: {_scalar(layout.distributed_type)}")
    if loaded.num_processes != plan.world_size:
        raise _fail(f"num_processes is {loaded.num_processes}, but the plan uses {plan.world_size} GPUs "
                    f"({plan.nodes} node(s) x {plan.procs_per_node}): set num_processes: {plan.world_size} "
                    "(the total over all machines)")
    if loaded.num_machines != plan.nodes:
        raise _fail(f"num_machines is {loaded.num_machines}, but the plan spans {plan.nodes} node(s): "
                    f"set num_machines: {plan.nodes}")
    if loaded.use_cpu:
        raise _fail("use_cpu is true, which trains on the CPU: set use_cpu: false")
    gpu_ids = loaded.gpu_ids
    if gpu_ids not in (None, "all") and len(str(gpu_ids).split(",")) < plan.procs_per_node:
        raise _fail(f"gpu_ids {gpu_ids!r} names fewer GPUs than the {plan.procs_per_node} processes per node: "
                    "set gpu_ids: all")
    expected = _expected_precision(plan)
    if loaded.mixed_precision != expected:
        if expected is None:
            raise _fail(f"mixed_precision is {loaded.mixed_precision!r} next to deepspeed_config_file, which "
                        "accelerate refuses (precision comes from ds_config.json): remove mixed_precision")
        raise _fail(f"mixed_precision is {loaded.mixed_precision!r}, but the plan's precision {strategy.precision} "
                    f"is accelerate's {expected!r}: set mixed_precision: {expected}")
    if strategy.precision == "fp8" and str((loaded.fp8_config or {}).get("backend", "")).upper() not in ("TE", "AO", "MSAMP"):
        raise _fail("the plan trains in fp8 but fp8_config names no backend: set fp8_config: {backend: TE}")
    if plan.multi_node:
        if loaded.main_process_port is None:
            raise _fail("a multi-node launch needs main_process_port: set main_process_port: "
                        f"{DEFAULT_MAIN_PROCESS_PORT}")
        ds = loaded.deepspeed_config or {}
        pdsh = dtype == "DEEPSPEED" and ds.get("deepspeed_multinode_launcher", "pdsh") != "standard"
        if pdsh and not ds.get("deepspeed_hostfile"):
            raise _fail("a multi-node DeepSpeed launch with the pdsh launcher needs deepspeed_config."
                        f"deepspeed_hostfile: set it to {FILE_NAMES['hostfile']}")
        if not pdsh and not (isinstance(loaded.main_process_ip, str) and loaded.main_process_ip.strip()):
            raise _fail("a multi-node launch needs main_process_ip (the main node's address, "
                        f"{MAIN_PROCESS_IP_PLACEHOLDER} as a placeholder): set it, or pass --main_process_ip")
        if not pdsh and loaded.same_network and loaded.rdzv_backend != "static":
            raise _fail(f"rdzv_backend {loaded.rdzv_backend} with same_network true gives torchrun no rendezvous "
                        "endpoint (accelerate then sets only master_addr; torch.distributed.run.get_rdzv_endpoint): "
                        "set same_network: false")
    return dtype


def _prepared_args(launch: Any, path: Path) -> Any:
    """``accelerate launch --config_file PATH train.py`` parsed and merged with the file.

    ``launch_command_parser`` and ``_validate_launch_command`` (``commands/launch.py``); then, as
    ``launch_command`` does before ``deepspeed_launcher``, the DeepSpeed fields the file sets (and
    ``mixed_precision`` when it came from the file) for ``DeepSpeedPlugin._deepspeed_config_checks``.
    """
    parser = launch.launch_command_parser()
    args = parser.parse_args(["--config_file", str(path), "train.py"])
    try:
        args, defaults, mp_from_config = launch._validate_launch_command(args)
    except Exception as exc:
        raise _fail(f"accelerate launch rejects it ({_one_line(exc)}): fix the named key") from exc
    args.deepspeed_fields_from_accelerate_config = ""
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config.keys())
        if mp_from_config:
            fields.append("mixed_precision")
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return args


def _launch_env(args: Any) -> dict[str, str]:
    """The accelerate variables ``accelerate launch`` would give the training processes (nothing is started).

    Only facts of the file are checked: the rendezvous-port probe is skipped for multi-node files by
    preparing as a non-main node (``machine_rank`` 1), and a missing fp8 package (a fact of this machine)
    is bypassed by preparing as bf16 and adding the fp8 variables with accelerate's ``setup_fp8_env``.
    """
    from accelerate.utils import launch as launch_utils

    args = copy.copy(args)
    if args.num_machines and args.num_machines > 1:
        args.machine_rank = 1
    fp8 = str(args.mixed_precision).lower() == "fp8"
    if fp8:
        args.mixed_precision = "bf16"
    try:
        if args.use_deepspeed:
            _cmd, env = launch_utils.prepare_deepspeed_cmd_env(args)
        elif args.use_fsdp or args.use_megatron_lm or args.multi_gpu:
            env = launch_utils.prepare_multi_gpu_env(args)
        else:
            _cmd, env = launch_utils.prepare_simple_launcher_cmd_env(args)
    except Exception as exc:  # ValueError/AssertionError from accelerate's checks
        raise _fail(f"accelerate launch rejects it ({_one_line(exc)}): fix the named key") from exc
    if fp8:
        env["ACCELERATE_MIXED_PRECISION"] = "fp8"
        env = launch_utils.setup_fp8_env(args, env)
    return {key: value for key, value in env.items() if key.startswith(_ENV_PREFIXES)}


def _plugin(factory: Any, what: str, **kwargs: Any) -> Any:
    """Build an accelerate plugin/config dataclass from the launch environment (its ``__post_init__`` checks)."""
    try:
        return factory(**kwargs)
    except Exception as exc:
        raise _fail(f"accelerate's {what} rejects it ({_one_line(exc)}): fix the named key") from exc


def _check_fsdp(plan: ExportPlan, layout: _Layout) -> None:
    """``FullyShardedDataParallelPlugin()`` as the Accelerator builds it from ``FSDP_*`` (``utils/dataclasses.py``)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    strategy = plan.strategy
    version = int(os.environ.get("FSDP_VERSION", "1"))
    kwargs: dict[str, Any] = {}
    if version == 1:
        # sync_module_states asks the CUDA device for param_init_fn (no GPU here); both flags were
        # checked as booleans by _check_values, and launch refuses cpu_ram_efficient_loading without sync.
        kwargs = {"sync_module_states": False, "cpu_ram_efficient_loading": False}
    plugin = _plugin(FullyShardedDataParallelPlugin, "FullyShardedDataParallelPlugin", **kwargs)
    if version == 2:
        reshard = layout.sharding != "grad_op"
        if plugin.reshard_after_forward is not reshard:
            raise _fail(f"fsdp_reshard_after_forward is {plugin.reshard_after_forward}, but FSDP {strategy.fsdp} "
                        f"needs {str(reshard).lower()}: set fsdp_config.fsdp_reshard_after_forward: "
                        f"{str(reshard).lower()}")
        offloaded = isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    else:
        want = _FSDP1_STRATEGY[layout.sharding or "full"]
        have = getattr(plugin.sharding_strategy, "name", str(plugin.sharding_strategy))
        if have != want:
            raise _fail(f"FSDP1 runs sharding strategy {have} (from fsdp_sharding_strategy), but FSDP "
                        f"{strategy.fsdp} needs {want}: set fsdp_config.fsdp_sharding_strategy: {want}")
        offloaded = bool(plugin.cpu_offload.offload_params)
    if offloaded != (strategy.offload_params == "cpu"):
        raise _fail(f"fsdp_offload_params is {str(offloaded).lower()}, but the plan "
                    f"{'offloads' if strategy.offload_params == 'cpu' else 'does not offload'} parameters: set "
                    f"fsdp_config.fsdp_offload_params: {str(strategy.offload_params == 'cpu').lower()}")
    checkpointing = strategy.checkpointing == "full"
    if bool(plugin.activation_checkpointing) != checkpointing:
        raise _fail(f"fsdp_activation_checkpointing is {str(bool(plugin.activation_checkpointing)).lower()}, but "
                    f"the plan's checkpointing is {strategy.checkpointing}: set "
                    f"fsdp_config.fsdp_activation_checkpointing: {str(checkpointing).lower()}")
    policy = os.environ.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP").upper()
    if policy == "NO_WRAP" or (policy == "SIZE_BASED_WRAP" and not plugin.min_num_params):
        raise _fail(f"fsdp_auto_wrap_policy {policy}{' with fsdp_min_num_params 0' if policy != 'NO_WRAP' else ''} "
                    "makes the whole model one FSDP unit (all parameters gathered at once, unlike the plan): set "
                    "TRANSFORMER_BASED_WRAP with fsdp_transformer_layer_cls_to_wrap")
    if plan.block_class:
        wanted = _wrap_class(plan.block_class)
        names = plugin.transformer_cls_names_to_wrap
        if policy == "TRANSFORMER_BASED_WRAP" and names != [wanted]:
            raise _fail(f"fsdp_transformer_layer_cls_to_wrap is {names}, but the model's repeated block is "
                        f"{wanted}: set fsdp_config.fsdp_transformer_layer_cls_to_wrap: {wanted}")


def _check_parallelism(plan: ExportPlan, layout: _Layout) -> None:
    """``ParallelismConfig()`` from ``PARALLELISM_CONFIG_*`` (``parallelism_config.py``), with the size checks of
    ``ParallelismConfig._validate_accelerator`` that need no process group."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.dataclasses import TorchTensorParallelConfig

    strategy = plan.strategy
    use = os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true"
    if not use:
        if layout.parallelism:
            raise _fail("the plan needs a parallelism_config section (HSDP replicas, tp or cp sizes) and the "
                        "file has none: re-export it")
        return
    fsdp = layout.distributed_type == "FSDP"
    if fsdp and os.environ.get("FSDP_VERSION") != "2":
        raise _fail("parallelism_config needs FSDP2 (accelerate launch refuses it with FSDP1): set "
                    "fsdp_config.fsdp_version: 2, or remove parallelism_config")
    # TorchTensorParallelConfig only checks the installed torch/transformers versions (facts of the training
    # machine, not of the file): a handler is supplied so that ParallelismConfig skips building one.
    handler = object.__new__(TorchTensorParallelConfig)
    config = _plugin(ParallelismConfig, "ParallelismConfig", tp_handler=handler)
    if config.total_size != plan.world_size:
        raise _fail(f"parallelism_config sizes multiply to {config.total_size}, but num_processes is "
                    f"{plan.world_size} (ParallelismConfig._validate_accelerator refuses it): make "
                    "dp_replicate x dp_shard x tp x cp equal the GPU count")
    for name, want in (("tp", strategy.tp), ("cp", strategy.cp)):
        have = getattr(config, f"{name}_size")
        if have != want:
            raise _fail(f"parallelism_config_{name}_size is {have}, but the plan uses {name}={want}: set "
                        f"parallelism_config.parallelism_config_{name}_size: {want}")
    if config.data_parallel_size != strategy.dp:
        raise _fail(f"parallelism_config dp_replicate x dp_shard = {config.data_parallel_size}, but the plan's "
                    f"data-parallel degree is {strategy.dp}: fix parallelism_config_dp_replicate_size/dp_shard_size")
    if fsdp and not config.dp_shard_enabled and not config.cp_enabled:
        raise _fail("FSDP has no dimension to shard across (dp_shard_size and cp_size are 1; the Accelerator "
                    "refuses it): raise parallelism_config_dp_shard_size")
    if layout.sharding == "hybrid" and not config.dp_replicate_enabled:
        raise _fail("the plan is HSDP (replicas across nodes) but parallelism_config_dp_replicate_size is 1: "
                    f"set it to the replica count ({plan.nodes} for one replica per node)")
    if layout.sharding in ("full", "grad_op") and config.dp_replicate_enabled:
        raise _fail(f"parallelism_config_dp_replicate_size is {config.dp_replicate_size}, which makes FSDP "
                    f"{layout.sharding} hybrid: set it to 1")


def _check_megatron(plan: ExportPlan) -> None:
    """``MegatronLMPlugin()`` from ``MEGATRON_LM_*`` (``utils/dataclasses.py``; Megatron-LM is not imported)."""
    from accelerate.utils import MegatronLMPlugin

    strategy = plan.strategy
    plugin = _plugin(MegatronLMPlugin, "MegatronLMPlugin")
    wanted = (
        ("megatron_lm_tp_degree", plugin.tp_degree, strategy.tp),
        ("megatron_lm_pp_degree", plugin.pp_degree, strategy.pp),
        ("megatron_lm_context_parallel_size", plugin.context_parallel_size, strategy.cp),
        ("megatron_lm_num_micro_batches", plugin.num_micro_batches, strategy.grad_accum),
        ("megatron_lm_sequence_parallelism", plugin.sequence_parallelism, strategy.sp),
        ("megatron_lm_use_distributed_optimizer", plugin.use_distributed_optimizer, strategy.zero == 1),
    )
    for key, have, want in wanted:
        if have != want:
            shown = str(want).lower() if isinstance(want, bool) else want
            raise _fail(f"Megatron-LM gets {key.removeprefix('megatron_lm_')}={have}, but the plan needs {shown}: "
                        f"set megatron_lm_config.{key}: {shown}")
    if plugin.recompute_granularity != "full":
        raise _fail(f"megatron_lm_recompute_granularity is {plugin.recompute_granularity!r}: Megatron-core refuses "
                    "selective recompute with the recompute_num_layers accelerate always passes; set full")


def _check_deepspeed(plan: ExportPlan) -> None:
    """``DeepSpeedPlugin()`` from ``ACCELERATE_DEEPSPEED_*`` (``utils/dataclasses.py``; deepspeed is not imported)."""
    from accelerate.utils import DeepSpeedPlugin

    strategy = plan.strategy
    if not os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        raise _fail("deepspeed_config has no deepspeed_config_file: set it to the ds_config.json optplan writes "
                    "(accelerate would otherwise build its own DeepSpeed config)")
    # ds_config.json itself is checked by validate_ds_config; a stub with the plan's ZeRO stage stands in.
    stub = {"zero_optimization": {"stage": strategy.zero}, "gradient_accumulation_steps": strategy.grad_accum,
            "train_micro_batch_size_per_gpu": strategy.mbs}
    plugin = _plugin(DeepSpeedPlugin, "DeepSpeedPlugin", hf_ds_config=stub)
    flag = os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_INIT")
    stated = plugin.zero3_init_flag if flag is None else flag.lower() == "true"
    if bool(stated) != (strategy.zero == 3):
        want = str(strategy.zero == 3).lower()
        raise _fail(f"zero3_init_flag is {str(bool(stated)).lower()} at ZeRO-{strategy.zero} (deepspeed.zero.Init "
                    f"partitions the model at creation, for stage 3 only): set deepspeed_config.zero3_init_flag: {want}")


def _check_fp8(plan: ExportPlan) -> None:
    """``ACCELERATE_FP8_BACKEND`` must name an ``FP8BackendType`` (``Accelerator.fp8_backend``)."""
    from accelerate.utils.dataclasses import FP8BackendType

    if plan.strategy.precision != "fp8":
        return
    backend = os.environ.get("ACCELERATE_FP8_BACKEND")
    try:
        FP8BackendType(str(backend))
    except ValueError as exc:
        raise _fail(f"fp8_config.backend is {backend!r}: use one of TE, AO, MSAMP") from exc


def validate_accelerate_yaml(text: str, plan: ExportPlan) -> None:
    """Check ``text`` with accelerate 1.15.0's own loader and launch processing, and against ``plan``.

    Steps: the YAML must load through ``load_config_from_file`` (unknown top-level keys refused); every
    nested key must be a launch argument of its section (``launch_command_parser``'s groups) and
    enumerated values must be in accelerate's constants; the file must agree with the plan
    (distributed type, ``num_processes`` = world size, ``num_machines`` = nodes, mixed precision,
    multi-node addresses); then ``_validate_launch_command`` and the ``prepare_*_env`` function of the
    distributed type run (nothing is launched), and the plugin dataclasses the training processes
    would build (``FullyShardedDataParallelPlugin``, ``ParallelismConfig``, ``MegatronLMPlugin``,
    ``DeepSpeedPlugin``) are built from that environment and compared with the plan.

    The file is written to a temporary directory. Accelerate's variables in ``os.environ`` are hidden
    and restored, its log records and warnings held back (not thread-safe). Raises
    ExportValidationError with one line naming the key and the fix.
    """
    if not isinstance(text, str):
        raise _fail(f"expected the file's text, got {type(text).__name__}")
    launch = _import_launch()
    with tempfile.TemporaryDirectory(prefix="optplan-accelerate-") as tmp, _quiet_accelerate():
        path = Path(tmp) / FILE_NAMES["accelerate"]
        raw, loaded = _load(text, path)
        _check_nested(raw, launch.launch_command_parser())
        _check_values(raw)
        layout = _file_layout(raw, plan)
        dtype = _check_plan(loaded, plan, layout)
        with _launch_environment():
            args = _prepared_args(launch, path)
            os.environ.update(_launch_env(args))
            if dtype == "FSDP":
                _check_fsdp(plan, layout)
            if dtype in ("FSDP", "MULTI_GPU"):
                _check_parallelism(plan, layout)
            if dtype == "MEGATRON_LM":
                _check_megatron(plan)
            if dtype == "DEEPSPEED":
                _check_deepspeed(plan)
            _check_fp8(plan)
