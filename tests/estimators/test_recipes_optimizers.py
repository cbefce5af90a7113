"""Precision recipes x optimizers: bytes per parameter against hand-computed numbers (ZeRO §3.1 and the
sources in precision.py / optimizers.py), the fp8 hardware check, and Adafactor's factored state."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import ArchSpec, arch_factored_state_elements, arch_params, profile_from_arch
from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import find_gpu, gpu_catalogue
from optplan.estimators.memory import model_states
from optplan.estimators.optimizers import (
    ADAFACTOR_FALLBACK_NOTE,
    ADAFACTOR_FLAT_NOTE,
    OPTIMIZER_STATE_BYTES,
    optimizer_sees_flat_params,
    optimizer_state_bytes_per_param,
    optimizer_state_note,
)
from optplan.estimators.precision import RECIPES, get_recipe, require_precision
from optplan.estimators.profile import ActivationFit, ModelProfile
from optplan.estimators.strategy import Strategy

EIGHT_BIT = 2 + 2 * 4 / 2048  # two 8-bit moments + one fp32 absmax per 2048 values per moment

# (weights, grads, fp32 master, one optimizer moment, fp8 weight cache), bytes/param
RECIPE_TABLE = {
    "fp32": (4, 4, 0, 4, 0),
    "amp-bf16": (4, 4, 0, 4, 0),
    "amp-fp16": (4, 4, 0, 4, 0),
    "bf16": (2, 2, 4, 4, 0),
    "fp16": (2, 2, 4, 4, 0),
    "bf16-pure": (2, 2, 0, 2, 0),
    "fp8": (2, 2, 4, 4, 2),
}

# Hand-built shapes: a 6x4 matrix (factored 6 + 4 = 10), a 2x3x5 tensor (2 x (3 + 5) = 16), a bias of 6.
SHAPE_NUMEL = 6 * 4 + 2 * 3 * 5 + 6  # 60 trainable parameters
SHAPE_FACTORED = (6 + 4) + 2 * (3 + 5) + 6  # 32 second-moment elements
FROZEN = 40  # frozen parameters: weights only


def make_profile(*, factored: int | None = SHAPE_FACTORED, trainable: int = SHAPE_NUMEL,
                 frozen: int = 0) -> ModelProfile:
    fit = ActivationFit(precision="bf16", checkpointing="none", fixed_bytes=0, per_sample_bytes=0)
    fit32 = ActivationFit(precision="fp32", checkpointing="none", fixed_bytes=0, per_sample_bytes=0)
    return ModelProfile(name="hand", path="hand.py", model_class="Hand", params=trainable + frozen,
                        trainable_params=trainable, params_by_module={"all": trainable + frozen},
                        factored_state_elements=factored, fwd_flops_per_sample=1.0, bwd_flops_per_sample=2.0,
                        activations=(fit, fit32))


PROFILE = make_profile()
ADAFACTOR_32 = 4 * SHAPE_FACTORED / SHAPE_NUMEL  # 2.1333 bytes/param with fp32 state
ADAFACTOR_16 = 2 * SHAPE_FACTORED / SHAPE_NUMEL  # bf16-pure: 16-bit state

# Total model-state bytes per trainable parameter (weights + grads + master + optimizer + fp8 cache).
TOTALS = {
    ("fp32", "adamw"): 4 + 4 + 8,
    ("fp32", "adamw8bit"): 4 + 4 + EIGHT_BIT,
    ("fp32", "adafactor"): 4 + 4 + ADAFACTOR_32,
    ("fp32", "sgd"): 4 + 4 + 4,
    ("amp-bf16", "adamw"): 16,
    ("amp-bf16", "adamw8bit"): 4 + 4 + EIGHT_BIT,
    ("amp-bf16", "adafactor"): 4 + 4 + ADAFACTOR_32,
    ("amp-bf16", "sgd"): 12,
    ("amp-fp16", "adamw"): 16,
    ("amp-fp16", "adamw8bit"): 4 + 4 + EIGHT_BIT,
    ("amp-fp16", "adafactor"): 4 + 4 + ADAFACTOR_32,
    ("amp-fp16", "sgd"): 12,
    ("bf16", "adamw"): 2 + 2 + 12,
    ("bf16", "adamw8bit"): 2 + 2 + 4 + EIGHT_BIT,
    ("bf16", "adafactor"): 2 + 2 + 4 + ADAFACTOR_32,
    ("bf16", "sgd"): 2 + 2 + 4 + 4,
    ("fp16", "adamw"): 2 + 2 + 12,
    ("fp16", "adamw8bit"): 2 + 2 + 4 + EIGHT_BIT,
    ("fp16", "adafactor"): 2 + 2 + 4 + ADAFACTOR_32,
    ("fp16", "sgd"): 2 + 2 + 4 + 4,
    ("bf16-pure", "adamw"): 2 + 2 + 4,
    ("bf16-pure", "adamw8bit"): 2 + 2 + EIGHT_BIT,
    ("bf16-pure", "adafactor"): 2 + 2 + ADAFACTOR_16,
    ("bf16-pure", "sgd"): 2 + 2 + 2,
    ("fp8", "adamw"): 2 + 2 + 12 + 2,
    ("fp8", "adamw8bit"): 2 + 2 + 4 + EIGHT_BIT + 2,
    ("fp8", "adafactor"): 2 + 2 + 4 + ADAFACTOR_32 + 2,
    ("fp8", "sgd"): 2 + 2 + 4 + 4 + 2,
    # bitsandbytes' paged 32-bit AdamW keeps fp32 moments whatever the weights (8 bytes), bf16-pure included
    ("fp32", "paged_adamw"): 4 + 4 + 8,
    ("amp-bf16", "paged_adamw"): 4 + 4 + 8,
    ("amp-fp16", "paged_adamw"): 4 + 4 + 8,
    ("bf16", "paged_adamw"): 2 + 2 + 4 + 8,
    ("fp16", "paged_adamw"): 2 + 2 + 4 + 8,
    ("bf16-pure", "paged_adamw"): 2 + 2 + 8,
    ("fp8", "paged_adamw"): 2 + 2 + 4 + 8 + 2,
}
# the paged 8-bit AdamW keeps AdamW8bit's state
TOTALS.update({(p, "paged_adamw8bit"): TOTALS[(p, "adamw8bit")] for p in RECIPES})


def total_bytes_per_param(precision: str, optimizer: str, profile: ModelProfile = PROFILE) -> float:
    r = get_recipe(precision)
    return (r.weight_bytes + r.grad_bytes + r.master_bytes + r.fp8_weight_cache_bytes
            + optimizer_state_bytes_per_param(optimizer, r, profile))


def test_every_recipe_and_optimizer_is_covered():
    assert set(RECIPES) == set(RECIPE_TABLE)
    assert set(OPTIMIZER_STATE_BYTES) == {"adamw", "adamw8bit", "adafactor", "sgd", "paged_adamw", "paged_adamw8bit"}
    assert set(TOTALS) == {(p, o) for p in RECIPES for o in OPTIMIZER_STATE_BYTES}


@pytest.mark.parametrize("name", sorted(RECIPE_TABLE))
def test_recipe_bytes(name):
    r = get_recipe(name)
    assert (r.weight_bytes, r.grad_bytes, r.master_bytes, r.state_bytes, r.fp8_weight_cache_bytes) == \
        RECIPE_TABLE[name]


@pytest.mark.parametrize("precision, optimizer", sorted(TOTALS))
def test_bytes_per_param_recipe_x_optimizer(precision, optimizer):
    assert total_bytes_per_param(precision, optimizer) == pytest.approx(TOTALS[(precision, optimizer)], rel=1e-12)


def test_zero_paper_numbers():
    assert total_bytes_per_param("bf16", "adamw") == 16  # 2 + 2 + K, K = 12 (ZeRO §3.1)
    assert get_recipe("bf16").master_bytes + optimizer_state_bytes_per_param("adamw", get_recipe("bf16")) == 12
    assert total_bytes_per_param("amp-bf16", "adamw") == 16  # 4 + 4 + 8
    assert total_bytes_per_param("bf16-pure", "adamw") == 8  # 2 + 2 + 2 + 2
    assert optimizer_state_bytes_per_param("adamw8bit", get_recipe("bf16")) == pytest.approx(2.00390625)
    assert optimizer_state_bytes_per_param("sgd", get_recipe("fp32")) == 4


@pytest.mark.parametrize("precision, optimizer", sorted(k for k in TOTALS if k[0] != "fp8"))
def test_memory_estimator_uses_the_same_bytes(precision, optimizer):
    """ZeRO-0, one GPU: weights (all parameters) + grads and optimizer (trainable only), via memory.py."""
    profile = make_profile(frozen=FROZEN)
    engine = "torch" if optimizer.startswith("paged") else "deepspeed"  # the paged ones run in a torch loop
    states = model_states(profile, Strategy(precision=precision, optimizer=optimizer, zero=0, dp=1, engine=engine))
    r = get_recipe(precision)
    per_trainable = TOTALS[(precision, optimizer)] - r.weight_bytes
    expected = (SHAPE_NUMEL + FROZEN) * r.weight_bytes + SHAPE_NUMEL * per_trainable
    assert states.params_bytes + states.grads_bytes + states.optimizer_bytes == pytest.approx(expected, abs=2)
    assert states.params_bytes == (SHAPE_NUMEL + FROZEN) * r.weight_bytes


# --- fp8 ---------------------------------------------------------------------------------------------


def test_fp8_recipe_says_what_stays_16_and_32_bit():
    r = get_recipe("fp8")
    assert r.compute_dtype == "fp8" and r.activation_precision == "bf16" and r.needs_bf16
    for words in ("bf16 weights", "gradients", "fp32 master", "optimizer states", "norms", "W^T"):
        assert words in r.description


@pytest.mark.parametrize("gpu", ["A100-40GB", "A100-80GB", "A10G"])
def test_fp8_refused_without_fp8_math(gpu):
    with pytest.raises(OptplanError) as info:
        require_precision(find_gpu(gpu), "fp8")
    message = str(info.value)
    assert message.startswith(f"{gpu} has no fp8 math") and message.endswith("choose bf16 on this GPU")
    assert "\n" not in message


def test_fp8_refused_on_v100_points_to_fp16():
    with pytest.raises(OptplanError, match=r"V100 has no fp8 math.*choose fp16 or fp32"):
        require_precision(find_gpu("V100"), "fp8")


@pytest.mark.parametrize("gpu", ["H100-SXM", "H100-PCIe", "H200", "B200", "L40S", "L4", "RTX-4090"])
def test_fp8_accepted_with_fp8_math(gpu):
    assert require_precision(find_gpu(gpu), "fp8").name == "fp8"


def test_fp8_support_matches_the_catalogue():
    for spec in gpu_catalogue().values():
        if spec.supports_fp8:
            require_precision(spec, "fp8")
        else:
            with pytest.raises(OptplanError, match="has no fp8 math"):
                require_precision(spec, "fp8")


def test_other_precision_errors_unchanged():
    with pytest.raises(OptplanError, match="V100 has no bf16 math for precision 'bf16'.*fp32 or fp16"):
        require_precision(find_gpu("V100"), "bf16")
    with pytest.raises(OptplanError, match="unknown precision 'int4'"):
        require_precision(find_gpu("H100-SXM"), "int4")


# --- Adafactor ---------------------------------------------------------------------------------------


def test_adafactor_factored_state():
    r = get_recipe("fp32")
    assert optimizer_state_bytes_per_param("adafactor", r, PROFILE) == pytest.approx(4 * 32 / 60)
    # frozen parameters change neither the numerator nor the denominator (both trainable-only)
    frozen = make_profile(frozen=FROZEN)
    assert optimizer_state_bytes_per_param("adafactor", r, frozen) == pytest.approx(4 * 32 / 60)
    assert optimizer_state_note("adafactor", PROFILE) is None


def test_adafactor_fallback_without_shapes():
    old = make_profile(factored=None)
    for name, r in RECIPES.items():
        assert optimizer_state_bytes_per_param("adafactor", r, old) == r.state_bytes, name
        assert optimizer_state_bytes_per_param("adafactor", r, None) == r.state_bytes, name
    assert optimizer_state_note("adafactor", old) == ADAFACTOR_FALLBACK_NOTE
    assert optimizer_state_note("adafactor", None) == ADAFACTOR_FALLBACK_NOTE
    assert optimizer_state_note("adamw", old) is None
    assert optimizer_state_bytes_per_param("adafactor", get_recipe("bf16"),
                                           make_profile(factored=0, trainable=0)) == 0.0


def test_adafactor_flat_partitions_are_not_factored():
    r = get_recipe("bf16")
    assert optimizer_state_bytes_per_param("adafactor", r, PROFILE, flat_params=True) == 4.0
    assert optimizer_state_bytes_per_param("adamw", r, PROFILE, flat_params=True) == 8.0
    assert optimizer_state_note("adafactor", PROFILE, flat_params=True) == ADAFACTOR_FLAT_NOTE
    assert optimizer_sees_flat_params(Strategy(zero=1, dp=8))
    assert optimizer_sees_flat_params(Strategy(zero=3, dp=8))
    assert not optimizer_sees_flat_params(Strategy(zero=0, dp=8))
    assert not optimizer_sees_flat_params(Strategy(engine="torch", fsdp="full", dp=8))
    assert optimizer_sees_flat_params(Strategy(engine="megatron", zero=1, dp=8))


def test_adafactor_is_sublinear_on_a_decoder():
    """GPT-2-small shape: 12 x 31h + (V + h) + (s + h) + 2h = 340,049 elements, 0.27 % of the parameters."""
    profile = profile_from_arch(ArchSpec(layers=12, hidden=768, heads=12, vocab=50257, seq=1024))
    assert profile.factored_state_elements == 12 * 31 * 768 + (50257 + 768) + (1024 + 768) + 2 * 768 == 340_049
    per_param = optimizer_state_bytes_per_param("adafactor", get_recipe("bf16"), profile)
    assert per_param == pytest.approx(4 * 340_049 / profile.params)
    assert per_param < 0.011  # vs 8 bytes/param of AdamW moments


def test_arch_factored_elements_by_hand():
    # layers=1, hidden=4, heads=2, kv_heads=1 (kv = 2), ffn=8, vocab=10, seq=3
    spec = ArchSpec(layers=1, hidden=4, heads=2, kv_heads=1, ffn=8, vocab=10, seq=3)
    h, kv, f, v, s = 4, 2, 8, 10, 3
    per_layer = (2 * (h + h)            # q, o weights (h x h)
                 + 2 * (kv + h)         # k, v weights (kv x h)
                 + 2 * h + 2 * kv       # q, o, k, v biases
                 + 2 * (h + f)          # MLP weights (f x h, h x f)
                 + f + h                # MLP biases
                 + 4 * h)               # two layer norms (weight + bias)
    expected = per_layer + (v + h) + (s + h) + 2 * h  # tied embedding, positions, final norm
    assert arch_factored_state_elements(spec) == expected == 121
    profile = profile_from_arch(spec)
    assert profile.factored_state_elements == expected
    assert profile.params == arch_params(spec)[0]


def test_the_precision_line_names_the_plans_own_optimizer_state() -> None:
    """A plan's precision line states K for its own optimizer (it said "K = 12 with AdamW" on every plan, SGD's
    included): master copy + the optimizer's state, as the memory estimate counts them."""
    from optplan.estimators.optimizers import optimizer_state_text
    from optplan.estimators.precision import get_recipe

    assert optimizer_state_text("adamw", get_recipe("bf16")) == (
        "adamw: K = 12 B/param (4 B fp32 master copy + 8 B of optimizer state)")
    assert optimizer_state_text("sgd", get_recipe("bf16")) == (
        "sgd: K = 8 B/param (4 B fp32 master copy + 4 B of optimizer state)")
    assert optimizer_state_text("sgd", get_recipe("amp-bf16")) == "sgd: K = 4 B/param (4 B of optimizer state)"
    for name in ("bf16", "fp16", "fp8"):
        assert "K = 12" not in get_recipe(name).description and "AdamW" not in get_recipe(name).description
    assert "factored second moment" in optimizer_state_text("adafactor", get_recipe("amp-bf16"))
