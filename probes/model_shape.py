"""The transformer shape of a model read from its config (``model.config``, ``model.cfg``... or the model's own
attributes): hidden size, layers, heads, key-value heads, vocabulary, maximum positions, MLP width, gating, per-head
width and multi-head latent attention (DeepSeek-V2/V3 config keys), and the rotary base and normalisation epsilon
(numerics the Megatron export passes on). Units: widths and counts (elements).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from optplan.estimators.attention import MlaShape
from optplan.estimators.profile import TransformerShape

if TYPE_CHECKING:  # blocks.py imports moe_layers.py, which reads its integers with read_int below
    from optplan.probes.blocks import BlockInfo

_CONFIG_ATTRS = ("config", "cfg", "args", "params", "model_args", "hparams", "hp")
HIDDEN_NAMES = ("n_embd", "hidden_size", "dim", "d_model", "embed_dim", "n_embed", "hidden_dim")
LAYER_NAMES = ("n_layer", "num_hidden_layers", "n_layers", "num_layers")
HEAD_NAMES = ("n_head", "num_attention_heads", "n_heads", "num_heads")
KV_HEAD_NAMES = ("n_kv_heads", "num_key_value_heads", "n_kv_head", "num_kv_heads")
VOCAB_NAMES = ("vocab_size", "n_vocab", "padded_vocab_size")
FFN_NAMES = ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff")
GATE_NAMES = ("gate_proj", "w3", "gate_up_proj", "w13")
"""Names of the gate projection of a gated (SwiGLU/GeGLU) MLP: Llama/Mistral/Qwen (transformers), Meta's Llama."""
MAX_LEN_NAMES = ("block_size", "max_position_embeddings", "max_seq_len", "n_positions", "n_ctx",
                 "max_seq_length", "context_length", "max_len")


def config_sources(model: nn.Module) -> list[Any]:
    sources: list[Any] = []
    for attr in _CONFIG_ATTRS:
        obj = getattr(model, attr, None)
        if obj is not None and not isinstance(obj, (torch.Tensor, nn.Module)) and not callable(obj):
            sources.append(obj)
    sources.append(model)
    return sources


def read_int(sources: Iterable[Any], names: tuple[str, ...]) -> int | None:
    """The first positive int under one of ``names`` (mapping keys or attributes) of the first source that has one."""
    for src in sources:
        for name in names:
            value = src.get(name) if isinstance(src, Mapping) else getattr(src, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


ROPE_THETA_NAMES = ("rope_theta", "rotary_base", "rope_base", "rotary_emb_base", "theta")
NORM_EPS_NAMES = ("norm_eps", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "rms_norm_epsilon")


def read_float(sources: Iterable[Any], names: tuple[str, ...]) -> float | None:
    """The first positive number under one of ``names`` of the first source that has one; transformers 5 keeps the
    rotary base in ``rope_parameters`` (a mapping), which is searched after the source itself."""
    for src in sources:
        nested = src.get("rope_parameters") if isinstance(src, Mapping) else getattr(src, "rope_parameters", None)
        for where in (src, nested) if isinstance(nested, Mapping) else (src,):
            for name in names:
                value = where.get(name) if isinstance(where, Mapping) else getattr(where, name, None)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                    return float(value)
    return None


def max_positions(model: nn.Module) -> int | None:
    """The model's maximum sequence length when a config attribute names it, else None."""
    return read_int(config_sources(model), MAX_LEN_NAMES)


def read_transformer_shape(model: nn.Module, block: BlockInfo | None) -> TransformerShape | None:
    """TransformerShape from common config attribute names (on ``model.config`` etc. or the model); the MLP is
    gated when a block has a gate projection (:data:`GATE_NAMES`)."""
    sources = config_sources(model)
    hidden = read_int(sources, HIDDEN_NAMES)
    heads = read_int(sources, HEAD_NAMES)
    layers = read_int(sources, LAYER_NAMES) or (len(block.blocks) if block else None)
    if hidden is None or heads is None or layers is None:
        return None
    gated = block is not None and bool(block.blocks) and any(
        name.rpartition(".")[2] in GATE_NAMES for name, _ in block.blocks[0].named_modules())
    mla = _read_mla(sources)
    head_dim = read_int(sources, ("head_dim",))
    return TransformerShape(hidden=hidden, layers=layers, heads=heads,
                            kv_heads=None if mla else read_int(sources, KV_HEAD_NAMES),
                            vocab=read_int(sources, VOCAB_NAMES),
                            max_seq_len=read_int(sources, MAX_LEN_NAMES), ffn=read_int(sources, FFN_NAMES),
                            gated=gated, mla=mla,
                            head_dim=head_dim if mla is None and head_dim and head_dim * heads != hidden else None,
                            rope_theta=read_float(sources, ROPE_THETA_NAMES),
                            norm_eps=read_float(sources, NORM_EPS_NAMES))


def _read_mla(sources: list[Any]) -> MlaShape | None:
    """Multi-head latent attention's widths from DeepSeek-V2/V3 config keys (``kv_lora_rank``, ``q_lora_rank``,
    ``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim``), or None."""
    kv_lora = read_int(sources, ("kv_lora_rank",))
    nope, v = read_int(sources, ("qk_nope_head_dim",)), read_int(sources, ("v_head_dim",))
    if kv_lora is None or nope is None or v is None:
        return None
    return MlaShape(kv_lora=kv_lora, q_lora=read_int(sources, ("q_lora_rank",)),
                    rope_dim=read_int(sources, ("qk_rope_head_dim",)) or 0, nope_dim=nope, v_dim=v)
