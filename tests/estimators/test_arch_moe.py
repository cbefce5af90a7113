"""MoE and multi-head-latent-attention shapes from --arch: exact parameter counts, FLOPs by routed tokens, and the
bad-input lines."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import arch_param_numels, arch_params, parse_arch, profile_from_arch
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy

MIXTRAL_8X7B = ("layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000,gated=1,tied=0,experts=8,topk=2,"
                "seq=4096")
DEEPSEEK_V2_LITE = ("layers=27,hidden=2048,heads=16,ffn=10944,vocab=102400,gated=1,tied=0,kv_lora=512,rope_dim=64,"
                    "nope_dim=128,v_dim=128,experts=64,topk=6,moe_ffn=1408,shared_experts=2,first_dense=1,seq=4096")


def test_mixtral_8x7b_is_exact() -> None:
    """46,702,792,704 (Mistral AI's published count). By hand: attention 2·4096² + 2·1024·4096, 8 experts of
    3·4096·14336, router 4096·8, two norms, per layer; 32 layers; untied 32000 x 4096 embedding and head; final
    norm."""
    layer = 2 * 4096**2 + 2 * 1024 * 4096 + 8 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096
    assert arch_params(parse_arch(MIXTRAL_8X7B))[0] == 32 * layer + 2 * 32000 * 4096 + 4096 == 46_702_792_704


def test_deepseek_v2_lite_is_exact() -> None:
    """15,706,484,224: what transformers' DeepseekV2ForCausalLM holds for DeepSeek-V2-Lite's config (MLA with
    kv_lora_rank 512, 64 routed experts of 1408 + 2 shared, top-6, the first layer dense); the probe tests build it
    (tests/probes/test_moe_arch_hf.py)."""
    assert arch_params(parse_arch(DEEPSEEK_V2_LITE))[0] == 15_706_484_224


@pytest.mark.parametrize("text", [MIXTRAL_8X7B, DEEPSEEK_V2_LITE,
                                  "layers=6,hidden=64,heads=4,experts=4,topk=1,moe_every=2,seq=32"])
def test_tensor_list_sums_to_the_parameters(text: str) -> None:
    spec = parse_arch(text)
    assert sum(arch_param_numels(spec)) == arch_params(spec)[0] == profile_from_arch(spec).params


def test_flops_count_the_routed_experts_only() -> None:
    """Forward FLOPs per token: 2 x the parameters a token multiplies by (the 2 of 8 experts it is routed to, the
    router, attention, the head; not the input embedding) + 4·L·h·s for attention scores (PaLM Appendix B)."""
    spec = parse_arch(MIXTRAL_8X7B)
    prof = profile_from_arch(spec)
    expert = 3 * 4096 * 14336
    active = prof.params - 32000 * 4096 - 32 * 6 * expert
    assert prof.fwd_flops_per_sample == (2 * active + 4 * 32 * 4096 * 4096) * 4096
    assert round(active / 1e9, 2) == 12.75  # Mistral's "12.9B active" counts the input embedding too
    assert prof.transformer is not None and prof.transformer.ffn == 2 * 14336  # the active width
    dense = profile_from_arch(parse_arch(MIXTRAL_8X7B.replace(",experts=8,topk=2", "").replace("ffn=14336", "ffn=28672")))
    # activations of the sparse model: the dense model's at the active width + router and dispatch bytes
    extra = (8 * 8 + 2 * 4096 * 2) * 4096 * 32  # fp32 router logits/probabilities + 2 bf16 token copies
    assert prof.activation("bf16", "none").per_sample_bytes - dense.activation("bf16", "none").per_sample_bytes == \
        extra


def test_a_moe_plan_prices_every_expert_and_fits_where_the_states_fit() -> None:
    prof = profile_from_arch(parse_arch(MIXTRAL_8X7B))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8)
    est = estimate(prof, cluster, Strategy(precision="bf16", zero=3, dp=64, mbs=1, checkpointing="full"))
    # ZeRO-3 over 64 GPUs: 16 bytes x 46.7B parameters / 64 = 10.9 GiB of model states per GPU
    states = est.memory.params_bytes + est.memory.grads_bytes + est.memory.optimizer_bytes
    assert states == pytest.approx(16 * 46_702_792_704 / 64, rel=0.02)
    assert any("MoE" in n for n in prof.notes)


@pytest.mark.parametrize(("text", "message"), [
    ("layers=2,hidden=64,heads=4,experts=4,topk=5", "topk 5 is more than the 4 experts"),
    ("layers=2,hidden=64,heads=4,topk=2", "add experts=E and topk=K"),
    ("layers=2,hidden=64,heads=4,experts=4", "needs topk=K"),
    ("layers=2,hidden=64,heads=4,experts=4,topk=1,first_dense=2", "no layer is sparse"),
    ("layers=2,hidden=64,heads=4,nope_dim=16,gated=1", "add kv_lora=R"),
    ("layers=2,hidden=64,heads=4,kv_lora=16", "add gated=1"),
])
def test_bad_moe_shapes_are_one_line(text: str, message: str) -> None:
    with pytest.raises(OptplanError, match=message) as info:
        parse_arch(text)
    assert "\n" not in str(info.value)


def test_attention_core_flops_follow_the_head_widths() -> None:
    """QK^T and AV cost 2·s·a·(d_qk + d_v) per token forward: 4·h·s at d = h / heads; Qwen3-style 64 heads of 128
    on hidden 4096 doubles it; MLA uses its (nope + rope) and v widths."""
    base = "layers=2,hidden=4096,heads=64,kv_heads=4,ffn=1536,vocab=1000,gated=1,tied=0,seq=4096"
    plain, wide = profile_from_arch(parse_arch(base)), profile_from_arch(parse_arch(base + ",head_dim=128"))
    extra_params = arch_params(parse_arch(base + ",head_dim=128"))[0] - arch_params(parse_arch(base))[0]
    core = 2 * 2 * 64 * (128 + 128) * 4096 - 2 * 2 * 64 * (64 + 64) * 4096  # per token, both layers
    assert wide.fwd_flops_per_sample - plain.fwd_flops_per_sample == (2 * extra_params + core) * 4096
    mla = profile_from_arch(parse_arch(DEEPSEEK_V2_LITE))
    assert mla.transformer is not None and mla.transformer.core_head_dims() == (192.0, 128.0)
