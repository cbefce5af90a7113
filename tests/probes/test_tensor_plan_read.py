"""Reading a Hugging Face model's own tensor-parallel plan on the meta device, and carrying it into the profile."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optplan.probes.tensor_plan import read_tensor_plan

transformers = pytest.importorskip("transformers")


def _llama(tie: bool, layers: int = 2) -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=8,
                                   num_hidden_layers=layers, num_key_value_heads=2, vocab_size=1000,
                                   tie_word_embeddings=tie)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("tie", [False, True])
def test_llama_plan_splits_everything_but_the_norms(tie: bool) -> None:
    model = _llama(tie)
    plan = read_tensor_plan(model)
    assert plan is not None
    total = sum(p.numel() for p in model.parameters())  # tied weights once
    norms = sum(m.weight.numel() for name, m in model.named_modules() if name.endswith("norm"))
    assert norms == (2 * 2 + 1) * 256
    assert plan.sharded_params == total - norms
    assert plan.gathers_logits  # lm_head: colwise_gather_output (every rank gets the whole logits)
    assert plan.replicated_grad_params == 1000 * 256  # the vocab-parallel embedding's gradient stays whole
    assert not plan.sequence_parallel
    assert plan.styles == dict(model.tp_plan)
    assert "LlamaForCausalLM" in plan.source


def test_row_parallel_bias_stays_whole() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(8, 32)
            self.down = nn.Linear(32, 8)

    class Model(nn.Module):
        tp_plan = {"layers.*.up": "colwise", "layers.*.down": "rowwise", "norm": "replicate"}

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])
            self.norm = nn.LayerNorm(8)

    plan = read_tensor_plan(Model())
    assert plan is not None
    per_block = (8 * 32 + 32) + 32 * 8  # up's weight and bias, down's weight; down's bias (8) is whole
    assert plan.sharded_params == 2 * per_block
    assert not plan.gathers_logits


def test_no_plan_or_a_plan_for_other_modules_is_none() -> None:
    assert read_tensor_plan(nn.Linear(4, 4)) is None

    class Stray(nn.Module):
        tp_plan = {"encoder.*.q": "colwise"}

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

    assert read_tensor_plan(Stray()) is None
