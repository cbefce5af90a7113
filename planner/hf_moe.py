"""Mixture-of-Experts Hugging Face configs (``--hf``) as --arch shapes: profiled by formula, not by a fake-tensor run.

Why not the usual profile: transformers 5 runs experts through ``torch._grouped_mm`` (16-bit inputs only, so the
fp32 profiling pass fails) or an eager per-expert loop whose shapes depend on the routing (a fake tensor has no
data to route by). The formula profile (estimators/arch.py, estimators/moe.py) prices the routed tokens of a
balanced router exactly for the families whose layouts it knows; its parameter counts are checked against the
models transformers builds from the same configs (tests/probes/test_moe_arch_hf.py, test_hf_moe.py).

Config keys read (transformers' ``MixtralConfig``, ``DeepseekV2Config``, ``DeepseekV3Config``, ``Qwen3MoeConfig``):
layers, hidden,
heads, kv heads, ``intermediate_size`` (the dense MLP; Mixtral's expert width), ``vocab_size``,
``tie_word_embeddings``; experts ``num_local_experts`` / ``n_routed_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, ``n_shared_experts``, ``first_k_dense_replace``, ``moe_layer_freq``; multi-head
latent attention ``kv_lora_rank``, ``q_lora_rank``, ``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim``;
Qwen3-MoE ``head_dim``, ``decoder_sparse_step`` (every n-th layer sparse), ``mlp_only_layers`` (dense layers: only
a leading run of them, which is ``first_dense``) and its per-head query/key RMSNorms (``qk_norm``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from optplan.estimators.arch import ArchSpec, parse_arch
from optplan.estimators.errors import OptplanError

EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts")
"""Config keys that mark an MoE model (any of them set above 1)."""
SUPPORTED_MOE_TYPES = ("mixtral", "deepseek_v2", "deepseek_v3", "qwen3_moe")
"""model_type values whose layout the formula knows exactly."""


def is_moe_config(doc: dict[str, Any]) -> bool:
    return any(isinstance(doc.get(k), int) and doc[k] > 1 for k in EXPERT_KEYS)


def read_config(config_path: str) -> dict[str, Any]:
    doc = json.loads(Path(config_path).read_text(encoding="utf-8"))
    return doc.get("text_config") if isinstance(doc.get("text_config"), dict) else doc


def moe_arch(doc: dict[str, Any], seq_len: int | None, spec: str) -> ArchSpec:
    """The --arch shape of an MoE config (OptplanError, one line, for a family the formula does not know)."""
    kind = doc.get("model_type")
    if kind not in SUPPORTED_MOE_TYPES:
        raise OptplanError(f"--hf {spec}: {kind} is a Mixture-of-Experts model whose layer layout optplan does not "
                           f"know yet (known: {', '.join(SUPPORTED_MOE_TYPES)}): describe it with --arch ...,experts=E,"
                           "topk=K,moe_ffn=F,shared_experts=S,first_dense=D")
    get = doc.get
    fields: dict[str, Any] = {
        "layers": get("num_hidden_layers"), "hidden": get("hidden_size"), "heads": get("num_attention_heads"),
        "kv_heads": get("num_key_value_heads"), "ffn": get("intermediate_size"), "vocab": get("vocab_size"),
        "gated": 1, "tied": int(bool(get("tie_word_embeddings", False))),
        "experts": next(get(k) for k in EXPERT_KEYS if isinstance(get(k), int) and get(k) > 1),
        "topk": get("num_experts_per_tok"),
    }
    if kind == "mixtral":
        fields["moe_ffn"] = get("intermediate_size")
    elif kind == "qwen3_moe":
        dense = sorted(get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise OptplanError(f"--hf {spec}: mlp_only_layers {dense} are not the first layers, which is the only dense "
                               "layout optplan knows (first_dense): describe the model with --arch")
        if get("attention_bias"):
            raise OptplanError(f"--hf {spec}: attention_bias=true (biases on q/k/v/o) is not in optplan's Qwen3-MoE "
                               "layout: describe the model with --arch")
        fields.update(moe_ffn=get("moe_intermediate_size"), head_dim=get("head_dim"), qk_norm=1,
                      moe_every=get("decoder_sparse_step") or 1, first_dense=len(dense))
    else:
        fields.update(moe_ffn=get("moe_intermediate_size"), shared_experts=get("n_shared_experts") or 0,
                      first_dense=get("first_k_dense_replace") or 0, moe_every=get("moe_layer_freq") or 1,
                      kv_lora=get("kv_lora_rank"), q_lora=get("q_lora_rank"), rope_dim=get("qk_rope_head_dim"),
                      nope_dim=get("qk_nope_head_dim"), v_dim=get("v_head_dim"))
        fields["kv_heads"] = None  # MLA: every head has its own keys and values from the latent
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "experts", "topk", "moe_ffn")
               if not isinstance(fields.get(k), int)]
    if missing:
        raise OptplanError(f"--hf {spec}: the {kind} config lacks {', '.join(missing)}: pass a complete config.json")
    text = ",".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    return parse_arch(text, seq_len=seq_len)
