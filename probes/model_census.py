"""The model's parameter census, read from the full model on the meta device (no weights): counts, per-module and
per-dtype totals, Adafactor's factored state, the optimizer's tensor sizes and the buffers (elements and bytes).

Part of the static profile (probes/static.py), which records these figures in ``ModelProfile``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn

from optplan.estimators.profile import SMALL_PARAM_LIMIT


def count_params(model: nn.Module) -> tuple[int, int, dict[str, int], str]:
    """(unique params, trainable params, params per top-level child, dominant param dtype)."""
    total = trainable = 0
    by_module: dict[str, int] = OrderedDict((name, 0) for name, _ in model.named_children())
    by_dtype: dict[torch.dtype, int] = {}
    for name, p in model.named_parameters():  # unique: a tied weight once, under its first owner
        n = p.numel()
        total += n
        if p.requires_grad:
            trainable += n
        top = name.split(".", 1)[0]
        by_module[top] = by_module.get(top, 0) + n
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + n
    dtype = max(by_dtype, key=by_dtype.__getitem__) if by_dtype else torch.float32
    return total, trainable, dict(by_module), str(dtype).removeprefix("torch.")


def factored_state_elements(model: nn.Module) -> int:
    """Adafactor second-moment elements of the trainable parameters (Shazeer & Stern 2018, arXiv 1804.04235).

    As ``torch.optim.Adafactor`` allocates them: a parameter with >= 2 dims gets a row factor over its
    last dim and a column factor over its second-to-last, leading dims kept, i.e.
    ``prod(shape[:-2]) * (shape[-2] + shape[-1])`` elements; a 0-D or 1-D parameter gets a full second
    moment (``numel``). Unique parameters (a tied weight once), ``requires_grad`` only. Meta tensors do.
    """
    total = 0
    for p in model.parameters():  # unique: a tied weight once
        if not p.requires_grad:
            continue
        if p.dim() >= 2:
            lead = 1
            for d in p.shape[:-2]:
                lead *= int(d)
            total += lead * (int(p.shape[-2]) + int(p.shape[-1]))
        else:
            total += p.numel()
    return total


def trainable_numels(model: nn.Module) -> tuple[int, ...]:
    """Elements of each trainable parameter tensor in ``model.parameters()`` order (a tied weight once):
    the order in which ``torch.optim`` steps them. Meta tensors do."""
    return tuple(p.numel() for p in model.parameters() if p.requires_grad)


def small_param_counts(model: nn.Module, limit: int = SMALL_PARAM_LIMIT) -> dict[int, int]:
    """Unique parameter tensors of at most ``limit`` elements, as ``numel -> count`` (a tied weight once)."""
    counts: dict[int, int] = {}
    for p in model.parameters():
        n = p.numel()
        if n <= limit:
            counts[n] = counts.get(n, 0) + 1
    return dict(sorted(counts.items()))


def sparse_grad_params(model: nn.Module) -> int:
    """Trainable parameters of ``nn.Embedding`` / ``nn.EmbeddingBag`` modules built with ``sparse=True`` (their
    gradients are sparse tensors; a tied weight once)."""
    seen: set[int] = set()
    total = 0
    for mod in model.modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse and mod.weight.requires_grad \
                and id(mod.weight) not in seen:
            seen.add(id(mod.weight))
            total += mod.weight.numel()
    return total


def buffer_bytes(model: nn.Module) -> int:
    """Bytes of the model's (unique) buffers."""
    return sum(b.numel() * b.element_size() for b in model.buffers())


__all__ = ["buffer_bytes", "count_params", "factored_state_elements", "small_param_counts", "trainable_numels"]
