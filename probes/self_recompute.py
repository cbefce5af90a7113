"""What a model's own activation checkpointing re-runs: the forward FLOPs its backward recomputes.

A model file may call ``torch.utils.checkpoint`` in its own forward (nanoGPT forks, ``transformers`` models after
``gradient_checkpointing_enable()``, Lightning modules): then its backward re-runs those modules' forwards, and
``FlopCounterMode`` counts them among the backward's FLOPs. Those are hardware FLOPs, not model FLOPs: MFU
(Chowdhery et al. 2022, PaLM, Appendix B: "model FLOPs utilization" excludes rematerialisation) must leave them out
and the step time must price them as recompute. Both checkpoint flavours recompute by calling the checkpointed
function again from inside ``backward`` (non-reentrant: the saved-tensor unpack hook; reentrant:
``CheckpointFunction.backward``), so a module ``forward`` that starts while backward runs is a recompute:
:func:`module_reruns` counts the FLOPs a ``FlopCounterMode`` sees between the outermost such module's
``forward`` start and end (global module hooks, torch.nn.modules.module ``register_module_forward_pre_hook`` /
``register_module_forward_hook``).

A checkpointed plain function that calls no ``nn.Module`` (``checkpoint(torch.nn.functional.gelu, x)``) is not
seen: its FLOPs stay in the backward's count. Units: FLOPs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.flop_counter import FlopCounterMode


@dataclass
class Reruns:
    """The FLOPs counted inside module forwards that ran during backward (FLOPs), and how many outermost such
    forwards there were."""

    flops: int = 0
    calls: int = 0


@contextlib.contextmanager
def module_reruns(counter: FlopCounterMode) -> Iterator[Reruns]:
    """While active (wrap a ``backward`` call, inside ``counter``), the FLOPs ``counter`` counts inside module
    forwards, the outermost ones only (module docstring)."""
    found = Reruns()
    depth = 0
    start = 0

    def pre(_module: nn.Module, _args: Any) -> None:
        nonlocal depth, start
        if depth == 0:
            start = counter.get_total_flops()
        depth += 1

    def post(_module: nn.Module, _args: Any, _output: Any) -> None:
        nonlocal depth
        depth = max(0, depth - 1)
        if depth == 0:
            found.flops += counter.get_total_flops() - start
            found.calls += 1

    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post, always_call=True)]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


__all__ = ["Reruns", "module_reruns"]
