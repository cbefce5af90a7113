"""Selective recomputation on the torch and DeepSpeed engines is the training loop's op-level policy, which the
profile measures (``selective`` fits); Megatron's (the attention core only) and profiles made before that
measurement keep the unrecomputed fit."""

from __future__ import annotations

from optplan.estimators.activations import activation_bytes, fit_mode
from optplan.estimators.profile import ActivationFit
from optplan.estimators.strategy import Strategy
from tests.factories import make_profile

SELECTIVE_PER_SAMPLE = 12 * 768 * 1024 * 12
"""A selective fit between the factory's full (2·h + one layer) and none (34·h) per-sample bytes."""


def _with_selective():
    base = make_profile()
    extra = tuple(ActivationFit(precision=p, checkpointing="selective", fixed_bytes=0,
                                per_sample_bytes=SELECTIVE_PER_SAMPLE * (2 if p == "fp32" else 1))
                  for p in ("bf16", "fp32"))
    return base.model_copy(update={"activations": base.activations + extra})


def test_the_engines_that_run_the_op_policy_take_its_measured_fit() -> None:
    profile = _with_selective()
    for engine, kw in (("torch", {}), ("deepspeed", {"zero": 2})):
        s = Strategy(precision="amp-bf16", engine=engine, mbs=2, checkpointing="selective", **kw)  # type: ignore[arg-type]
        assert fit_mode(profile, s, "bf16") == "selective"
        assert activation_bytes(profile, s) == 2 * SELECTIVE_PER_SAMPLE
    megatron = Strategy(precision="amp-bf16", engine="megatron", mbs=2, checkpointing="selective")
    assert fit_mode(profile, megatron, "bf16") == "none"  # the attention core only: the unrecomputed fit
    none = Strategy(precision="amp-bf16", engine="torch", mbs=2)
    full = Strategy(precision="amp-bf16", engine="torch", mbs=2, checkpointing="full")
    assert activation_bytes(profile, full) < 2 * SELECTIVE_PER_SAMPLE < activation_bytes(profile, none)


def test_a_profile_without_the_selective_fit_prices_it_as_before() -> None:
    old = make_profile()
    s = Strategy(precision="amp-bf16", engine="torch", mbs=2, checkpointing="selective")
    assert fit_mode(old, s, "bf16") == "none" and not old.has_activation("bf16", "selective")
    assert activation_bytes(old, s) == activation_bytes(old, s.model_copy(update={"checkpointing": "none"}))


def test_tensor_parallel_plans_scale_the_layers_by_the_measured_selective_share() -> None:
    """Under model parallelism the Korthikanti split takes the measured per-layer bytes: with the selective fit,
    the layers shrink by its share of the unrecomputed layer bytes (no fixed ends in the factory's fits)."""
    profile = _with_selective()
    base = dict(precision="amp-bf16", engine="torch", mbs=1, tp=2, dp=1, checkpointing="selective")
    selective = activation_bytes(profile, Strategy(**base))  # type: ignore[arg-type]
    none = activation_bytes(profile, Strategy(**{**base, "checkpointing": "none"}))  # type: ignore[arg-type]
    assert selective == round(none * SELECTIVE_PER_SAMPLE / (34 * 768 * 1024 * 12))


def test_an_arch_shape_prices_the_policy_from_its_matmul_order() -> None:
    """Llama 3 8B at 8,192 tokens: q, v, gate and down outputs kept (every other matmul), with the block input,
    the attention output and its fp32 log-sum-exp; backward re-runs k, o and up (down's output is read by
    nothing, so non-reentrant checkpointing stops before it)."""
    from optplan.estimators.arch import parse_arch, profile_from_arch

    h, kv, ffn, s, layers, heads = 4096, 1024, 14336, 8192, 32, 32
    profile = profile_from_arch(parse_arch(f"layers={layers},hidden={h},heads={heads},kv_heads=8,ffn={ffn},"
                                           f"vocab=128256,gated=1,tied=0,seq={s}"))
    assert profile.selective_recompute_flops_per_sample == layers * s * 2 * (h * kv + h * h + h * ffn)
    none, sel, full = (profile.activation("bf16", c).per_sample_bytes for c in ("none", "selective", "full"))
    kept = 2 * (h + h + kv + h + ffn + h) + 4 * heads  # input, q, v, attention output, gate, down; lse
    one_layer = s * profile.transformer.layer_bytes_per_token()
    logits = none - layers * one_layer
    assert sel == layers * s * kept + max(one_layer, logits)  # a layer's rerun and the loss: never at once
    assert full < sel < none
    moe = profile_from_arch(parse_arch("layers=4,hidden=512,heads=8,ffn=1024,vocab=1000,gated=1,tied=0,experts=8,"
                                       "topk=2,moe_ffn=256,seq=128"))
    assert moe.selective_recompute_flops_per_sample is None and not moe.has_activation("bf16", "selective")
