"""Validators for exported launch configs: each checks a file with the target's own loader.

``validate_ds_config`` runs DeepSpeed's own ``DeepSpeedConfig`` parser for a given world size and
adds the checks DeepSpeed itself skips (unknown top-level keys, NVMe offload without a path, NVMe
optimizer offload below ZeRO-3, unresolved Hugging Face ``"auto"`` values). deepspeed is imported
lazily (about 1.6 s) and its log output is held back while it is imported and used here.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import logging
from collections.abc import Iterator, KeysView
from typing import Any

from optplan.estimators.errors import OptplanError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_DS_LOGGER = "DeepSpeed"


class ExportValidationError(OptplanError):
    """An exported file that the target's own loader (or our extra checks) rejects."""


def parse_json_object(text: object, file_name: str) -> dict[str, Any]:
    """An exported JSON file's object, or one ExportValidationError line naming the file and the problem."""
    if not isinstance(text, str):
        raise ExportValidationError(f"{file_name} must be text, got {type(text).__name__}")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ExportValidationError(f"{file_name} is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ExportValidationError(f"{file_name} must be a JSON object, got {type(doc).__name__}")
    return doc


class _QuietFilter(logging.Filter):
    """Drops DeepSpeed records below ERROR (its import and config parser log at INFO/WARNING)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextlib.contextmanager
def _quiet_deepspeed() -> Iterator[None]:
    """Hold back DeepSpeed's INFO/WARNING records for the duration; the filter is removed after."""
    log = logging.getLogger(_DS_LOGGER)
    quiet = _QuietFilter()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def _import_deepspeed() -> Any:
    with _quiet_deepspeed():
        try:
            import deepspeed.runtime.config as ds_config_module
        except Exception as exc:  # pragma: no cover - depends on the environment
            raise ExportValidationError(
                f"cannot import deepspeed to validate ds_config.json ({type(exc).__name__}: {exc}): "
                "pip install deepspeed"
            ) from exc
    return ds_config_module


@contextlib.contextmanager
def _world(ds_config_module: Any, world_size: int) -> Iterator[None]:
    """DeepSpeedConfig asks ``dist`` for rank and world size: answer 0 and ``world_size``.

    The two attributes of ``deepspeed.comm`` are put back afterwards, also on error.
    """
    dist = ds_config_module.dist
    saved = {name: dist.__dict__[name] for name in ("get_rank", "get_world_size") if name in dist.__dict__}

    def get_rank(*_args: object, **_kwargs: object) -> int:
        return 0

    def get_world_size(*_args: object, **_kwargs: object) -> int:
        return world_size

    dist.get_rank = get_rank
    dist.get_world_size = get_world_size
    try:
        yield
    finally:
        for name in ("get_rank", "get_world_size"):
            if name in saved:
                setattr(dist, name, saved[name])
            else:  # pragma: no cover - deepspeed.comm always defines both
                delattr(dist, name)


class _RecordingDict(dict):
    """A dict that remembers which keys were looked up (get, [], in, keys() membership).

    DeepSpeedConfig reads every top-level key it understands from the dict it is given (most
    through constants in ``deepspeed.runtime.constants`` and the section modules); the keys it
    looked at are the keys DeepSpeed knows. ``copy.copy`` of this dict shares ``seen``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: set[object] = set()

    def __getitem__(self, key: object) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key: object, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self) -> KeysView:  # type: ignore[override]
        return KeysView(self)


def _one_line(exc: BaseException) -> str:
    """A one-line description of a DeepSpeed/pydantic error."""
    errors = getattr(exc, "errors", None)
    title = getattr(exc, "title", None)
    if callable(errors) and title is not None:  # pydantic.ValidationError
        parts = []
        for err in errors():
            loc = ".".join(str(p) for p in err.get("loc", ()))
            parts.append(f"{loc}: {err.get('msg', '')}" if loc else str(err.get("msg", "")))
        return f"{title}: " + "; ".join(parts)
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _find_auto(value: Any, path: str) -> str | None:
    if isinstance(value, str) and value == "auto":
        return path
    if isinstance(value, dict):
        for key, sub in value.items():
            found = _find_auto(sub, f"{path}.{key}" if path else str(key))
            if found:
                return found
    if isinstance(value, list):
        for i, sub in enumerate(value):
            found = _find_auto(sub, f"{path}[{i}]")
            if found:
                return found
    return None


def _check_offload(zero_config: Any) -> None:
    stage = int(zero_config.stage)
    for key, section in (("offload_optimizer", zero_config.offload_optimizer),
                         ("offload_param", zero_config.offload_param)):
        if section is None:
            continue
        device = getattr(section.device, "value", section.device)
        if device == "nvme" and not section.nvme_path:
            raise ExportValidationError(
                f"ds_config zero_optimization.{key} offloads to nvme without nvme_path "
                "(DeepSpeed fails only at run time): set nvme_path to a directory on a local NVMe drive"
            )
        if key == "offload_optimizer" and device == "nvme" and stage != 3:
            raise ExportValidationError(
                f"ds_config offloads the optimizer to nvme at ZeRO-{stage}; DeepSpeed supports that only at "
                "stage 3 (ZeRO-1/2 fall back to CPU offload): use stage 3 or device cpu"
            )


def validate_ds_config(config: dict, *, world_size: int) -> None:
    """Check ``config`` with DeepSpeed's own parser as if launched on ``world_size`` GPUs.

    Raises ExportValidationError (one line) when DeepSpeed rejects it, when the batch triple it
    resolves differs from the config's, for top-level keys DeepSpeed does not know (it ignores them
    silently), for NVMe offload without ``nvme_path`` and for unresolved ``"auto"`` values.
    Leaves no global state behind (``deepspeed.comm`` and the DeepSpeed logger are restored).
    """
    load_ds_config(config, world_size=world_size)


def load_ds_config(config: dict, *, world_size: int) -> Any:
    """``validate_ds_config``, returning the ``deepspeed.runtime.config.DeepSpeedConfig`` it built."""
    if not isinstance(config, dict):
        raise ExportValidationError(f"ds_config must be a JSON object, got {type(config).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ExportValidationError(f"world size must be a positive integer (got {world_size!r})")
    missing = [k for k in BATCH_KEYS if k not in config]
    if missing:
        raise ExportValidationError(f"ds_config lacks {', '.join(missing)}: an export must state the whole "
                                    "batch triple (train_batch_size = micro-batch x accumulation x GPUs)")
    auto = _find_auto(config, "")
    if auto:
        raise ExportValidationError(f"ds_config has \"auto\" at {auto}: only the Hugging Face integration "
                                    "resolves \"auto\"; write the number")

    module = _import_deepspeed()
    recorded = _RecordingDict(copy.deepcopy(config))  # the parser must not touch the caller's dict
    with _quiet_deepspeed(), _world(module, world_size):
        try:
            parsed = module.DeepSpeedConfig(recorded)
        except Exception as exc:  # DeepSpeed raises AssertionError, ValueError, pydantic errors, ...
            raise ExportValidationError(
                f"DeepSpeed rejects ds_config at world size {world_size}: {_one_line(exc)}"
            ) from exc

    unknown = sorted(str(k) for k in config if k not in recorded.seen)
    if unknown:
        known = sorted(str(k) for k in recorded.seen)
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, known, n=1)
            hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
        raise ExportValidationError(f"ds_config has top-level keys DeepSpeed does not know and would ignore: "
                                    f"{', '.join(hints)}")

    resolved = (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps)
    stated = tuple(config[k] for k in BATCH_KEYS)
    if resolved != stated:
        raise ExportValidationError(
            f"DeepSpeed resolves the batch triple (train_batch_size, micro-batch, accumulation) to {resolved} "
            f"at world size {world_size}, but ds_config states {stated}"
        )
    _check_offload(parsed.zero_config)
    return parsed
