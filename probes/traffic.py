"""Memory traffic of a model's eager kernels: the bytes each non-GEMM operator reads and writes.

An eager PyTorch step launches one kernel per ATen operator (the dispatcher's unit): every elementwise op,
reduction, norm, cast and copy reads its input tensors from HBM and writes its outputs. Those kernels are
memory-bound, so their time is bytes / achieved bandwidth (the roofline's memory side; Williams, Waterman &
Patterson 2009, CACM 52(4)). This module counts those bytes on the operators a step really dispatches
(``TorchDispatchMode``; on fake or meta tensors, no memory), instead of assuming a kernel list:

* per operator, bytes = Σ inputs + Σ outputs of ``numel × element size``; a broadcast (stride-0) input
  counts its distinct elements only; scalars count nothing;
* left out: matrix products and convolutions (priced by FLOPs: ``GEMM_OPS``), attention kernels (priced as
  one fused kernel: names in ``ATTENTION_MARKERS``) and views (``OpOverload.is_view`` and the aliasing ops
  in ``ALIAS_OPS``: no kernel runs);
* attribution to the repeated blocks: forward ops between a block's forward pre- and post-hook; backward ops
  between the moment its output's gradient exists and the moment its input's gradient does (tensor hooks:
  the block's own backward, its residual adds included).

For the convolutions the same pass counts their FLOPs (``Traffic.conv_flops``: forward, input and weight gradients,
probes/flop_formulas.py) and the activation bytes (inputs, outputs and their gradients, weights left out) of those
that run on a 4-D/5-D tensor not in ``torch.channels_last`` layout (``Traffic.nchw_conv_bytes``): what the
FLOPs-only step prices at TF32 under fp32 and the layout transposes of 16-bit convolutions
(estimators/counted_traffic.py).

The same pass counts the ATen operators one block's forward dispatches (every operator with a tensor output,
views included: ``Traffic.block_forward_ops``): the host cost of eager op-level selective checkpointing is per
dispatched operator (estimators/selective_host.py); and the kernels the step launches (every operator with a tensor
output but views: ``forward_kernels``, ``backward_kernels``, ``block_forward_kernels``), the host's work of an eager
step (estimators/eager_host.py).

Units: bytes; operators (a count). Used by ``benchmarks/eager_traffic.py`` (the per-token coefficients of
``estimators/data/eager_traffic.yaml``) and by probes/static.py (each profile counts its own block).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import conv_flop_count

from optplan.probes.flop_formulas import convolution_backward_flop

GEMM_OPS: frozenset[str] = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm",
    "convolution", "convolution_backward", "linear", "addmv", "mv", "dot", "vdot", "_int_mm",
})
"""ATen operators priced by their FLOPs (GEMM time), not their bytes."""
ATTENTION_MARKERS: tuple[str, ...] = ("scaled_dot_product", "flash_attention", "efficient_attention",
                                      "cudnn_attention", "flex_attention")
"""Substrings of fused attention operators (one kernel priced by FLOPs: estimators/compute.py)."""
ALIAS_OPS: frozenset[str] = frozenset({
    "detach", "alias", "lift_fresh", "view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze",
    "squeeze", "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "as_strided", "view_as_real",
    "view_as_complex", "_reshape_alias", "unfold", "diagonal", "narrow", "movedim", "reshape", "flatten",
    "unflatten", "_unsafe_split", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
    "_to_copy_noop", "set_", "resize_", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_has_compatible_shallow_copy_type", "_local_scalar_dense", "item", "arange", "zeros_like_noop",
})
"""Operators that run no memory-bound kernel: views and aliases, uninitialised allocations, metadata."""


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes an operator reads or writes for ``t``: its distinct elements (stride-0 broadcast dims once)."""
    if t.dim() == 0:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= int(size)
    return n * t.element_size()


def op_class(func: Any) -> str:
    """``"gemm"``, ``"attention"``, ``"view"`` or ``"memory"`` (a memory-bound kernel) for an ATen overload."""
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    base = name.rstrip("_") if name.endswith("_") and not name.startswith("_") else name
    if base in GEMM_OPS or name in GEMM_OPS:
        return "gemm"
    if any(m in name for m in ATTENTION_MARKERS):
        return "attention"
    if getattr(func, "is_view", False) or base in ALIAS_OPS or name in ALIAS_OPS:
        return "view"
    return "memory"


@dataclass
class Traffic:
    """Bytes of memory-bound kernels of one step, split by where they ran (bytes)."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    block_forward_bytes: int = 0
    block_backward_bytes: int = 0
    blocks: int = 0
    block_forward_ops: int = 0
    forward_kernels: int = 0
    backward_kernels: int = 0
    block_forward_kernels: int = 0
    conv_flops: int = 0
    nchw_conv_bytes: int = 0
    by_op: dict[str, int] = field(default_factory=dict)

    def per_block(self) -> tuple[float, float]:
        """(forward, backward) bytes of one repeated block (the mean over the blocks that ran)."""
        n = max(1, self.blocks)
        return self.block_forward_bytes / n, self.block_backward_bytes / n

    def ops_per_block(self) -> float:
        """ATen operators with a tensor output that one repeated block's forward dispatched (the mean)."""
        return self.block_forward_ops / max(1, self.blocks)

    def kernels_per_block(self) -> float:
        """Kernels (operators with a tensor output, views excluded) one repeated block's forward launched (the
        mean; 0 without blocks)."""
        return self.block_forward_kernels / max(1, self.blocks)


class TrafficCounter(TorchDispatchMode):
    """Adds the bytes of every memory-bound ATen operator dispatched while active (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.traffic = Traffic()
        self.backward = False
        self.in_block = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:  # metadata queries (prim.device, ...) run no kernel
            return out
        klass = op_class(func)
        tr = self.traffic
        if self.in_block and not self.backward:
            tr.block_forward_ops += 1
            tr.block_forward_kernels += klass != "view"
        if klass != "view":
            if self.backward:
                tr.backward_kernels += 1
            else:
                tr.forward_kernels += 1
        if klass == "gemm" and func.overloadpacket.__name__ in CONV_OPS:
            _count_convolution(tr, func.overloadpacket.__name__, args, outs)
        if klass != "memory":
            return out
        moved = sum(_tensor_bytes(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        moved += sum(_tensor_bytes(t) for t in outs)
        name = func.overloadpacket.__name__
        tr.by_op[name] = tr.by_op.get(name, 0) + moved
        if self.backward:
            tr.backward_bytes += moved
            if self.in_block:
                tr.block_backward_bytes += moved
        else:
            tr.forward_bytes += moved
            if self.in_block:
                tr.block_forward_bytes += moved
        return out


CONV_OPS: frozenset[str] = frozenset({"convolution", "convolution_backward"})
"""The ATen convolution operators every ``nn.ConvNd`` forward and backward dispatches."""


def _shape(t: Any) -> list[int]:
    return list(t.shape)


def _channels_first(t: Any) -> bool:
    """A 4-D or 5-D activation not laid out channels-last (its channels are not the innermost dimension; a layout
    both ways, e.g. one pixel, counts as channels-last: no transpose is needed)."""
    if not isinstance(t, torch.Tensor) or t.dim() not in (4, 5):
        return False
    fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return not t.is_contiguous(memory_format=fmt)


def _count_convolution(tr: Traffic, name: str, args: tuple[Any, ...], outs: list[torch.Tensor]) -> None:
    """A convolution's FLOPs and, on a channels-first activation, its activation bytes (module docstring)."""
    if name == "convolution":
        x, w, transposed = args[0], args[1], bool(args[6]) if len(args) > 6 else False
        tr.conv_flops += conv_flop_count(_shape(x), _shape(w), _shape(outs[0]), transposed=transposed)
        activations = [x, outs[0]]
    else:  # convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, ...)
        grad_out, x, w = args[0], args[1], args[2]
        tr.conv_flops += convolution_backward_flop(_shape(grad_out), _shape(x), _shape(w), *args[3:])
        activations = [grad_out, x] + ([outs[0]] if outs and outs[0].shape == x.shape else [])
    if _channels_first(activations[0]):
        tr.nchw_conv_bytes += sum(_tensor_bytes(t) for t in activations)


def _first_grad_tensor(value: Any) -> torch.Tensor | None:
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t
    return None


@contextlib.contextmanager
def block_attribution(blocks: list[nn.Module], counter: TrafficCounter) -> Iterator[None]:
    """Mark the counter ``in_block`` during each block's forward and during its backward (module docstring)."""
    handles: list[Any] = []

    def enter_backward(grad: torch.Tensor) -> None:
        counter.in_block += 1

    def leave_backward(grad: torch.Tensor) -> None:
        counter.in_block = max(0, counter.in_block - 1)

    def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        counter.in_block += 1
        counter.traffic.blocks += 1
        x = _first_grad_tensor((args, kwargs))
        if x is not None:
            x.register_hook(leave_backward)

    def post(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        counter.in_block = max(0, counter.in_block - 1)
        y = _first_grad_tensor(out)
        if y is not None:
            y.register_hook(enter_backward)

    for b in blocks:
        handles.append(b.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(b.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
