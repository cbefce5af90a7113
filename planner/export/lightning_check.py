"""The validator of ``lightning.json`` (planner/export/lightning.py writes it): Lightning's own ``Trainer`` and
strategy classes take the file (each key a ``Trainer`` argument of the right type, the strategy a registry name
whose class takes ``_strategy_kwargs``), then the plan it must carry is checked: processes, precision,
accumulation, sharding and, for DeepSpeed, the config Lightning would hand it.

It imports lightning lazily (about 3.5 s) and leaves no global state behind.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

from optplan.estimators.errors import OptplanError
from optplan.planner.export.context import ExportPlan
from optplan.planner.export.json_types import close_match_hint, json_value_fits, one_line, type_name
from optplan.planner.export.lightning import MODULE_CLASS_ARGS, RESERVED_KEYS, build_strategy, lightning_spec

_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning", "pytorch_lightning", "DeepSpeed")


@contextlib.contextmanager
def _contained() -> Iterator[None]:
    """Build Lightning objects without leaving global state behind.

    Holds back Lightning/DeepSpeed INFO/WARNING output and Python warnings, and restores logger levels
    (``DeepSpeedStrategy`` sets DeepSpeed's), the environment and the torch flags a Trainer may set
    (``cudnn.benchmark``, deterministic algorithms: ``accelerator_connector._set_torch_flags``).
    """
    import torch

    env = dict(os.environ)
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    levels = [(log, log.level) for log in loggers]
    benchmark = torch.backends.cudnn.benchmark
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for log, level in levels:
            log.setLevel(level)
        torch.backends.cudnn.benchmark = benchmark
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        for key in [k for k in os.environ if k not in env]:
            del os.environ[key]
        for key, value in env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def _error(message: str) -> Exception:
    """An ExportValidationError (imported lazily: validate.py is light, but only validators need it)."""
    from optplan.planner.validate import ExportValidationError

    return ExportValidationError(message)


def _parse(text: str) -> dict[str, Any]:
    from optplan.planner.validate import parse_json_object

    return parse_json_object(text, "lightning.json")


def _check_trainer_keys(trainer_args: dict[str, Any], trainer_cls: type) -> None:
    params = {name: p for name, p in inspect.signature(trainer_cls.__init__).parameters.items() if name != "self"}
    unknown = [k for k in trainer_args if k not in params]
    if unknown:
        hints = ", ".join(close_match_hint(k, sorted(params)) for k in unknown)
        raise _error(f"lightning.json has keys that are not lightning.pytorch.Trainer arguments: {hints}")
    for key, value in trainer_args.items():
        annotation = params[key].annotation
        if annotation is inspect.Parameter.empty or json_value_fits(value, annotation):
            continue
        raise _error(f"lightning.json: {key}={value!r} has the wrong type (Trainer takes {type_name(annotation)})")


def _strategy_params(cls: type) -> set[str]:
    """Keyword arguments ``cls`` takes; the ``**kwargs`` of FSDPStrategy and DDPStrategy go to torch's
    FullyShardedDataParallel / DistributedDataParallel (``strategies/fsdp.py``, ``strategies/ddp.py``), so
    those wrappers' parameters count too."""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    params = inspect.signature(cls.__init__).parameters
    names = {n for n, p in params.items() if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        wrapper: Any = None
        if issubclass(cls, FSDPStrategy):
            from torch.distributed.fsdp import FullyShardedDataParallel as wrapper
        elif issubclass(cls, DDPStrategy):
            from torch.nn.parallel import DistributedDataParallel as wrapper
        if wrapper is not None:
            names |= {n for n in inspect.signature(wrapper.__init__).parameters if n not in ("self", "module")}
    return names


def _check_deepspeed_config(spec: dict[str, Any], config: Any, world_size: int) -> None:
    """Lightning's DeepSpeed config rules, then DeepSpeed's own parser on the config Lightning would pass on."""
    if not isinstance(config, dict):
        raise _error("lightning.json: _strategy_kwargs.config must be a ds_config object (a path cannot be checked)")
    if "gradient_accumulation_steps" in config:
        raise _error("lightning.json: _strategy_kwargs.config sets gradient_accumulation_steps, which Lightning "
                     "refuses (lightning strategies/deepspeed.py): use accumulate_grad_batches")
    if spec.get("gradient_clip_algorithm") == "value":
        raise _error("lightning.json: DeepSpeed clips gradients by norm only (Lightning raises for "
                     "gradient_clip_algorithm='value')")
    from lightning.fabric.strategies.deepspeed import _format_precision_config

    from optplan.planner.validate import validate_ds_config

    # What DeepSpeedStrategy._format_config does before deepspeed.initialize (Lightning 2.6).
    full = copy.deepcopy(config)
    accumulate = spec.get("accumulate_grad_batches", 1)
    full["gradient_accumulation_steps"] = accumulate
    full.setdefault("train_micro_batch_size_per_gpu", 1)
    full.setdefault("gradient_clipping", spec.get("gradient_clip_val") or 0.0)
    _format_precision_config(config=full, precision=spec.get("precision") or "32-true", loss_scale=0,
                             loss_scale_window=1000, min_loss_scale=1, initial_scale_power=16, hysteresis=2)
    # DeepSpeed derives train_batch_size; the validator wants the whole triple stated.
    full.setdefault("train_batch_size", full["train_micro_batch_size_per_gpu"] * accumulate * world_size)
    validate_ds_config(full, world_size=world_size)


def _build(spec: dict[str, Any], trainer_args: dict[str, Any]) -> None:
    """Build the strategy object and a CPU Trainer from the file's non-GPU arguments."""
    import torch.nn as nn
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import FSDPStrategy, StrategyRegistry

    name = trainer_args.get("strategy", "auto")
    strategy_kwargs = spec.get("_strategy_kwargs")
    strategy: Any = name
    if strategy_kwargs is not None:
        names: set[str] = set()
        for key in MODULE_CLASS_ARGS:
            value = strategy_kwargs.get(key)
            names |= set([value] if isinstance(value, str) else value or [])
        placeholders = {n: type(n, (nn.Module,), {}) for n in names if isinstance(n, str)}
        try:
            strategy = build_strategy(name, strategy_kwargs, placeholders)
        except Exception as exc:
            raise _error(f"Lightning rejects _strategy_kwargs for strategy {name!r}: {one_line(exc)}") from exc
    precision = trainer_args.get("precision")
    cls = StrategyRegistry[name]["strategy"] if name in StrategyRegistry else None
    gpu_only = cls is not None and issubclass(cls, FSDPStrategy)
    if gpu_only:
        # Lightning refuses FSDP on a CPU accelerator: check its precision plugin on its own.
        from lightning.pytorch.plugins.precision import FSDPPrecision

        try:
            FSDPPrecision(precision or "32-true")
        except Exception as exc:
            raise _error(f"Lightning's FSDP rejects precision {precision!r}: {one_line(exc)}") from exc
        strategy = "auto"
    if precision in ("transformer-engine", "transformer-engine-float16"):
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None:
            precision = "32-true"  # Lightning builds this plugin only with transformer_engine installed
    kwargs = {k: v for k, v in trainer_args.items() if k not in ("accelerator", "devices", "num_nodes", "strategy")}
    kwargs.update(accelerator="cpu", devices=1, num_nodes=1, strategy=strategy, precision=precision)
    for key, value in (("logger", False), ("enable_checkpointing", False), ("enable_progress_bar", False),
                       ("enable_model_summary", False)):
        kwargs.setdefault(key, value)
    try:
        Trainer(**kwargs)
    except Exception as exc:
        raise _error(f"lightning.pytorch.Trainer rejects lightning.json: {one_line(exc)}") from exc


def _family(name: Any) -> str:
    """The kind of a strategy name: single device, ddp (any start method), fsdp or deepspeed (any preset)."""
    if name in ("auto", "single_device"):
        return "single"
    for family in ("ddp", "fsdp", "deepspeed"):
        if isinstance(name, str) and name.startswith(family):
            return family
    return str(name)


def _check_plan(spec: dict[str, Any], plan: ExportPlan) -> None:
    """The values the plan decides must say what the plan says."""
    try:
        expected = lightning_spec(plan)
    except OptplanError as exc:
        raise _error(f"the plan has no Lightning export: {exc}") from exc
    s = plan.strategy
    label = s.label()
    if spec.get("accelerator") not in ("gpu", "cuda"):
        raise _error(f"lightning.json: accelerator={spec.get('accelerator')!r} but the plan trains on GPUs: "
                     "use 'gpu'")
    devices, nodes = spec.get("devices"), spec.get("num_nodes", 1)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices * nodes != plan.world_size:
        raise _error(f"lightning.json: devices={devices!r} x num_nodes={nodes!r} must be the plan's "
                     f"{plan.world_size} GPUs ({plan.nodes} node(s) x {plan.procs_per_node})")
    defaults = {"precision": "32-true", "accumulate_grad_batches": 1, "strategy": "auto"}
    for key in ("devices", "num_nodes", "precision", "accumulate_grad_batches"):
        got = spec.get(key, defaults.get(key, 1))
        if got != expected[key]:
            raise _error(f"lightning.json: {key}={got!r} but the plan needs {expected[key]!r} ({label})")
    name = spec.get("strategy", "auto")
    want = expected["strategy"]
    if _family(name) != _family(want):
        raise _error(f"lightning.json: strategy={name!r} but the plan needs {want!r} ({label})")
    optplan_section = spec.get("_optplan")
    if isinstance(optplan_section, dict) and "batch_size" in optplan_section \
            and optplan_section["batch_size"] != s.mbs:
        raise _error(f"lightning.json: _optplan.batch_size={optplan_section['batch_size']!r} but the plan's "
                     f"micro-batch is {s.mbs}")
    got_kwargs = spec.get("_strategy_kwargs")
    want_kwargs = expected.get("_strategy_kwargs")
    if want_kwargs is None:
        return  # the plan decides nothing beyond the name (DDP's own wrapper arguments are the user's)
    if not isinstance(got_kwargs, dict):
        raise _error(f"lightning.json: the plan needs _strategy_kwargs for {want!r} ({label})")
    if s.engine == "deepspeed":
        _check_plan_deepspeed(got_kwargs.get("config"), want_kwargs["config"], name, label)
        return
    fsdp_defaults = {"sharding_strategy": "FULL_SHARD", "cpu_offload": None, "auto_wrap_policy": None,
                     "activation_checkpointing_policy": None, "device_mesh": None}
    from lightning.pytorch.strategies import StrategyRegistry

    init_params = StrategyRegistry[name]["init_params"] if name in StrategyRegistry else {}
    for key in fsdp_defaults:
        got = got_kwargs.get(key, init_params.get(key, fsdp_defaults[key]))
        want_value = want_kwargs.get(key)
        if key == "cpu_offload":
            got, want_value = bool(got), bool(want_value)
        if key in MODULE_CLASS_ARGS and isinstance(got, str):
            got = [got]
        if key == "sharding_strategy" and isinstance(got, str):
            got = got.upper()
        if key in MODULE_CLASS_ARGS and got and want_value and set(got) == set(want_value):
            continue
        if got != want_value:
            raise _error(f"lightning.json: _strategy_kwargs.{key}={got!r} but the plan needs {want_value!r} "
                         f"({label})")


def _check_plan_deepspeed(got: Any, want: dict[str, Any], name: str, label: str) -> None:
    if not isinstance(got, dict):
        raise _error(f"lightning.json: the plan needs _strategy_kwargs.config, a ds_config object ({label})")
    zero = got.get("zero_optimization") or {}
    want_zero = want["zero_optimization"]

    def device(section: Any) -> str:
        return section.get("device", "none") if isinstance(section, dict) else "none"

    facts = {
        "zero_optimization.stage": (zero.get("stage", 0), want_zero["stage"]),
        "zero_optimization.offload_optimizer.device": (device(zero.get("offload_optimizer")),
                                                       device(want_zero.get("offload_optimizer"))),
        "zero_optimization.offload_param.device": (device(zero.get("offload_param")),
                                                   device(want_zero.get("offload_param"))),
        "train_micro_batch_size_per_gpu": (got.get("train_micro_batch_size_per_gpu"),
                                           want["train_micro_batch_size_per_gpu"]),
    }
    for section in ("bf16", "fp16", "torch_autocast"):
        facts[f"{section}.enabled"] = (bool((got.get(section) or {}).get("enabled")),
                                       bool((want.get(section) or {}).get("enabled")))
    for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        facts[f"bf16.{key}"] = (bool((got.get("bf16") or {}).get(key)), bool((want.get("bf16") or {}).get(key)))
    for key, (value, want_value) in facts.items():
        if value != want_value:
            raise _error(f"lightning.json: _strategy_kwargs.config {key}={value!r} but the plan needs "
                         f"{want_value!r} ({label})")
    from lightning.pytorch.strategies import StrategyRegistry

    init = StrategyRegistry[name]["init_params"] if name in StrategyRegistry else {}
    if "stage" in init:
        preset = (init["stage"],
                  init.get("offload_optimizer_device", "cpu") if init.get("offload_optimizer") else "none",
                  init.get("offload_params_device", "cpu") if init.get("offload_parameters") else "none")
        stated = (zero.get("stage", 0), device(zero.get("offload_optimizer")), device(zero.get("offload_param")))
        if preset != stated:
            raise _error(f"lightning.json: strategy {name!r} stands for ZeRO-{preset[0]} with optimizer/parameter "
                         f"offload {preset[1]}/{preset[2]}, but its config says ZeRO-{stated[0]} "
                         f"{stated[1]}/{stated[2]}: use 'deepspeed' or the matching preset")


def validate_lightning_json(text: str, plan: ExportPlan) -> None:
    """Check ``lightning.json`` text with Lightning's own classes.

    Raises ExportValidationError (one line) when: a key without a leading underscore is not a parameter of
    ``lightning.pytorch.Trainer.__init__`` (``inspect.signature``) or its value does not fit the parameter's
    annotation (which also checks ``precision`` against Lightning's ``_PRECISION_INPUT``); an underscore key is
    not ``_strategy_kwargs``/``_optplan``; ``strategy`` is neither "auto" nor a ``StrategyRegistry`` name;
    ``_strategy_kwargs`` has keys that are not parameters of that strategy class (FSDPStrategy: or of torch
    FSDP, where its ``**kwargs`` go), or the class rejects them when built (module class names stand in as
    placeholder classes); a DeepSpeed config breaks Lightning's rules (no ``gradient_accumulation_steps``,
    clipping by norm) or, completed the way ``DeepSpeedStrategy._format_config`` completes it, fails
    ``optplan.planner.validate.validate_ds_config`` at the plan's world size; a CPU ``Trainer`` built from the
    non-GPU arguments raises (FSDP, which Lightning refuses on CPU, gets its ``FSDPPrecision`` built alone; a
    Transformer Engine precision is built only where transformer_engine is installed); or the file contradicts
    the plan (devices x num_nodes = world size, num_nodes = nodes, accumulate_grad_batches = accumulation,
    precision, strategy family, the plan-bound strategy kwargs, ``_optplan.batch_size`` = micro-batch).
    """
    spec = _parse(text)
    try:
        from lightning.pytorch import Trainer
        from lightning.pytorch.strategies import StrategyRegistry
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise _error(f"cannot import lightning to validate lightning.json ({one_line(exc)}): "
                     "pip install lightning") from exc
    underscored = [k for k in spec if k.startswith("_")]
    bad = [k for k in underscored if k not in RESERVED_KEYS]
    if bad:
        raise _error(f"lightning.json has underscore keys optplan does not define: "
                     f"{', '.join(close_match_hint(k, list(RESERVED_KEYS)) for k in bad)}")
    trainer_args = {k: v for k, v in spec.items() if not k.startswith("_")}
    _check_trainer_keys(trainer_args, Trainer)
    name = trainer_args.get("strategy", "auto")
    if name != "auto" and name not in StrategyRegistry:
        raise _error(f"lightning.json: strategy {close_match_hint(str(name), sorted(StrategyRegistry))} is not in "
                     "Lightning's StrategyRegistry")
    if "_optplan" in spec and not isinstance(spec["_optplan"], dict):
        raise _error("lightning.json: _optplan must be an object")
    strategy_kwargs = spec.get("_strategy_kwargs")
    if strategy_kwargs is not None:
        if not isinstance(strategy_kwargs, dict):
            raise _error("lightning.json: _strategy_kwargs must be an object")
        if name == "auto":
            raise _error("lightning.json: _strategy_kwargs need a strategy registry name, not 'auto'")
        cls = StrategyRegistry[name]["strategy"]
        allowed = _strategy_params(cls)
        unknown = [k for k in strategy_kwargs if k not in allowed]
        if unknown:
            raise _error(f"lightning.json: _strategy_kwargs has keys that are not {cls.__name__} arguments: "
                         f"{', '.join(close_match_hint(k, sorted(allowed)) for k in unknown)}")
    _check_plan(spec, plan)
    with _contained():
        if strategy_kwargs is not None and "config" in strategy_kwargs:
            from optplan.planner.validate import ExportValidationError

            try:
                _check_deepspeed_config(spec, strategy_kwargs["config"], plan.world_size)
            except ExportValidationError:
                raise
            except Exception as exc:
                raise _error("Lightning's DeepSpeed config handling rejects _strategy_kwargs.config: "
                             f"{one_line(exc)}") from exc
        _build(spec, trainer_args)
