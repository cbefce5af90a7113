"""estimators/compiled_loss.py: a loss compiled by torch.compile holds the logits and their gradient only (4 bytes
per 16-bit logit, 8 per fp32 one) and Inductor's kernels move 8 / 16 bytes per logit; the plan's compile compiles
the loss unless compile_loss says otherwise, and Megatron never does."""

from __future__ import annotations

import pytest

from optplan.estimators.activations import activation_bytes
from optplan.estimators.arch import LOGIT_BYTES, parse_arch, profile_from_arch
from optplan.estimators.compiled_loss import (
    COMPILED_LOSS_PEAK_BYTES_PER_LOGIT,
    compiled_loss_moments,
    compiled_loss_saving_bytes_per_sample,
    compiles_logit_loss,
    logits_gradient_bytes,
)
from optplan.estimators.compute import head_time, transformer_dims
from optplan.estimators.efficiency import efficiency_for
from optplan.estimators.hardware import find_gpu
from optplan.estimators.strategy import Strategy

LLAMA_8B = "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0,seq=8192"
LOGITS = 8192 * 128256  # per sample


def _torch(**kw: object) -> Strategy:
    return Strategy(**{"engine": "torch", "fsdp": "full", "precision": "bf16", "dp": 8, "mbs": 2,
                       "checkpointing": "selective", **kw})


def test_the_loss_compiles_with_the_blocks_unless_the_plan_says_eager() -> None:
    assert not _torch().loss_compiled and _torch(compile=True).loss_compiled
    assert not _torch(compile=True, compile_loss=False).loss_compiled
    assert _torch(compile_loss=True).loss_compiled  # the loss alone
    assert _torch(compile=True).label() == _torch(compile=True, compile_loss=True).label()
    assert "compile(eager-loss)" in _torch(compile=True, compile_loss=False).label()
    assert "compiled-loss" in _torch(compile_loss=True).label()
    with pytest.raises(ValueError, match="drop --compile-loss"):
        Strategy(engine="megatron", compile_loss=True)
    assert not Strategy(engine="megatron", compile_loss=False).loss_compiled


def test_a_compiled_loss_holds_eight_bytes_less_per_16_bit_logit_of_an_arch_profile() -> None:
    prof = profile_from_arch(parse_arch(LLAMA_8B))
    eager, compiled = _torch(compile=True, compile_loss=False), _torch(compile=True)
    assert compiles_logit_loss(prof, compiled) and not compiles_logit_loss(prof, eager)
    saving = (LOGIT_BYTES["bf16"] - COMPILED_LOSS_PEAK_BYTES_PER_LOGIT["bf16"]) * LOGITS
    assert compiled_loss_saving_bytes_per_sample(prof, compiled, "bf16") == saving == 8 * LOGITS
    assert activation_bytes(prof, eager) - activation_bytes(prof, compiled) == pytest.approx(2 * saving, abs=2)
    fp32 = _torch(precision="fp32", compile=True)
    assert compiled_loss_saving_bytes_per_sample(prof, fp32, "fp32") == 4 * LOGITS  # 12 eager, 8 compiled
    # the last pipeline stage holds the logits: it alone saves them
    pp_eager, pp_compiled = eager.model_copy(update={"pp": 2, "dp": 4}), compiled.model_copy(update={"pp": 2, "dp": 4})
    assert activation_bytes(prof, pp_eager, stage=0) == activation_bytes(prof, pp_compiled, stage=0)
    assert activation_bytes(prof, pp_eager, stage=1) - activation_bytes(prof, pp_compiled, stage=1) == \
        pytest.approx(2 * saving, abs=2)


def test_loss_parallelism_and_megatron_keep_their_own_loss() -> None:
    prof = profile_from_arch(parse_arch(LLAMA_8B))
    tp = _torch(compile=True, tp=8, dp=1, sp=True)  # torch + TP: PyTorch's loss parallelism (loss_parallel.py)
    assert not compiles_logit_loss(prof, tp) and compiled_loss_saving_bytes_per_sample(prof, tp, "bf16") == 0
    mega = Strategy(engine="megatron", precision="bf16", dp=8, mbs=2)
    assert not compiles_logit_loss(prof, mega) and logits_gradient_bytes(prof, mega, "bf16") == 0


def test_a_measured_loss_moment_becomes_the_forwards_plus_the_logits_gradient() -> None:
    moments = {"forward": 100, "loss": 180, "backward": 104, "grads": 90}
    assert compiled_loss_moments(moments, 20.0) == {**moments, "loss": 120}
    assert compiled_loss_moments(moments, 500.0)["loss"] == 180  # never above the eager loss measured
    assert compiled_loss_moments({"step": 7}, 20.0) == {"step": 7}  # no moments: unchanged
    prof = profile_from_arch(parse_arch(LLAMA_8B))
    assert logits_gradient_bytes(prof, _torch(compile=True), "bf16") == 2 * LOGITS * 2  # 16-bit gradient, mbs 2
    assert logits_gradient_bytes(prof, _torch(compile=True), "fp32") == 4 * LOGITS * 2


def test_the_compiled_loss_moves_inductors_count_not_the_eager_constant() -> None:
    prof = profile_from_arch(parse_arch(LLAMA_8B))
    gpu = find_gpu("H200")
    eff = efficiency_for(gpu)
    eager, compiled = _torch(compile=True, compile_loss=False), _torch(compile=True)
    hbm = gpu.memory_bandwidth_bytes_per_s * eff.hbm_fraction
    dims = transformer_dims(prof)
    assert dims is not None
    e = head_time(dims, eager, gpu, eff).logits_elementwise_s
    c = head_time(dims, compiled, gpu, eff).logits_elementwise_s
    norm = eff.elementwise_factor * 5.0 * 2 * 8192 * 4096 * 2 / hbm
    assert c == pytest.approx(8 * 2 * LOGITS / hbm + norm, rel=1e-9)
    assert e > 5 * c  # the eager constant (bytes per logit fitted on Megatron's fp32 cross entropy) is far above


def _measured(loss_above_forward_per_logit: float) -> object:
    """The 8B shape as a measured profile whose fits' loss moment holds ``loss_above_forward_per_logit`` bytes per
    logit above the forward's (a loss_fn of its own: 10; Hugging Face's output.loss inside the forward: 0)."""
    from optplan.estimators.profile import ActivationFit

    prof = profile_from_arch(parse_arch(LLAMA_8B))
    forward = 40 * LOGITS  # above the formula's 32 layers (36.5 GB a sample): the rest is the ends
    loss = round(forward + loss_above_forward_per_logit * LOGITS)
    phases = {"forward": ((0, forward),), "loss": ((0, loss),), "backward": ((0, forward + LOGITS),),
              "grads": ((0, forward),)}
    fits = tuple(ActivationFit(precision=p, checkpointing=c, fixed_bytes=0, per_sample_bytes=max(loss, forward),
                               phase_lines=phases)
                 for p in ("bf16", "fp32") for c in ("none", "selective", "full"))
    return prof.model_copy(update={"activation_source": "measured", "activations": fits})


def test_a_measured_profile_saves_only_what_its_eager_loss_held_outside_the_model() -> None:
    from optplan.estimators.compiled_loss import loss_outside_model

    own, inside = _measured(10.0), _measured(0.0)
    assert loss_outside_model(own) and not loss_outside_model(inside)  # type: ignore[arg-type]
    eager, compiled = _torch(compile=True, compile_loss=False), _torch(compile=True)
    assert activation_bytes(own, eager) - activation_bytes(own, compiled) == 2 * (10 - 2) * LOGITS  # type: ignore[arg-type]
    assert activation_bytes(inside, eager) == activation_bytes(inside, compiled)  # type: ignore[arg-type]
    # the model-parallel path takes the same measured saving on the last stage (the logits gathered per rank)
    pp_e, pp_c = (s.model_copy(update={"pp": 2, "dp": 4}) for s in (eager, compiled))
    assert activation_bytes(own, pp_e, stage=1) - activation_bytes(own, pp_c, stage=1) == \
        pytest.approx(2 * (10 - 2) * LOGITS, rel=1e-6)  # type: ignore[arg-type]
    assert activation_bytes(inside, pp_e, stage=1) == activation_bytes(inside, pp_c, stage=1)  # type: ignore[arg-type]


def test_partial_checkpointing_saves_the_compiled_loss_too() -> None:
    prof = profile_from_arch(parse_arch(LLAMA_8B))
    eager = _torch(checkpointing="full", checkpoint_layers=31, compile=True, compile_loss=False)
    compiled = eager.model_copy(update={"compile_loss": None})
    assert activation_bytes(prof, eager) - activation_bytes(prof, compiled) == pytest.approx(2 * 8 * LOGITS, abs=2)


def test_an_arch_profile_saves_only_what_the_loss_held_above_a_layers_rerun() -> None:
    """With recomputation the peak is the larger of a layer's rerun and the loss (arch.py): a compiled loss saves
    what the eager loss held above the rerun, never below it. A small vocabulary: the rerun (3,072 bytes a token)
    sits between the compiled loss (4 bytes x 384 logits a token) and the eager one (12 x 384)."""
    prof = profile_from_arch(parse_arch("layers=4,hidden=64,heads=4,vocab=384,seq=512,gated=1,tied=0"))
    eager = _torch(checkpointing="full", compile=True, compile_loss=False, mbs=1)
    compiled = eager.model_copy(update={"compile_loss": None})
    logits = 512 * 384
    rerun = 512 * prof.transformer.layer_bytes_per_token()  # type: ignore[union-attr]
    assert COMPILED_LOSS_PEAK_BYTES_PER_LOGIT["bf16"] * logits < rerun < LOGIT_BYTES["bf16"] * logits
    assert activation_bytes(prof, eager) - activation_bytes(prof, compiled) == pytest.approx(
        LOGIT_BYTES["bf16"] * logits - rerun, abs=2)
    none = eager.model_copy(update={"checkpointing": "none"})  # every layer held at the loss: all of it saved
    assert activation_bytes(prof, none) - activation_bytes(prof, none.model_copy(update={"compile_loss": None})) == \
        pytest.approx(compiled_loss_saving_bytes_per_sample(prof, compiled, "bf16"), abs=2)
