"""probes/trainloop.py (also the exported train.py): a plan's ``compile`` compiles each repeated block, as
torchtitan does and as optplan prices it (fused elementwise kernels); the probe's whole-model option stays."""

from __future__ import annotations

import torch
from torch import nn

from optplan.probes.trainloop import Trainer


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.fc(x))


def _model() -> nn.Module:
    return nn.Sequential(Block(), Block(), nn.Linear(8, 2))


def _compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def test_the_plans_compile_compiles_each_block_after_checkpointing() -> None:
    trainer = Trainer({"engine": "torch", "precision": "fp32", "checkpointing": "full", "compile": True},
                      block_class="Block")
    model = _model()
    trainer.setup_training(model, trainer.setup_device())
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert trainer.compiled_blocks and all(_compiled(b) for b in blocks)
    assert not _compiled(model) and trainer.runner is model
    assert trainer.checkpointing_applied == "full"  # the checkpointed forward is what each block compiles


def test_without_blocks_or_by_the_probes_option_the_whole_model_compiles() -> None:
    trainer = Trainer({"engine": "torch", "precision": "fp32"}, compile=True)
    model = _model()
    trainer.setup_training(model, trainer.setup_device())
    assert not trainer.compiled_blocks and _compiled(model)


def test_eager_plans_compile_nothing() -> None:
    trainer = Trainer({"engine": "torch", "precision": "fp32", "compile": False}, block_class="Block")
    model = _model()
    trainer.setup_training(model, trainer.setup_device())
    assert not any(_compiled(m) for m in model.modules())
