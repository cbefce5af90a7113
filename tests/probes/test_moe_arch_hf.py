"""--arch MoE and MLA shapes against the models transformers builds from the same configs (meta device): the
parameter counts and tensor sizes match exactly."""

from __future__ import annotations

import pytest
import torch

from optplan.estimators.arch import arch_params, arch_small_param_counts, parse_arch
from optplan.probes.model_census import small_param_counts

transformers = pytest.importorskip("transformers")


def _count(config: object) -> tuple[int, object]:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()), model


def test_mixtral_shape_matches_transformers() -> None:
    cfg = transformers.MixtralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                     num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                                     num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    spec = parse_arch("layers=3,hidden=256,heads=8,kv_heads=2,ffn=512,vocab=1000,gated=1,tied=0,experts=4,topk=2")
    total, model = _count(cfg)
    assert arch_params(spec)[0] == total
    # the tensors of everything but the experts are the same; transformers 5 fuses a layer's experts into 3-D
    # tensors where --arch lists one per expert (Megatron-Core's grouped MLP keeps a weight per expert)
    ours, theirs = arch_small_param_counts(spec), small_param_counts(model)
    assert {k: v for k, v in ours.items() if k != 512 * 256} == {k: v for k, v in theirs.items() if k != 4 * 512 * 256}


def test_deepseek_v2_lite_matches_transformers() -> None:
    """DeepSeek-V2-Lite's published config (15.7B): MLA, 64 routed + 2 shared experts of 1408, top-6, layer 0
    dense."""
    cfg = transformers.DeepseekV2Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
        first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, tie_word_embeddings=False)
    spec = parse_arch("layers=27,hidden=2048,heads=16,ffn=10944,vocab=102400,gated=1,tied=0,kv_lora=512,rope_dim=64,"
                      "nope_dim=128,v_dim=128,experts=64,topk=6,moe_ffn=1408,shared_experts=2,first_dense=1")
    total, _ = _count(cfg)
    assert arch_params(spec)[0] == total == 15_706_484_224


def test_q_lora_matches_transformers() -> None:
    """DeepSeek-V2/V3's query bottleneck (q_lora_rank) with its RMSNorm."""
    cfg = transformers.DeepseekV2Config(
        vocab_size=500, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=32,
        qk_nope_head_dim=32, tie_word_embeddings=False)
    spec = parse_arch("layers=3,hidden=128,heads=4,ffn=256,vocab=500,gated=1,tied=0,kv_lora=32,q_lora=48,rope_dim=16,"
                      "nope_dim=32,v_dim=32,experts=8,topk=2,moe_ffn=64,shared_experts=1,first_dense=1")
    assert arch_params(spec)[0] == _count(cfg)[0]


def test_head_dim_matches_transformers() -> None:
    """A head width other than hidden / heads (Gemma: 4 heads of 64 on hidden 128, one key-value head)."""
    cfg = transformers.GemmaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=1,
                                   head_dim=64, num_hidden_layers=2, vocab_size=500)
    spec = parse_arch("layers=2,hidden=128,heads=4,kv_heads=1,head_dim=64,ffn=256,vocab=500,gated=1,tied=1")
    assert arch_params(spec)[0] == _count(cfg)[0]


def test_qwen3_moe_matches_transformers() -> None:
    """Qwen3-MoE: per-head query/key RMSNorms (qk_norm), its own head width, experts without shared ones; read from
    the config as --hf does (planner/hf_moe.py)."""
    from optplan.planner.hf_moe import moe_arch

    cfg = transformers.Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                                      vocab_size=500, num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    spec = moe_arch(cfg.to_dict(), None, "qwen3-moe")
    assert (spec.qk_norm, spec.head_dim, spec.experts, spec.topk, spec.moe_ffn) == (True, 48, 8, 2, 64)
    total, _ = _count(cfg)
    assert arch_params(spec)[0] == total == 943_264
    # the published Qwen3-30B-A3B shape (config.json: 48 layers, hidden 2048, 32/4 heads of 128, 128 experts of
    # 768, top-8, vocab 151,936, untied): 30,532,122,624 parameters
    big = transformers.Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                      num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                      head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                                      tie_word_embeddings=False)
    assert arch_params(moe_arch(big.to_dict(), None, "qwen3-30b-a3b"))[0] == _count(big)[0] == 30_532_122_624


def test_qwen3_moe_layouts_optplan_does_not_know_are_one_line() -> None:
    from optplan.estimators.errors import OptplanError
    from optplan.planner.hf_moe import moe_arch

    doc = transformers.Qwen3MoeConfig(num_hidden_layers=4, mlp_only_layers=[1, 3]).to_dict()
    with pytest.raises(OptplanError, match="not the first layers"):
        moe_arch(doc, None, "odd")
    leading = moe_arch(transformers.Qwen3MoeConfig(num_hidden_layers=4, mlp_only_layers=[0]).to_dict(), None, "ok")
    assert leading.first_dense == 1
