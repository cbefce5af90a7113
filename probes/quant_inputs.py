"""What a bitsandbytes-quantised base would keep beyond the profiled activations: the inputs of its layers.

bitsandbytes keeps the input of a quantised layer on the layer's autograd node (``MatMul8bitLt`` always;
``MatMul4Bit`` before 0.43.2), not through ``save_for_backward`` (estimators/finetune.py says when that costs
memory). The profile holds the base in 16 bits, so these bytes are measured here, in one forward of the adapted
model on fake tensors, per repeated block:

- every distinct tensor entering a quantisable layer of the block (the ``nn.Linear`` layers a bitsandbytes
  quantiser replaces; peft's ``base_layer`` inside an adapted one); layers that read one tensor (q/k/v, gate/up)
  count it once: ``quant_input_elements``;
- the part of those that autograd does not keep anyway (no saved tensor is the input or a view of it, seen through
  ``torch.autograd.graph.saved_tensors_hooks``): ``quant_input_unkept_elements``. Without LoRA dropout an adapted
  layer's ``lora_A`` keeps its input; with dropout it keeps the dropped copy instead.

The block measured is the last of the model given (two blocks: the second block's input requires grad, as in every
block of a LoRA model after the first, where the frozen embedding's output does not).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from optplan.estimators.finetune import bnb_version_keeps_4bit_inputs
from optplan.probes.adapters import LORA_MARK, is_linear

__all__ = ["bnb_keeps_4bit_inputs_here", "quant_input_elements"]


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor a view was made from (itself when not a view)."""
    while t._base is not None:
        t = t._base
    return t


def quant_input_elements(block: nn.Module, run_step: Callable[[], int]) -> tuple[int, int]:
    """(all, unkept) elements per token of the distinct inputs of ``block``'s quantisable layers (module docstring).

    ``run_step()`` runs forward and loss of the model holding ``block`` (autograd recording) and returns the tokens
    of the batch (the sample count for models without tokens); the graph is dropped when it returns."""
    inputs: dict[int, torch.Tensor] = {}
    saved_roots: set[int] = set()
    held: list[torch.Tensor] = []  # keeps saved tensors alive, so no id is reused while counting

    def pre_hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
        if first is not None and first.is_floating_point():
            inputs.setdefault(id(first), first)

    def pack(t: torch.Tensor) -> torch.Tensor:
        held.append(t)
        saved_roots.add(id(_root(t)))
        return t

    handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for n, m in block.named_modules()
               if is_linear(m) and LORA_MARK not in n]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            tokens = max(1, int(run_step()))
    finally:
        for h in handles:
            h.remove()
    every = sum(t.numel() for t in inputs.values())
    unkept = sum(t.numel() for key, t in inputs.items() if id(_root(t)) not in saved_roots and key not in saved_roots)
    held.clear()
    return every // tokens, unkept // tokens


def bnb_keeps_4bit_inputs_here() -> bool:
    """Whether the bitsandbytes installed here keeps each 4-bit layer's input (a version before 0.43.2); False for a
    current one or none installed (the launch then installs a current one)."""
    try:
        version = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return False
    return bnb_version_keeps_4bit_inputs(version)
