"""Dropout profiled with CUDA's bool mask. The profiler's measurement of the quantised layers' inputs (what an old
bitsandbytes keeps) and LoRA dropout in the profile are checked in tests/probes/test_adapters.py, on the LoRA profiles
that module makes once for all its tests."""

from __future__ import annotations

import torch

from optplan.probes.dropout import gpu_dropout


def test_gpu_dropout_keeps_a_bool_mask() -> None:
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.dtype] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.Dropout(0.25)(x)
    assert saved == [torch.bfloat16]  # the CPU's dropout keeps a noise tensor of the input's dtype
    saved.clear()
    with gpu_dropout(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = torch.nn.Dropout(0.25)(x)
    assert saved == [torch.bool]  # CUDA's fused kernel: a bool mask
    y.float().sum().backward()
    kept = (y != 0).float()
    assert torch.allclose(x.grad.float(), kept / 0.75, rtol=1e-2)  # type: ignore[union-attr]  # bf16 scale
    assert torch.nn.functional.dropout(x, 0.25, training=False) is x  # eval mode is untouched
