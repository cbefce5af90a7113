"""Profiles from a decoder shape (--arch) against hand counts and the published formulas."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import LOGIT_BYTES, arch_params, parse_arch, profile_from_arch
from optplan.estimators.errors import OptplanError


def test_gpt2_small_shape_counts_exactly() -> None:
    spec = parse_arch("layers=12,hidden=768,heads=12,vocab=50257,seq=1024")
    params, per_layer = arch_params(spec)
    assert params == 124_439_808  # nanoGPT GPT-2 small, measured by the static probe too
    L, h, s, V = 12, 768, 1024, 50257
    assert params == 12 * L * h * h + 13 * L * h + V * h + s * h + 2 * h  # Narayanan §3 + final norm


def test_flops_follow_palm_appendix_b() -> None:
    prof = profile_from_arch(parse_arch("layers=12,hidden=768,heads=12,vocab=50257,seq=1024"))
    n = prof.params - 1024 * 768
    per_token = 6 * n + 12 * 12 * 768 * 1024
    assert prof.train_flops_per_sample == pytest.approx(per_token * 1024)
    # within 0.2 % of the FlopCounterMode count of examples/gpt2.py (874.94 GFLOP per sample)
    assert prof.train_flops_per_sample == pytest.approx(874.94e9, rel=2e-3)


def test_activations_follow_korthikanti_table2() -> None:
    s, h, a, L, V = 2048, 4096, 32, 4, 51200
    flash = profile_from_arch(parse_arch(f"layers={L},hidden={h},heads={a},seq={s}"))
    logits = s * V * LOGIT_BYTES["bf16"]
    assert flash.activation("bf16", "none").per_sample_bytes == L * s * h * 34 + logits
    # the layer inputs, plus the larger of a layer's rerun and the loss: they are never held at once
    assert flash.activation("bf16", "full").per_sample_bytes == L * 2 * s * h + max(s * h * 34, logits)
    assert flash.activation("fp32", "full").per_sample_bytes == 2 * L * 2 * s * h + max(2 * s * h * 34, logits)
    spec = parse_arch(f"layers={L},hidden={h},heads={a},seq={s}").model_copy(update={"flash": False})
    math = profile_from_arch(spec)
    assert math.activation("bf16", "none").per_sample_bytes == round(L * s * h * (34 + 5 * a * s / h) + logits)


def test_gqa_and_ffn_change_the_count() -> None:
    base = arch_params(parse_arch("layers=1,hidden=512,heads=8,seq=16"))[1]
    gqa = arch_params(parse_arch("layers=1,hidden=512,heads=8,kv_heads=2,seq=16"))[1]
    assert base - gqa == 2 * 512 * (512 - 128) + 2 * (512 - 128)
    wide = arch_params(parse_arch("layers=1,hidden=512,heads=8,ffn=4096,seq=16"))[1]
    assert wide - base == 2 * 512 * (4096 - 2048) + (4096 - 2048)


@pytest.mark.parametrize(("text", "needle"), [
    ("layers=2,hidden=64", "needs heads"),
    ("layers=2,hidden=64,heads=3", "not divisible"),
    ("layers=2,hidden=64,heads=4,kv_heads=3", "not divisible by kv_heads"),
    ("layers=2,hidden=64,heads=4,depth=3", "unknown key 'depth'"),
    ("layers=two,hidden=64,heads=4", "not a number"),
    ("layers=2.5,hidden=64,heads=4", "not an integer"),
    ("layers=0,hidden=64,heads=4", "invalid --arch"),
    ("layers=2 hidden=64", "not a number"),
])
def test_bad_arch_is_a_one_line_error(text: str, needle: str) -> None:
    with pytest.raises(OptplanError, match=needle):
        parse_arch(text)


def test_seq_comes_from_seq_len_when_missing() -> None:
    assert parse_arch("layers=2,hidden=64,heads=4", seq_len=256).seq == 256
    with pytest.raises(OptplanError, match="sequence length"):
        profile_from_arch(parse_arch("layers=2,hidden=64,heads=4"))


@pytest.mark.parametrize(("text", "params"), [
    ("layers=16,hidden=2048,heads=32,kv_heads=8,ffn=8192,vocab=128256,gated=1", 1_235_814_400),
    ("layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0", 8_030_261_248),
    ("layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256,gated=1,tied=0", 70_553_706_496),
])
def test_gated_arch_counts_llama_parameters_exactly(text: str, params: int) -> None:
    """The counts of examples/llama.py's Llama 3 1B/8B/70B (and of Meta's published shapes)."""
    prof = profile_from_arch(parse_arch(text, seq_len=4096))
    assert prof.params == params
    shape = prof.transformer
    assert shape is not None and shape.gated and shape.kv_dim == shape.hidden * 8 // shape.heads
    h, f = shape.hidden, shape.ffn
    per_token = 12 * h + 4 * shape.kv_dim + 8 * f
    none = prof.activation("bf16", "none")
    assert none.per_sample_bytes == 4096 * (shape.layers * per_token + 128256 * LOGIT_BYTES["bf16"])


def test_gpt_layer_bytes_reduce_to_korthikanti_34() -> None:
    prof = profile_from_arch(parse_arch("layers=2,hidden=1024,heads=16,seq=128"))
    assert prof.transformer.layer_bytes_per_token() == 34 * 1024  # type: ignore[union-attr]
    assert prof.transformer.replicated_bytes_per_token() == 10 * 1024  # type: ignore[union-attr]


@pytest.mark.parametrize("text", ["layers=3,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=100,seq=16",
                                  "layers=2,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=100,seq=16,gated=1,tied=0"])
def test_arch_param_numels_sum_to_the_parameters(text: str) -> None:
    prof = profile_from_arch(parse_arch(text))
    assert sum(prof.param_numels) == prof.params


def test_rotary_base_and_norm_epsilon_are_carried_not_priced() -> None:
    base = "layers=2,hidden=64,heads=4,gated=1,seq=128"
    plain = profile_from_arch(parse_arch(base))
    stated = profile_from_arch(parse_arch(base + ",rope_theta=5e5,norm_eps=1e-6"))
    assert stated.transformer is not None and plain.transformer is not None
    assert (stated.transformer.rope_theta, stated.transformer.norm_eps) == (5e5, 1e-6)
    assert (plain.transformer.rope_theta, plain.transformer.norm_eps) == (None, None)
    assert stated.params == plain.params and stated.fwd_flops_per_sample == plain.fwd_flops_per_sample
    with pytest.raises(OptplanError, match="norm_eps=inf is not a finite number"):
        parse_arch(base + ",norm_eps=inf")
    with pytest.raises(OptplanError, match="heads=4.5 is not an integer"):
        parse_arch("layers=2,hidden=64,heads=4.5")
