"""A tiny Hugging Face Llama saved to disk with random weights, a word-level tokenizer and a jsonl dataset: what the
fine-tuning export tests train and load (no download). Imported as ``from hf_models import ...`` (tests/ is on
sys.path through tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 300, "max_position_embeddings": 128, "tie_word_embeddings": False}


def save_tiny_llama(root: Path) -> Path:
    """``root/model`` (weights, config, tokenizer) and ``root/data.jsonl`` (16 lines of 40 words); returns root."""
    import tokenizers
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    model.save_pretrained(root / "model")
    vocab = {f"w{i}": i for i in range(298)} | {"<unk>": 298, "<eos>": 299}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                         pad_token="<eos>").save_pretrained(root / "model")
    lines = [json.dumps({"text": " ".join(f"w{(i * 7 + j) % 298}" for j in range(40))}) for i in range(16)]
    (root / "data.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root
