"""LoRA adapters in the profile: exact trainable counts, the bf16-frozen activation fit, the quantised layers' inputs
(what an old bitsandbytes keeps) and LoRA dropout, real CPU steps against the prediction, and the one-line errors for
targets that match nothing, a rank too large and peft missing. Each profile is a child process that runs every
measured step on fake tensors (about a minute of CPU): the module's profiles are made once and shared."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from optplan.estimators.finetune import LoraRequest  # noqa: E402
from optplan.estimators.profile import ModelProfile  # noqa: E402
from optplan.probes.adapters import apply_lora  # noqa: E402
from optplan.probes.loader import ModelFileError, profile_model_file  # noqa: E402
from optplan.probes.quant_inputs import bnb_keeps_4bit_inputs_here  # noqa: E402

H, F, KV, LAYERS, SEQ = 64, 160, 32, 3, 32  # conftest.TINY_HF_LLAMA (KV: 2 of 4 heads of 16), profiled at SEQ tokens
DROPOUT = 0.1


@pytest.fixture(scope="module")
def lora4(tiny_hf_llama_file: Path) -> ModelProfile:
    """Rank-4 adapters on every projection (the default targets)."""
    return profile_model_file(tiny_hf_llama_file, seq_len=SEQ, lora=LoraRequest(rank=4))


@pytest.fixture(scope="module")
def dropped(tiny_hf_llama_file: Path) -> ModelProfile:
    """The same with LoRA dropout."""
    return profile_model_file(tiny_hf_llama_file, seq_len=SEQ, lora=LoraRequest(rank=4, dropout=DROPOUT))


@pytest.fixture(scope="module")
def qv(tiny_hf_llama_file: Path) -> ModelProfile:
    """Rank-2 adapters (alpha 8) on q_proj and v_proj only."""
    return profile_model_file(tiny_hf_llama_file, seq_len=SEQ,
                              lora=LoraRequest(rank=2, alpha=8, targets=("q_proj", "v_proj")))


def test_lora_profile_counts_are_exact(tiny_hf_llama_file: Path, lora4: ModelProfile) -> None:
    prof = lora4
    full = profile_model_file(tiny_hf_llama_file, seq_len=SEQ)
    h, f, kv, r, layers = H, F, KV, 4, LAYERS
    # q, o: h -> h; k, v: h -> kv; gate, up: h -> f; down: f -> h; r (d_in + d_out) each
    per_layer = r * (2 * (h + h) + 2 * (h + kv) + 2 * (h + f) + (f + h))
    assert prof.adapter is not None
    assert prof.adapter.adapter_params == prof.trainable_params == layers * per_layer
    assert prof.params == full.params + layers * per_layer
    assert prof.adapter.adapted_modules == 7 * layers
    assert prof.adapter.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    linear = h * h * 2 + h * kv * 2 + h * f * 3  # every block Linear; the head is not quantised
    assert prof.adapter.quantizable_params == layers * linear
    assert prof.adapter.largest_quantizable_params == h * f
    assert prof.has_activation("bf16-frozen") and not full.has_activation("bf16-frozen")
    # frozen layers compute no weight gradient: LoRA's backward is far below full training's 2x forward
    assert prof.bwd_flops_per_sample < 1.3 * prof.fwd_flops_per_sample
    assert full.bwd_flops_per_sample > 1.9 * full.fwd_flops_per_sample


def test_named_targets_and_rank(qv: ModelProfile) -> None:
    assert qv.adapter is not None
    assert (qv.adapter.rank, qv.adapter.alpha, qv.adapter.adapted_modules) == (2, 8.0, 6)
    assert qv.trainable_params == 3 * 2 * ((64 + 64) + (64 + 32))


def _bf16_per_sample(prof: ModelProfile) -> float:
    return next(a.per_sample_bytes for a in prof.activations
                if a.precision == "bf16-weights" and a.checkpointing == "none")


def test_quant_inputs_and_dropout_in_the_profile(lora4: ModelProfile, dropped: ModelProfile, qv: ModelProfile) -> None:
    """The profiler's measurement of the quantised layers' inputs (what an old bitsandbytes keeps, which the rank
    does not change) and LoRA dropout in the profile."""
    plain = lora4
    for prof in (plain, dropped, qv):
        assert prof.adapter is not None
        # attention in, attention out, MLP in (h each: q/k/v and gate/up read one tensor) and MLP out (F)
        assert prof.adapter.quant_input_elements == 3 * H + F
        assert prof.adapter.bnb_4bit_keeps_inputs is bnb_keeps_4bit_inputs_here()
    assert (plain.adapter.dropout, dropped.adapter.dropout) == (0.0, DROPOUT)  # type: ignore[union-attr]
    # without dropout every adapted layer's lora_A keeps its input; the attention output is a view of the
    # attention's own saved output (SDPA)
    assert plain.adapter.quant_input_unkept_elements == 0  # type: ignore[union-attr]
    # with dropout lora_A keeps the dropped copy instead: all but the attention output go unkept
    assert dropped.adapter.quant_input_unkept_elements == 2 * H + F  # type: ignore[union-attr]
    # q and v adapted: their input is kept; the MLP's input and the MLP output are not
    assert qv.adapter.quant_input_unkept_elements == H + F  # type: ignore[union-attr]
    # dropout's memory, per token and block, as a GPU keeps it: each of the 7 adapted layers keeps a 16-bit dropped
    # input and a bool mask (3 bytes per input element: 6 layers read h, down_proj reads F), where the inputs
    # themselves (2h + F, 2 bytes) are no longer kept; the first block (no input gradient) and the extrapolation
    # from 2 blocks make it approximate
    expected = (3 * (6 * H + F) - 2 * (2 * H + F)) * SEQ * LAYERS
    assert _bf16_per_sample(dropped) - _bf16_per_sample(plain) == pytest.approx(expected, rel=0.1)


def test_bad_lora_requests_are_one_line(tiny_hf_llama_file: Path) -> None:
    with pytest.raises(ModelFileError) as none:
        profile_model_file(tiny_hf_llama_file, seq_len=SEQ, lora=LoraRequest(targets=("attn_qkv",)))
    assert "match no linear layer" in none.value.problem and "q_proj" in none.value.fix
    with pytest.raises(ModelFileError) as big:
        profile_model_file(tiny_hf_llama_file, seq_len=SEQ, lora=LoraRequest(rank=100, targets=("k_proj",)))
    assert "larger than layer" in big.value.problem and "--lora-rank 32" in big.value.fix


def test_peft_missing_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    real_import = builtins.__import__

    def no_peft(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "peft" or name.startswith("peft."):
            raise ImportError("No module named 'peft'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    with pytest.raises(ModelFileError) as err:
        apply_lora(torch.nn.Linear(4, 4), LoraRequest(targets=("x",)), "m.py")
    assert err.value.fix == "pip install peft"


def test_quantised_lora_steps_match_the_prediction(tiny_hf_llama_file: Path, lora4: ModelProfile,
                                                   dropped: ModelProfile) -> None:
    """The default run's share of the test below: real CPU steps of the module's Llama, checkpointing off and on,
    with adapters on an NF4-DQ base and on an int8 base with LoRA dropout (the int8 base's kept layer inputs,
    measured per block by the profiler): within 1 %, the int8 ones never under."""
    from benchmarks.fidelity_finetune_cpu import Profiled, run

    llama = Profiled(tiny_hf_llama_file, SEQ, LoraRequest(rank=4), lora4, dropped)
    rows = run(quick=True, log=lambda _line: None, llama=llama, vit=False,
               only={("bf16-pure", "nf4-dq", False), ("bf16-pure", "int8", True)})
    assert [(row.quant, row.checkpointing, row.dropout > 0) for row in rows] == [
        ("nf4-dq", "none", False), ("nf4-dq", "full", False), ("int8", "none", True), ("int8", "full", True)]
    for row in rows:
        assert abs(row.error_pct) <= 1.0, row
        assert row.quant != "int8" or row.error_pct >= 0


@pytest.mark.full
def test_real_lora_steps_match_the_prediction(tiny_hf_llama_file: Path, lora4: ModelProfile,
                                              dropped: ModelProfile) -> None:
    """benchmarks/fidelity_finetune_cpu.py as --quick runs it, on the module's Llama and its profiles (3 layers,
    rank-4 adapters, 32 tokens: the bf16 steps emulated on an AVX2 CPU stay cheap) and a ViT-Tiny at 112 x 112 (49
    patches): real CPU steps of the Llama with adapters on a 16-bit, fp32, NF4(-DQ) and int8 base, without and with
    LoRA dropout (run as a GPU runs it), and of the timm ViT with adapters on its blocks' projections, against the
    prediction. Within 1 %; the int8 base's kept layer inputs (measured per block by the profiler) never under."""
    pytest.importorskip("timm")
    from benchmarks.fidelity_finetune_cpu import Profiled, run

    llama = Profiled(tiny_hf_llama_file, SEQ, LoraRequest(rank=4), lora4, dropped)
    rows = run(quick=True, log=lambda _line: None, llama=llama, vit_side=112)
    llama_rows = [row for row in rows if row.model == "llama"]
    assert len(llama_rows) == 20  # 10 recipe/base/dropout x ckpt on/off
    assert {row.dropout for row in llama_rows} == {0.0, DROPOUT}
    assert [(row.model, row.checkpointing) for row in rows[20:]] == [("vit", "none"), ("vit", "full")]
    for row in rows:
        assert abs(row.error_pct) <= 1.0, row
        if row.quant == "int8" and (row.checkpointing == "full" or row.dropout):
            assert row.error_pct >= 0  # the kept inputs are counted: never under


def test_targets_naming_the_head_or_nothing_are_refused_by_name() -> None:
    """``lm_head`` among the targets was dropped silently (its adapter uncounted) and exported, and TRL then refused
    it; alone it got "match no linear layer ... name some of its linear layers: ..., lm_head, ...". A typo beside a
    real target was dropped silently too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    for targets, problem, fix in ((("k_proj", "lm_head"), "--lora-targets lm_head names the output head (lm_head)",
                                   "leave it out"),
                                  (("q_proj", "foo"), "--lora-targets foo match no linear layer", "q_proj")):
        with pytest.raises(ModelFileError) as err:
            apply_lora(LlamaForCausalLM(config), LoraRequest(targets=targets), "m.py")
        assert problem in err.value.problem and fix in err.value.fix, (err.value.problem, err.value.fix)
        assert "lm_head" not in err.value.fix.split(":", 1)[-1]  # the layers offered are ones it can adapt
    adapted = apply_lora(LlamaForCausalLM(config), LoraRequest(rank=2, targets=("q_proj", "v_proj")), "m.py")
    assert sum(p.numel() for p in adapted.parameters() if p.requires_grad) == 2 * (64 + 64) + 2 * (64 + 32)


def test_a_lora_models_amp_traffic_is_counted_with_its_base_in_bf16() -> None:
    """Its AMP plans hold the frozen base in bf16 (no per-forward casts of it): the ``amp`` class's block bytes and
    kernels are the bf16-frozen step's, not the fp32-base autocast step's, which casts every frozen weight."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from optplan.probes.activation_measure import _mode_envelope, measure, measure_frozen_16bit
    from optplan.probes.static import blocks_of, find_repeated_block
    from optplan.probes.step_runner import BatchSpec, StepRunner

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    model = apply_lora(LlamaForCausalLM(config), LoraRequest(rank=4), "m.py")
    block = find_repeated_block(model)
    assert block is not None

    def runner() -> StepRunner:
        spec = BatchSpec(make=lambda b: torch.randint(0, 256, (b, 16)), describe=lambda b: f"[{b}, 16]",
                         inferred=True, fix="")
        return StepRunner(model=model, spec=spec, loss_fn=None, display="m.py", blocks=blocks_of(model, block.cls))

    m = measure(runner(), (1, 2))
    base: dict[str, tuple[float, float]] = {}
    r = runner()
    r.warm_up(1, "bf16")
    _mode_envelope(r, (1, 2), "bf16", "none", base, {}, {})
    frozen: dict[str, tuple[float, float]] = {}
    measure_frozen_16bit(runner(), (1, 2), frozen, {}, {})
    assert m.eager_block_bytes["amp"] == frozen["amp"]
    assert frozen["amp"][0] < base["amp"][0]  # no casts of the frozen weights in the forward
