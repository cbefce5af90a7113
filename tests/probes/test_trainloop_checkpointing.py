"""probes/trainloop.py (also the exported train.py): which blocks the plan's checkpointing wraps: every block, the
first ``checkpoint_layers`` (partial checkpointing), or none here when accelerate's FSDP plugin wraps every block
itself (nesting two checkpoints would re-run each block's forward twice in backward)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch
from torch import nn

from optplan.probes.trainloop import Trainer


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.fc(x))


def _blocks(n: int = 4) -> list[Block]:
    return [Block() for _ in range(n)]


def _wrapped(blocks: list[Block]) -> list[bool]:
    return [isinstance(b.__dict__.get("forward"), partial) for b in blocks]


def _forward_calls(blocks: list[Block]) -> int:
    """Forward runs of the first block's Linear over one forward and backward through all the blocks."""
    calls = 0

    def count(*_: object) -> None:
        nonlocal calls
        calls += 1

    handle = blocks[0].fc.register_forward_hook(count)
    x = torch.randn(2, 8, requires_grad=True)
    for b in blocks:
        x = b(x)
    x.sum().backward()
    handle.remove()
    return calls


def test_every_block_or_the_first_n() -> None:
    every, first = _blocks(), _blocks()
    t = Trainer({"engine": "torch", "checkpointing": "full"}, block_class="Block")
    t.checkpoint_blocks(every, "full")  # type: ignore[arg-type]
    assert t.checkpointing_applied == "full" and _wrapped(every) == [True] * 4
    p = Trainer({"engine": "torch", "checkpointing": "full", "checkpoint_layers": 2}, block_class="Block")
    p.checkpoint_blocks(first, "full")  # type: ignore[arg-type]
    assert _wrapped(first) == [True, True, False, False]
    assert "the first 2 of 4 blocks" in " ".join(p.notes)
    assert _forward_calls(first) == 2 and _forward_calls(_blocks()) == 1  # checkpointed: forward, then recompute


def test_accelerates_fsdp_checkpointing_is_not_nested_with_the_loops() -> None:
    blocks = _blocks()
    t = Trainer({"engine": "torch", "checkpointing": "full", "fsdp": "full"}, block_class="Block", use_accelerate=True)
    t.accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(activation_checkpointing=True)))
    t.checkpoint_blocks(blocks, "full")  # type: ignore[arg-type]
    assert t.checkpointing_applied == "full" and _wrapped(blocks) == [False] * 4
    assert any("by accelerate" in n for n in t.notes)
    # partial checkpointing: accelerate.yaml leaves its switch off and the loop wraps the first blocks
    t.accelerator.state.fsdp_plugin.activation_checkpointing = False
    p = Trainer({"engine": "torch", "checkpointing": "full", "fsdp": "full", "checkpoint_layers": 1},
                block_class="Block", use_accelerate=True)
    p.accelerator = t.accelerator
    p.checkpoint_blocks(blocks, "full")  # type: ignore[arg-type]
    assert _wrapped(blocks) == [True, False, False, False]


def test_a_block_fed_a_list_its_caller_grows_recomputes_what_it_computed() -> None:
    """torchvision's DenseNet feeds each _DenseLayer the list of features its block appends to: the checkpoint kept
    the list object, so the recompute read the grown list ("running_mean should contain 1024 elements not 992").
    checkpointed_call passes a copy: gradients equal the plain step's."""
    import torch
    import torch.nn as nn

    from optplan.probes.trainloop import checkpointed_call

    class Layer(nn.Module):
        def __init__(self, c_in: int) -> None:
            super().__init__()
            self.lin = nn.Linear(c_in, 2)

        def forward(self, feats: list[torch.Tensor]) -> torch.Tensor:
            return self.lin(torch.cat(feats, 1))

    def run(checkpoint: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layers = [Layer(4 + 2 * i) for i in range(3)]
        feats = [torch.randn(5, 4, requires_grad=True)]
        for layer in layers:
            feats.append(checkpointed_call(layer.forward, None, feats) if checkpoint else layer(feats))
        torch.cat(feats, 1).square().sum().backward()
        return [p.grad for layer in layers for p in layer.parameters()]

    for plain, ckpt in zip(run(False), run(True), strict=True):
        assert torch.allclose(plain, ckpt)
