"""The validator of ``hf_training_args.json`` (planner/export/hf.py writes it): transformers' own
``TrainingArguments`` constructs the file, its fields and types are checked first (one line naming the key and
the fix), then the plan it must carry (batch, precision, optimizer, checkpointing, sharding) and, for DeepSpeed
plans, the ds_config.json it names, at the plan's world size.

The validator imports transformers lazily (about 2 s) and leaves no global state behind.
"""


import contextlib
import copy
import dataclasses
import logging
import os
import typing
import warnings
from collections.abc import Iterator
from typing import Any

from optplan.estimators.errors import OptplanError
from optplan.planner.export.context import ExportPlan
from optplan.planner.export.hf import (
    FSDP_CONFIG_DEFAULTS,
    NEW_CHECKPOINTING_FIELD,
    OLD_CHECKPOINTING_FIELD,
    checkpointing_field,
    fsdp_accumulation_args,
    hf_training_args,
)
from optplan.planner.export.json_types import close_match_hint, json_value_fits, one_line, type_name

_FIELD_TYPE_EXTRAS: dict[str, tuple[Any, ...]] = {"fsdp": (bool,)}
"""Values a field takes beyond its annotation: ``fsdp: str | None`` is documented as ``fsdp=True``
(``training_args.py`` field help, and ``_process_fsdp_args`` sets it to True)."""

_DEPRECATED_MARKERS = ("deprecated", "will be removed")


class _CaptureHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _contained(log_names: tuple[str, ...]) -> Iterator[_CaptureHandler]:
    """Run third-party constructors without leaving global state behind.

    Restores ``os.environ`` (transformers sets FSDP_CPU_RAM_EFFICIENT_LOADING), accelerate's shared
    ``PartialState``/``AcceleratorState``, transformers' DeepSpeed-config weakref and torch's fp32 precision
    mode; holds back the named loggers' output (their WARNING+ records are captured for the caller).
    """
    env = dict(os.environ)
    shared: list[tuple[dict, dict]] = []
    with contextlib.suppress(Exception):
        from accelerate.state import AcceleratorState, GradientState, PartialState

        shared = [(cls._shared_state, dict(cls._shared_state))
                  for cls in (PartialState, AcceleratorState, GradientState)]
    hf_ds = None
    with contextlib.suppress(Exception):
        import transformers.integrations.deepspeed as hf_ds
    saved_ref = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None)
    import torch

    fp32_precision = getattr(torch.backends, "fp32_precision", None)
    capture = _CaptureHandler()
    loggers = [logging.getLogger(name) for name in log_names]
    saved_logging = [(log, log.handlers[:], log.propagate, log.level) for log in loggers]
    for log in loggers:
        log.handlers = [capture]
        log.propagate = False
        if log.level == logging.NOTSET or log.level > logging.WARNING:
            log.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield capture
        for w in caught:
            capture.records.append(logging.LogRecord("warnings", logging.WARNING, w.filename, w.lineno,
                                                     f"{w.category.__name__}: {w.message}", None, None))
    finally:
        for log, handlers, propagate, level in saved_logging:
            log.handlers = handlers
            log.propagate = propagate
            log.setLevel(level)
        if fp32_precision is not None and getattr(torch.backends, "fp32_precision", None) != fp32_precision:
            torch.backends.fp32_precision = fp32_precision
        if hf_ds is not None:
            hf_ds._hf_deepspeed_config_weak_ref = saved_ref
        for state, saved in shared:
            state.clear()
            state.update(saved)
        for key in [k for k in os.environ if k not in env]:
            del os.environ[key]
        for key, value in env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def _parse(text: str) -> dict[str, Any]:
    from optplan.planner.validate import parse_json_object

    return parse_json_object(text, "hf_training_args.json")


def _check_fields(args: dict[str, Any], training_args_cls: type) -> None:
    from optplan.planner.validate import ExportValidationError

    fields = {f.name: f for f in dataclasses.fields(training_args_cls) if f.init}
    unknown = [k for k in args if k not in fields]
    if unknown:
        hints = ", ".join(close_match_hint(k, sorted(fields)) for k in unknown)
        raise ExportValidationError(f"hf_training_args.json has keys that are not TrainingArguments fields: {hints}")
    hints = typing.get_type_hints(training_args_cls)
    for key, value in args.items():
        annotation = hints.get(key, Any)
        if json_value_fits(value, annotation):
            continue
        if any(json_value_fits(value, extra) for extra in _FIELD_TYPE_EXTRAS.get(key, ())):
            continue
        raise ExportValidationError(f"hf_training_args.json: {key}={value!r} has the wrong type "
                                    f"(TrainingArguments takes {type_name(annotation)})")


_PLAN_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "optim",
              "activation_checkpointing")
"""Top-level keys whose value the plan decides."""


def _check_plan(args: dict[str, Any], plan: ExportPlan, training_args_cls: type) -> None:
    """The keys the plan decides must say what the plan says (absent keys take TrainingArguments' defaults)."""
    from optplan.planner.validate import ExportValidationError

    try:
        expected = hf_training_args(plan)
    except OptplanError as exc:
        raise ExportValidationError(f"the plan has no TrainingArguments export: {exc}") from exc
    s = plan.strategy
    defaults = {f.name: f.default for f in dataclasses.fields(training_args_cls)}
    field = checkpointing_field()
    for key in _PLAN_KEYS:
        if key == "activation_checkpointing":  # either name (the old one is the new one's deprecated alias)
            got = next((args[k] for k in (NEW_CHECKPOINTING_FIELD, OLD_CHECKPOINTING_FIELD)
                        if args.get(k) is not None), False)
            want = expected[field]
        else:
            got, want = args.get(key, defaults[key]), expected[key]
        if got != want:
            raise ExportValidationError(f"hf_training_args.json: {key}={got!r} but the plan needs {want!r} "
                                        f"({s.label()})")
    if args.get("use_cpu"):
        raise ExportValidationError("hf_training_args.json: use_cpu=true but the plan trains on GPUs")
    uses_ds = args.get("deepspeed") not in (None, "", {})
    if uses_ds != (s.engine == "deepspeed"):
        need = "needs a deepspeed key naming ds_config.json" if s.engine == "deepspeed" else \
            f"runs on the {s.engine} engine, so there must be no deepspeed key"
        raise ExportValidationError(f"hf_training_args.json: the plan {need} ({s.label()})")
    uses_fsdp = args.get("fsdp") not in (None, False, "", [])
    if uses_fsdp != (s.fsdp != "none"):
        need = "shards with FSDP: set fsdp=true and fsdp_config" if s.fsdp != "none" else \
            "does not use FSDP: drop the fsdp key"
        raise ExportValidationError(f"hf_training_args.json: the plan {need} ({s.label()})")
    if uses_fsdp:
        config = args.get("fsdp_config") or {}
        if not isinstance(config, dict):
            raise ExportValidationError("hf_training_args.json: fsdp_config must be an object (a file path cannot be "
                                        "checked against the plan)")
        config = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in config.items()}
        for key, want in expected["fsdp_config"].items():
            got = config.get(key, FSDP_CONFIG_DEFAULTS[key])
            if key == "transformer_layer_cls_to_wrap" and isinstance(got, str):
                got = [got]
            if key in ("reshard_after_forward", "cpu_offload", "activation_checkpointing") and isinstance(got, str):
                got = got.lower() in ("y", "yes", "t", "true", "on", "1")
            if key == "version":
                got = int(got) if isinstance(got, (int, str)) and str(got).isdigit() else got
            if got != want:
                raise ExportValidationError(f"hf_training_args.json: fsdp_config.{key}={got!r} but the plan needs "
                                            f"{want!r} ({s.label()})")
        if config.get("activation_checkpointing") and (args.get(NEW_CHECKPOINTING_FIELD)
                                                       or args.get(OLD_CHECKPOINTING_FIELD)):
            raise ExportValidationError(
                "hf_training_args.json sets both fsdp_config.activation_checkpointing and activation_checkpointing; "
                "the Trainer refuses that (transformers trainer.py): keep FSDP's"
            )


def _find_auto(value: Any, path: str = "") -> str | None:
    if isinstance(value, str) and value == "auto":
        return path or "<root>"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, sub in items:
        found = _find_auto(sub, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


class _AtWorldSize:
    """TrainingArguments as seen by a process of a ``world_size``-process launch (the rest is delegated)."""

    def __init__(self, args: Any, world_size: int) -> None:
        self._args = args
        self.world_size = world_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)


def _check_ds_config(training_args: Any, ds_config: dict, plan: ExportPlan) -> None:
    """HF's own DeepSpeed consistency checks, run as a ``plan.world_size``-process launch would run them."""
    from optplan.planner.validate import ExportValidationError

    if not isinstance(ds_config, dict):
        raise ExportValidationError(f"ds_config must be a JSON object, got {type(ds_config).__name__}")
    auto = _find_auto(ds_config)
    if auto:
        raise ExportValidationError(f"ds_config has \"auto\" at {auto}: optplan exports concrete numbers (HF would "
                                    "fill it from the training args); write the number")
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    config = copy.deepcopy(ds_config)
    # The plan has no schedule length: leave out a DeepSpeed scheduler section, whose step counts HF would
    # compare with the run's (trainer_config_finalize).
    config.pop("scheduler", None)
    seen = _AtWorldSize(training_args, plan.world_size)
    try:
        hf_config = HfTrainerDeepSpeedConfig(config)
        hf_config.trainer_config_process(seen)
        hf_config.trainer_config_finalize(seen, model=None, num_training_steps=1000)
        plugin = DeepSpeedPlugin(hf_ds_config=hf_config)
        plugin.set_mixed_precision(training_args.mixed_precision)  # as AcceleratorState does (accelerate state.py)
    except Exception as exc:
        raise ExportValidationError(
            f"Hugging Face's DeepSpeed integration rejects ds_config with these training args at world size "
            f"{plan.world_size}: {one_line(exc)}"
        ) from exc


def validate_hf_training_args(text: str, plan: ExportPlan, *, ds_config: dict | None = None) -> None:
    """Check ``hf_training_args.json`` text with transformers' own ``TrainingArguments``.

    Raises ExportValidationError (one line) when a key is not a TrainingArguments field or its value has the
    wrong type; when a key the plan decides (batch, accumulation, bf16/fp16, optim, checkpointing, deepspeed,
    fsdp and its ``fsdp_config``) contradicts the plan; when ``TrainingArguments(**args)`` raises (built for
    real with ``use_cpu=True``, which keeps the DeepSpeed/FSDP parts from touching a GPU), or warns that an
    argument is deprecated; and, when ``ds_config`` is given (or the ``deepspeed`` key holds a dict), when HF's
    DeepSpeed integration (``HfTrainerDeepSpeedConfig.trainer_config_process`` + ``trainer_config_finalize``
    at the plan's world size, then accelerate's ``DeepSpeedPlugin`` and its ``set_mixed_precision``) finds a
    mismatch: batch triple, accumulation, clipping, optimizer hyper-parameters, bf16/fp16. A ``deepspeed`` path
    is not opened. No global state is left behind (environment, accelerate state, transformers' DeepSpeed
    weakref, loggers).
    """
    from optplan.planner.validate import ExportValidationError

    args = _parse(text)
    try:
        from transformers import TrainingArguments
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise ExportValidationError(f"cannot import transformers to validate hf_training_args.json "
                                    f"({one_line(exc)}): pip install transformers") from exc
    _check_fields(args, TrainingArguments)
    _check_plan(args, plan, TrainingArguments)

    deepspeed = args.get("deepspeed")
    if ds_config is None and isinstance(deepspeed, dict):
        ds_config = deepspeed
    if ds_config is not None and plan.strategy.engine != "deepspeed":
        raise ExportValidationError(f"a ds_config was given but the plan runs on the {plan.strategy.engine} engine")
    kwargs = {k: copy.deepcopy(v) for k, v in args.items() if k != "deepspeed"}
    kwargs["use_cpu"] = True
    if ds_config is not None:
        kwargs["deepspeed"] = copy.deepcopy(ds_config)
    with _contained(("transformers", "accelerate", "DeepSpeed")) as captured:
        try:
            training_args = TrainingArguments(**kwargs)
            _ = training_args.device
        except Exception as exc:
            raise ExportValidationError(f"TrainingArguments rejects hf_training_args.json: {one_line(exc)}") from exc
        if ds_config is not None:
            _check_ds_config(training_args, ds_config, plan)
    if fsdp_accumulation_args(plan.strategy):
        sync = (training_args.accelerator_config.gradient_accumulation_kwargs or {}).get("sync_each_batch", False)
        if not sync and plan.strategy.fsdp_grad_sync != "step":
            raise ExportValidationError(
                "hf_training_args.json lets the Trainer accumulate FSDP gradients unsharded (no_sync on all but the "
                "last micro-batch), which the plan's memory does not hold: set accelerator_config."
                "gradient_accumulation_kwargs.sync_each_batch to true, or re-export")
        if sync and plan.strategy.fsdp_grad_sync == "step":
            raise ExportValidationError(
                "hf_training_args.json makes the Trainer reduce-scatter FSDP gradients after every micro-batch, the "
                "plan reduces once per step (fsdp_grad_sync step): set accelerator_config.gradient_accumulation_"
                "kwargs.sync_each_batch to false, or re-export")
    for record in captured.records:
        message = record.getMessage()
        if any(marker in message.lower() for marker in _DEPRECATED_MARKERS) and \
                any(key in message for key in args):
            raise ExportValidationError("TrainingArguments warns about hf_training_args.json: "
                                        f"{' '.join(message.split())}")
