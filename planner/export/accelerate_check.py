"""Checks ``accelerate.yaml`` with accelerate's own machinery (``validate_accelerate_yaml``).

The text :func:`optplan.planner.export.accelerate.render_accelerate_yaml` writes is loaded with accelerate's
config loader (``commands/config/config_args.py``, ``load_config_from_file``) and run through accelerate's
launch-argument processing (``commands/launch.py``, ``_validate_launch_command``; ``utils/launch.py``,
``prepare_multi_gpu_env`` and friends) and its plugin dataclasses (``utils/dataclasses.py``,
``parallelism_config.py``), short of starting a process; then the settings accelerate would run with are
compared with the plan. Key names and behaviours follow accelerate 1.15.0; the facts relied on are listed
in :mod:`optplan.planner.export.accelerate`.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from optplan.planner.export.accelerate import (
    _FSDP1_STRATEGY,
    _MIXED_PRECISION,
    ACCELERATE_VERSION,
    DEFAULT_MAIN_PROCESS_PORT,
    MAIN_PROCESS_IP_PLACEHOLDER,
    _Layout,
    _layout,
    _scalar,
    _wrap_class,
    megatron_recompute_keys,
)
from optplan.planner.export.context import FILE_NAMES, ExportPlan, NotExportable
from optplan.planner.validate import ExportValidationError

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
    # every FSDP unit, so on for full checkpointing of every block only (partial: the script checkpoints)
    checkpointing = strategy.checkpointing == "full" and strategy.checkpoint_layers is None
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
    for key, want in megatron_recompute_keys(strategy.checkpoint_layers, "").items():
        have = getattr(plugin, key)
        if have != want:
            what = (f"the first {strategy.checkpoint_layers} blocks of each stage" if strategy.checkpoint_layers
                    else "every block")
            raise _fail(f"Megatron-LM gets {key}={have}, but the plan recomputes {what}: set "
                        f"megatron_lm_config.megatron_lm_{key}: {want}")


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
