"""Dropout as a GPU runs it, for profiles taken on the CPU.

On CUDA ``torch.nn.functional.dropout`` runs the fused ``native_dropout`` kernel, whose backward keeps a ``bool`` mask
(1 byte per element: ATen ``dropout`` takes the fused path when ``is_fused_kernel_acceptable``, i.e. a CUDA input and
0 < p < 1). On the CPU it multiplies by a noise tensor of the input's dtype and keeps that (2 or 4 bytes per element):
measured on a bf16 LoRA model, 2h against 1h bytes per token for each adapted layer's mask. The profile plans GPU
memory, so :func:`gpu_dropout` routes every training-mode dropout through ``torch.native_dropout`` (bool mask, the
same scaling) while a profile runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

__all__ = ["gpu_dropout"]


@contextlib.contextmanager
def gpu_dropout() -> Iterator[None]:
    """Within the block, ``F.dropout`` (what ``nn.Dropout`` calls) in training mode with 0 < p < 1 is
    ``torch.native_dropout``, as on CUDA (module docstring); other calls are unchanged."""
    original = F.dropout

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if training and 0.0 < p < 1.0 and not inplace and input.numel() > 0:
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    F.dropout = dropout  # type: ignore[assignment]
    try:
        yield
    finally:
        F.dropout = original  # type: ignore[assignment]
