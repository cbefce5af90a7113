"""Dense Hugging Face causal LMs built from configs in a model file: profiled in every checkpointing mode.

transformers 5's GPT-2 passes its generation cache (a ``DynamicCache``, on by default) to each block by position and
its attention appends to it whatever ``use_cache`` says, so a checkpointed block's recompute appended the keys a
second time: selective checkpointing failed the whole profile ("aten.slice.Tensor encountered during backward but
not found in storage"). ``checkpointed_call`` drops a cache passed by position as it drops one passed by keyword.
"""

from __future__ import annotations

import pytest
import torch

from optplan.probes.contract import load_contract
from optplan.probes.static import profile_contract
from optplan.probes.trainloop import checkpointed_call, is_generation_cache, selective_context

transformers = pytest.importorskip("transformers")

GPT2 = """
    from transformers import GPT2Config, GPT2LMHeadModel
    OPTPLAN = {"seq_len": 64}

    def build_model():
        return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=128, n_head=4, vocab_size=2048, n_positions=64))
    """
LLAMA = """
    from transformers import LlamaConfig, LlamaForCausalLM
    OPTPLAN = {"seq_len": 64}

    def build_model():
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, hidden_size=128, intermediate_size=256,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                                            max_position_embeddings=64))
    """


@pytest.mark.parametrize(("source", "block"), [(GPT2, "GPT2Block"), (LLAMA, "LlamaDecoderLayer")])
def test_hf_causal_lm_profiles_with_every_checkpointing_mode(write_model, source, block):
    profile = profile_contract(load_contract(write_model(source)))
    assert profile.repeated_block is not None and profile.repeated_block.class_name == block
    assert profile.repeated_block.count == 3 and profile.profiled_blocks == 2
    for precision in ("fp32", "bf16"):
        none, sel, full = (profile.activation(precision, c).bytes_at(4) for c in ("none", "selective", "full"))
        assert none > sel > full > 0, (precision, none, sel, full)


def test_a_cache_passed_by_position_is_dropped_under_checkpointing():
    from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    cache = DynamicCache(config=config)
    assert is_generation_cache(cache) and not is_generation_cache(torch.zeros(1)) and not is_generation_cache(None)
    model = GPT2LMHeadModel(config)
    block = model.transformer.h[0]
    seen: list[object] = []
    forward = block.forward

    def spy(*args, **kwargs):
        seen.append(args[1] if len(args) > 1 else kwargs.get("cache"))
        return forward(*args, **kwargs)

    x = torch.randn(2, 16, 32, requires_grad=True)
    out = checkpointed_call(spy, selective_context(), x, cache, None, None, use_cache=True)
    out.sum().backward()  # the recompute runs the forward's operators: no "not found in storage"
    assert seen == [None, None] and cache.get_seq_length() == 0 and x.grad is not None
