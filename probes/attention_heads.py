"""The key heads a model's attention call receives: what torch's ring attention exchanges and accumulates under
context parallelism (estimators/ring_attention.py).

A grouped-query model may hand its key/value heads to ``scaled_dot_product_attention`` as they are
(``enable_gqa=True``) or repeat them to every query head first (torchtitan's Llama 3 ``repeat_kv``, transformers'
``repeat_kv`` path): the ring moves the K and V the call receives. :func:`attention_calls` records, for every call of
``torch.nn.functional.scaled_dot_product_attention`` inside it, the query's and the key's head counts (dimension −3
of 4-D (batch, heads, sequence, head width) inputs), with a ``TorchFunctionMode``: the call as the model makes it,
before any backend or decomposition. Inputs of another rank (3-D) are counted as calls but give no heads.
Units: heads and calls (counts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


@dataclass
class AttentionCalls:
    """What the calls seen so far received: the most query and key heads of one 4-D call (0: none seen)."""

    calls: int = 0
    query_heads: int = 0
    key_heads: int = 0


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


@contextlib.contextmanager
def attention_calls() -> Iterator[AttentionCalls]:
    """Record the head counts of every ``scaled_dot_product_attention`` call made inside (module docstring)."""
    seen = AttentionCalls()

    class _Record(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                seen.calls += 1
                query, key = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
                if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == key.dim() == 4:
                    seen.query_heads = max(seen.query_heads, int(query.shape[-3]))
                    seen.key_heads = max(seen.key_heads, int(key.shape[-3]))
            return func(*args, **kwargs)

    with _Record():
        yield seen


__all__ = ["AttentionCalls", "attention_calls"]
