"""Positions past a model's position table, caught on fake tensors.

Fake (and meta) tensors carry shapes, not values, so an embedding lookup of position ``s`` in a table of ``n < s``
rows runs without the IndexError a real run raises: a profile at a sequence the model cannot take would succeed and
price a plan that fails at its first step. Position indices are almost always ``torch.arange`` of the sequence
length, whose values are known from its Python arguments. :class:`PositionTracker` (a ``TorchFunctionMode``) records
the largest value of every tensor ``torch.arange`` makes, carries it through the view-like operations models apply
to position indices (``unsqueeze``, ``expand``, ``view``, slicing, ``+ offset``...), and records each
``F.embedding`` whose tracked indices reach past the table's rows. A model that builds positions another way (a
registered buffer, values computed from data) is not checked here.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_CARRY: frozenset[Callable[..., Any]] = frozenset({
    torch.Tensor.unsqueeze, torch.unsqueeze, torch.Tensor.expand, torch.Tensor.expand_as, torch.Tensor.view,
    torch.Tensor.reshape, torch.reshape, torch.Tensor.repeat, torch.Tensor.to, torch.Tensor.long, torch.Tensor.int,
    torch.Tensor.type, torch.Tensor.__getitem__, torch.Tensor.contiguous, torch.Tensor.clone, torch.Tensor.flatten,
    torch.flatten, torch.Tensor.squeeze, torch.squeeze, torch.Tensor.detach, torch.Tensor.cuda, torch.Tensor.cpu,
    torch.Tensor.transpose, torch.transpose, torch.Tensor.t, torch.Tensor.permute, torch.stack, torch.cat,
})
"""Operations whose output holds (a subset of) their first tensor argument's values."""
_ADD: frozenset[Callable[..., Any]] = frozenset({torch.Tensor.add, torch.add, torch.Tensor.__add__,
                                                 torch.Tensor.__radd__})


def _arange_max(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The largest value ``torch.arange(*args, **kwargs)`` holds, when its bounds are Python ints."""
    numbers = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    start, end, step = 0, None, 1
    if "end" in kwargs:
        start, end = kwargs.get("start", 0), kwargs["end"]
        step = kwargs.get("step", 1)
    elif len(numbers) == 1:
        end = numbers[0]
    elif len(numbers) >= 2:
        start, end = numbers[0], numbers[1]
        step = numbers[2] if len(numbers) > 2 else kwargs.get("step", 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, step)) or step <= 0:
        return None
    count = math.ceil((end - start) / step)  # type: ignore[operator]
    return None if count <= 0 else start + step * (count - 1)  # type: ignore[operator]


class PositionTracker(TorchFunctionMode):
    """Records embedding lookups of ``torch.arange`` positions past the table (``overruns``: (largest position,
    table rows))."""

    def __init__(self) -> None:
        super().__init__()
        self._max: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self.overruns: list[tuple[int, int]] = []

    def _get(self, t: Any) -> int | None:
        if not isinstance(t, torch.Tensor):
            return None
        found = self._max.get(id(t))
        return found[1] if found is not None and found[0]() is t else None

    def _set(self, t: Any, value: int) -> None:
        if isinstance(t, torch.Tensor):
            self._max[id(t)] = (weakref.ref(t), value)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._track(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 - bookkeeping never breaks the model's own step
            pass
        return out

    def _track(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if func is torch.arange:
            top = _arange_max(args, kwargs)
            if top is not None:
                self._set(out, top)
        elif func in (F.embedding, torch.embedding):
            indices, weight = (args[0], args[1]) if func is F.embedding else (args[1], args[0])
            top = self._get(indices)
            if top is not None and isinstance(weight, torch.Tensor) and top >= weight.shape[0]:
                self.overruns.append((top, int(weight.shape[0])))
        elif func in _CARRY and args:
            first = args[0][0] if func in (torch.stack, torch.cat) and isinstance(args[0], (list, tuple)) else args[0]
            top = self._get(first)
            if top is not None:
                self._set(out, top)
        elif func in _ADD and len(args) >= 2:
            base, other = (args[0], args[1])
            if isinstance(other, torch.Tensor):
                base, other = other, base
            top = self._get(base)
            if top is not None and isinstance(other, int) and not isinstance(other, bool):
                self._set(out, top + other)


__all__ = ["PositionTracker"]
