"""Whether a JSON value fits a Python type annotation, and the one-line messages the export validators share
(planner/export/hf_check.py, planner/export/lightning_check.py): a third-party config class's annotations
checked against the values a written file holds, before that class's own constructor runs."""


import difflib
import enum
import types
import typing
from typing import Any


def json_value_fits(value: Any, annotation: Any) -> bool:
    """Whether a JSON value (``json.loads`` output) is an instance of a type annotation.

    Handles unions, ``Optional``, ``Literal``, ``list[...]``, ``tuple[...]``, ``dict[...]``, ``Any``, enums
    (a member or its value) and plain classes. ``bool`` is not an ``int`` here, and an ``int`` fits ``float``
    (JSON writes ``1.0`` as ``1.0`` but a person may write ``1``). Unresolved string annotations fit anything.
    """
    if annotation is Any or isinstance(annotation, (str, typing.ForwardRef)):
        return True
    if annotation is None or annotation is type(None):
        return value is None
    origin = typing.get_origin(annotation)
    targs = typing.get_args(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(json_value_fits(value, a) for a in targs)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in targs)
    if origin in (list, tuple, set, frozenset) or annotation in (list, tuple, set, frozenset):
        if not isinstance(value, list):
            return False
        if origin is tuple and targs and targs[-1] is not Ellipsis:
            return len(value) == len(targs) and all(json_value_fits(v, a) for v, a in zip(value, targs, strict=True))
        inner = targs[0] if targs else Any
        return all(json_value_fits(v, inner) for v in value)
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            return False
        if len(targs) == 2:
            return all(json_value_fits(k, targs[0]) and json_value_fits(v, targs[1]) for k, v in value.items())
        return True
    if origin is type or annotation is type:
        return False  # a class cannot come from JSON
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return isinstance(value, annotation) or any(value == m.value for m in annotation)
        if annotation is bool:
            return isinstance(value, bool)
        if annotation is int:
            return isinstance(value, int) and not isinstance(value, bool)
        if annotation is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        return isinstance(value, annotation)
    return True  # an annotation form this checker does not know: leave it to the real constructor


def type_name(annotation: Any) -> str:
    """A short readable name for an annotation (for error messages)."""
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return text or str(annotation).replace("typing.", "")


def close_match_hint(key: str, known: list[str]) -> str:
    """``"'key' (did you mean 'other'?)"`` or ``"'key'"``."""
    close = difflib.get_close_matches(key, known, n=1)
    return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)


def one_line(exc: BaseException) -> str:
    """A one-line description of an exception from a third-party loader."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


