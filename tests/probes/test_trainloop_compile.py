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


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.block = Block()
        self.head = nn.Linear(8, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids)))


def _lm_loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), torch.roll(batch, -1, 1).flatten())


def _first_loss(strategy: dict[str, object]) -> tuple[Trainer, float]:
    trainer = Trainer(strategy, block_class="Block")
    torch.manual_seed(0)
    model = TinyLM()
    trainer.setup_training(model, trainer.setup_device())
    trainer.loss_fn = _lm_loss
    torch.manual_seed(1)
    batch = torch.randint(0, 64, (2, 16))
    return trainer, float(trainer.one_step(lambda _i: batch))


def test_a_compiled_plan_compiles_the_loss_function_too_unless_the_plan_says_eager() -> None:
    base = {"engine": "torch", "precision": "amp-bf16", "checkpointing": "full"}  # CPU autocast stand-in included
    eager, eager_loss = _first_loss({**base, "compile": False})
    assert not eager.compiles_loss and eager.compiled_loss_fn is None
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled, compiled_loss = _first_loss({**base, "compile": True})
    assert compiled.compiles_loss and compiled.compiled_loss_fn is not None
    # Inductor compiled graphs (the blocks' and the loss's), not an eager fallback
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= graphs + 2
    assert any("loss function runs compiled" in n for n in compiled.notes)
    assert abs(compiled_loss - eager_loss) < 1e-2 * abs(eager_loss)  # the same loss, computed by Inductor's kernels
    blocks_only, _ = _first_loss({**base, "compile": True, "compile_loss": False})
    assert blocks_only.compiled_blocks and blocks_only.compiled_loss_fn is None
    torch._dynamo.reset()  # the loss's code was compiled above: compile it afresh
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    loss_only, _ = _first_loss({**base, "compile": False, "compile_loss": True})
    assert not loss_only.compiled_blocks and loss_only.compiled_loss_fn is not None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= graphs + 1  # the loss's own graph
    probe_option = Trainer({**base, "compile": False}, compile=True)  # the probe's whole-model option
    assert not probe_option.compiles_loss
