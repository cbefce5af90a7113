"""Activation bytes one rank holds at its peak: the profile's measured fits, or Korthikanti's formula under
model parallelism (bytes).

Without model parallelism: the static probe's measured fits (profile.py) at the micro-batch. With
tensor/sequence/context/pipeline parallelism (or for ``--arch`` shapes), Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", arXiv 2205.05198) Table 2 per layer: s·b·h·(34 + 5·a·s/h)
bytes without parallelism; with tensor parallelism the 10·s·b·h of layer-norm inputs, block inputs and dropout
masks stays replicated and 24·s·b·h + 5·a·s²·b is split by t; with sequence parallelism all of it is split by t;
selective recomputation drops the 5·a·s²·b term (which flash attention never stores); full recomputation keeps
2·s·b·h per layer (its input) plus one layer's working set; partial checkpointing (the first N blocks of a stage,
estimators/partial_checkpointing.py) keeps the inputs of those N and everything of the others, and between the
measured fits it interpolates. A measured profile keeps its measured per-layer bytes
and its measured non-layer part (embedding, logits, loss: split by t as Megatron's vocabulary-parallel cross
entropy does); the split between the two takes the Table 2 per-layer figure (TransformerShape.layer_bytes_per_token).
Under the fp8 recipe Transformer Engine (Megatron) keeps its GEMM inputs in fp8 (estimators/fp8_activations.py);
torchao's Float8Linear (the torch engine's train.py) keeps them in bf16 (estimators/fp8_backend.py).
Context parallelism divides the sequence by cp. Pipeline: under 1F1B the first stage holds min(p, m) micro-batches
in flight (Narayanan et al. 2021 §2.2.1); interleaving with v virtual stages multiplies the first stage's
activations by 1 + (p−1)/(p·v) (Korthikanti et al. §4.2.3). memory.py adds them to the rest of the rank's memory.
"""

from __future__ import annotations

from optplan.estimators.compiled_loss import (
    compiled_loss_moments,
    compiled_loss_saving_bytes_per_sample,
    compiles_logit_loss,
    eager_loss_bytes_per_sample,
    logits_gradient_bytes,
)
from optplan.estimators.fp8_activations import fp8_saved_bytes_per_token
from optplan.estimators.fp8_backend import saves_fp8_gemm_inputs
from optplan.estimators.loss_parallel import loss_parallel_extra_bytes_per_sample
from optplan.estimators.moe_recompute import saved_bytes_per_token
from optplan.estimators.parallel import layers_per_stage
from optplan.estimators.params_placement import rank_stages, stage_params
from optplan.estimators.partial_checkpointing import (
    blend_bytes,
    checkpointed_blocks,
    is_partial,
    partial_phase_bytes,
)
from optplan.estimators.pipeline import DUALPIPE_IN_FLIGHT_EXTRA, in_flight_microbatches
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import (
    FROZEN_16BIT,
    STEP_PHASES,
    WEIGHTS_16BIT,
    ActivationFit,
    ActivationPrecision,
    CheckpointMode,
    ModelProfile,
)
from optplan.estimators.selective import runs_op_policy
from optplan.estimators.strategy import Strategy
from optplan.estimators.tensor_plan import gathers_logits

ATTENTION_SCORE_COEFF = 5
"""Korthikanti et al. Table 2: 5·a·s² bytes per sample per layer of attention scores, softmax and
dropout, 16-bit (dropped by flash attention and by selective recomputation)."""



def in_flight_micro_batches(strategy: Strategy, stage: int = 0) -> float:
    """Micro-batches whose activations pipeline ``stage`` holds at its peak (count, may be fractional).

    1F1B: stage i holds min(p − i, m) (Narayanan et al. 2021 §2.2.1); interleaved with v virtual stages
    the first stage holds p·(1 + (p−1)/(p·v)) stage-loads (Korthikanti et al. 2022 §4.2.3), which is
    Megatron's warm-up count, computed per stage by :func:`optplan.estimators.pipeline.in_flight_microbatches`.
    DualPipe: p + 1 chunk-micro-batches, each one stage's layers, on every rank (DeepSeek-V3 report Table 2;
    :data:`optplan.estimators.pipeline.DUALPIPE_IN_FLIGHT_EXTRA`).
    """
    if strategy.dualpipe:
        return float(strategy.pp + DUALPIPE_IN_FLIGHT_EXTRA)
    return in_flight_microbatches(strategy.pp, stage, strategy.grad_accum, strategy.vpp)


def uses_measured_fit(profile: ModelProfile, strategy: Strategy) -> bool:
    if strategy.model_parallel or strategy.checkpointing == "moe":  # the formula knows the MoE layers' share
        return False
    if profile.activation_source == "measured":
        return True
    return strategy.flash  # an --arch fit counts flash attention: without it the split path adds the s x s scores


WEIGHTS_16BIT_ENGINES = frozenset({"torch", "deepspeed"})
"""Engines that run the user's model as written with its weights in 16 bits (a model ``.to(bf16)``,
DeepSpeed's bf16/fp16 engines, FSDP2's ``MixedPrecisionPolicy(param_dtype)``), so that the profile's
``bf16-weights`` fit is their step. Megatron-LM upcasts the logits to fp32 for its vocabulary-parallel cross
entropy and accumulates gradients in fp32 ``main_grad`` buffers: the autocast fit without its weight copies
is the closer of the two there."""


def fit_mode(profile: ModelProfile, strategy: Strategy, precision: ActivationPrecision) -> CheckpointMode:
    """The checkpointing mode of the profile's fit that prices ``strategy`` at ``precision``: ``full`` as is;
    ``selective`` where the engine runs the op-level policy and the profile measured it (older profiles did not:
    they price it as no checkpointing, as before); else ``none``."""
    mode = strategy.checkpointing if profile.supports_checkpointing else "none"
    if mode == "full":
        return "full"
    if mode == "selective" and runs_op_policy(strategy) and profile.has_activation(precision, "selective"):
        return "selective"
    return "none"


def measured_fit(profile: ModelProfile, strategy: Strategy) -> tuple[ActivationFit, bool]:
    """The profile's measured activation fit for ``strategy`` and whether its autocast weight copies count.

    fp32 and AMP recipes: the fp32 or autocast fit as measured (copies count). Recipes with 16-bit weights:
    the ``bf16-weights`` fit (the model held in bf16, measured: its gradient temporaries and the loss's tensors
    are 16-bit) on the engines of :data:`WEIGHTS_16BIT_ENGINES`; else (Megatron, or a profile without
    that fit: older, or a model that does not run in bf16) the autocast fit less autocast's weight copies.
    LoRA profiles under AMP recipes: the ``bf16-frozen`` fit (a bf16 base, fp32 adapters, autocast).
    """
    recipe = get_recipe(strategy.precision)
    if (profile.adapter is not None and recipe.weight_bytes == 4 and recipe.compute_dtype != "fp32"
            and profile.has_activation(FROZEN_16BIT)):
        return profile.activation(FROZEN_16BIT, fit_mode(profile, strategy, FROZEN_16BIT)), True
    if (recipe.weight_bytes == 2 and strategy.engine in WEIGHTS_16BIT_ENGINES
            and profile.has_activation(WEIGHTS_16BIT)):
        return profile.activation(WEIGHTS_16BIT, fit_mode(profile, strategy, WEIGHTS_16BIT)), True
    precision = recipe.activation_precision
    return profile.activation(precision, fit_mode(profile, strategy, precision)), recipe.weight_bytes != 2


def _partial_fits(profile: ModelProfile,
                  strategy: Strategy) -> tuple[tuple[ActivationFit, ActivationFit], bool, float, int] | None:
    """Under partial checkpointing with a measured fit: the fits without and with every block checkpointed, whether
    autocast's weight copies count, the checkpointed blocks and the blocks; else None."""
    block = profile.repeated_block
    if block is None or not profile.supports_checkpointing or not is_partial(strategy, block.count):
        return None
    full, copies = measured_fit(profile, strategy)
    none, _ = measured_fit(profile, strategy.model_copy(update={"checkpointing": "none", "checkpoint_layers": None}))
    return (none, full), copies, checkpointed_blocks(strategy, block.count), block.count


def _partial_moments(profile: ModelProfile, strategy: Strategy) -> dict[str, int] | None:
    """Under partial checkpointing with a measured fit, the activation bytes of each moment (one ``step`` figure for
    fits without moments): N·δ off every moment, from the two fits (estimators/partial_checkpointing.py); else None."""
    partial = _partial_fits(profile, strategy)
    if partial is None:
        return None
    (none, full), copies, checkpointed, blocks = partial
    none_wo, full_wo = (fit.phases_at(strategy.mbs, param_copies=False) for fit in (none, full))
    if not none_wo or set(none_wo) != set(full_wo):
        return {"step": blend_bytes(none.bytes_at(strategy.mbs, param_copies=copies),
                                    full.bytes_at(strategy.mbs, param_copies=copies), checkpointed / blocks)}
    if not copies:
        return partial_phase_bytes(none_wo, full_wo, checkpointed, blocks)
    none_c, full_c = ({ph: b - wo[ph] for ph, b in fit.phases_at(strategy.mbs).items()}
                      for fit, wo in ((none, none_wo), (full, full_wo)))
    return partial_phase_bytes(none_wo, full_wo, checkpointed, blocks, none_c, full_c)


def _compiled_partial_moments(profile: ModelProfile, strategy: Strategy) -> dict[str, int] | None:
    """:func:`_partial_moments` with a compiled loss priced: the ``loss`` moment as compiled_loss.py says where the
    moments are known, else the one figure less the loss's saving (never below what it was less that saving)."""
    partial = _partial_moments(profile, strategy)
    if partial is None or not compiles_logit_loss(profile, strategy):
        return partial
    fit, _ = measured_fit(profile, strategy)
    if "loss" in partial:
        return compiled_loss_moments(partial, logits_gradient_bytes(profile, strategy, fit.precision))
    saving = _loss_saving_per_sample(profile, strategy, fit.precision) * strategy.mbs
    return {k: max(0, round(v - saving)) for k, v in partial.items()}


def _fixed_stage_bytes(profile: ModelProfile, strategy: Strategy, fixed: int, copies: int, stage: int) -> float:
    """The fit's fixed bytes on one rank: autocast weight copies scale with the rank's parameters and
    vanish for 16-bit weights; the rest stays."""
    recipe = get_recipe(strategy.precision)
    share = stage_params(profile, strategy, stage) / profile.params if profile.params else 1.0
    kept_copies = 0 if recipe.weight_bytes == 2 else copies * share
    return max(0.0, fixed - copies + kept_copies)


def activation_bytes(profile: ModelProfile, strategy: Strategy, *, stage: int = 0) -> int:
    """Activations + temporaries held by one rank of pipeline ``stage`` at its peak (bytes).

    Without model parallelism: the profile's measured fit at the micro-batch (:func:`fit_mode`: selective
    recomputation on the torch and DeepSpeed engines takes the fit measured under the training loop's op-level
    policy; Megatron's keeps the unrecomputed fit, since the profile's attention kernel stores no s×s scores).
    The 16-bit fits are measured under autocast on fp32 weights, which keeps a 16-bit copy of every weight alive
    (``param_copy_bytes``); recipes whose weights are already 16-bit drop those copies. With
    tensor/sequence/context/pipeline parallelism, Korthikanti et al. Table 2 (module docstring).
    """
    recipe = get_recipe(strategy.precision)
    mode = strategy.checkpointing if profile.supports_checkpointing else "none"
    if uses_measured_fit(profile, strategy):
        partial = _compiled_partial_moments(profile, strategy)
        if partial is not None:  # some blocks checkpointed: the worst moment
            return max(partial.values())
        return _whole_model_bytes(profile, strategy)
    fit = profile.activation(recipe.activation_precision, "full" if mode == "full" else "none")
    fixed = _fixed_stage_bytes(profile, strategy, fit.fixed_at(strategy.mbs), fit.param_copies_at(strategy.mbs), stage)
    per_sample = _per_sample_stage_bytes(profile, strategy, mode, stage)
    return max(0, round(fixed + per_sample * strategy.mbs))


def _whole_model_bytes(profile: ModelProfile, strategy: Strategy) -> int:
    """The measured (or formula) fit at the micro-batch, with a compiled loss priced (estimators/compiled_loss.py):
    per moment where the fit has them, the ``--arch`` formula's logits term otherwise (a measured fit without
    moments keeps its figure); never above the eager figure."""
    fit, copies = measured_fit(profile, strategy)
    whole = fit.bytes_at(strategy.mbs, param_copies=copies)
    if not compiles_logit_loss(profile, strategy):
        return whole
    phases = fit.phases_at(strategy.mbs, param_copies=copies)
    if phases:
        return min(whole, max(compiled_loss_moments(phases, logits_gradient_bytes(profile, strategy,
                                                                                   fit.precision)).values()))
    if profile.activation_source != "formula":
        return whole
    return max(0, round(whole - _formula_saving_per_sample(profile, strategy, fit) * strategy.mbs))


def _formula_saving_per_sample(profile: ModelProfile, strategy: Strategy, fit: ActivationFit) -> float:
    """Bytes per sample a compiled loss takes off an ``--arch`` fit: all it saves without recomputation (the loss
    is the step's peak beside every layer's activations); with it, the peak is the larger of a layer's rerun and the
    loss (arch.py), so only what the eager loss held above the rerun, at most the saving."""
    saving = compiled_loss_saving_bytes_per_sample(profile, strategy, fit.precision)
    block = profile.repeated_block
    if fit.checkpointing == "none" or saving <= 0 or block is None or not profile.has_activation(fit.precision, "none"):
        return saving
    loss = eager_loss_bytes_per_sample(profile, fit.precision)
    rerun = (profile.activation(fit.precision, "none").per_sample_bytes - loss) / block.count  # arch.py's fits
    return max(0.0, min(saving, loss - rerun))


def _loss_saving_per_sample(profile: ModelProfile, strategy: Strategy, precision: ActivationPrecision) -> float:
    """Bytes per sample a compiled loss saves at the loss (whole vocabulary, every token): the ``--arch`` formula's
    (compiled_loss.py); for a measured profile what its eager ``loss`` moment holds above the forward's moment and
    the logits' gradient (a loss inside the model's forward, Hugging Face's, shows none), 0 without moments."""
    if not compiles_logit_loss(profile, strategy):
        return 0.0
    if profile.activation_source == "formula":
        return compiled_loss_saving_bytes_per_sample(profile, strategy, precision)
    fit = profile.activation(precision, "none") if profile.has_activation(precision, "none") else None
    phases = fit.phases_at(1, param_copies=False) if fit is not None else {}
    if "loss" not in phases or "forward" not in phases:
        return 0.0
    one = strategy.model_copy(update={"mbs": 1})
    return max(0.0, phases["loss"] - phases["forward"] - logits_gradient_bytes(profile, one, precision))


def _per_sample_stage_bytes(profile: ModelProfile, strategy: Strategy, mode: str, stage: int) -> float:
    """Activation bytes per sample of one rank of ``stage`` under model parallelism (Korthikanti Table 2)."""
    recipe = get_recipe(strategy.precision)
    scale = 2 if recipe.activation_precision == "fp32" else 1
    t, cp, p = strategy.tp, strategy.cp, strategy.pp
    measured = profile.activation(recipe.activation_precision, "none").per_sample_bytes
    last = p - 1 in rank_stages(strategy, stage)  # DualPipe's first and last ranks hold both ends
    held = in_flight_micro_batches(strategy, stage)
    block, shape = profile.repeated_block, profile.transformer
    if block is None:  # no layers to split: the whole model is one stage's work
        return measured / cp
    layers = block.count
    on_stage = layers_per_stage(layers, p)
    if shape is None or not profile.tokens_per_sample:
        # not a transformer: the measured bytes spread evenly over the blocks, no ends
        if mode == "full":
            full = profile.activation(recipe.activation_precision, "full").per_sample_bytes
            per_layer_input = full / (layers + 1)
            kept = checkpointed_blocks(strategy, on_stage)  # the rest keep all their bytes (partial_checkpointing.py)
            working_set = measured / layers if kept >= on_stage else 0.0
            return ((kept * per_layer_input + (on_stage - kept) * measured / layers) * held + working_set) / cp
        return on_stage * measured / layers * held / cp
    s, h, a = profile.tokens_per_sample, shape.hidden, shape.heads
    formula_layer = shape.layer_bytes_per_token() * s * scale
    ends = max(0.0, measured - layers * formula_layer)
    layer = (measured - ends) / layers
    replicated = layer * shape.replicated_bytes_per_token() / shape.layer_bytes_per_token()
    layer_tp = (replicated / t if strategy.sp else replicated) + (layer - replicated) / t
    formula = profile.activation_source == "formula"
    scores = ATTENTION_SCORE_COEFF * a * s * s * scale / t if formula and not strategy.flash else 0.0
    if mode == "none":
        layer_tp += scores
    rerun_tp: float | None = None  # an --arch selective layer's rerun: beside the kept bytes, never with the loss
    if mode == "selective" and fit_mode(profile, strategy, recipe.activation_precision) == "selective" and layer > 0:
        # the op-level policy's share of a layer's bytes, as the profile measured it, on the split layer
        selective = profile.activation(recipe.activation_precision, "selective").per_sample_bytes
        if formula:  # arch.py's fit: every layer's kept bytes plus the larger of one layer's rerun and the loss
            rerun_tp = layer_tp
            layer_tp *= max(0.0, selective - max(layer, ends)) / layers / layer
        else:
            layer_tp *= max(0.0, selective - ends) / layers / layer
    if saves_fp8_gemm_inputs(strategy):  # Transformer Engine saves its GEMM inputs in fp8 (fp8_activations.py);
        # torchao's Float8Linear saves the bf16 ones (fp8_backend.py)
        rep_save, split_save = fp8_saved_bytes_per_token(shape, moe_recomputed=mode == "moe")
        layer_tp -= s * (rep_save / (t if strategy.sp else 1) + split_save / t)
    layer_input = 2 * s * h * scale / (t if strategy.sp else 1)
    ends_here = ends / (1 if gathers_logits(profile, strategy) else t) if last else 0.0
    if last:  # PyTorch's loss parallelism holds more fp32 logit-shaped tensors than a fused kernel (loss_parallel.py)
        ends_here += loss_parallel_extra_bytes_per_sample(profile, strategy, recipe.activation_precision)
        # a compiled loss holds the logits and their gradient only (compiled_loss.py), split as the logits are
        saving = _loss_saving_per_sample(profile, strategy, recipe.activation_precision)
        ends_here = max(0.0, ends_here - saving / (1 if gathers_logits(profile, strategy) else t))
    checkpointed = checkpointed_blocks(strategy, on_stage) if mode == "full" else 0.0
    if mode == "full" and checkpointed >= on_stage:
        # the recomputed layer's working set exists only in a layer's backward, after the logits and the loss
        # (and their gradient) are freed: the larger of the two beside the kept layer inputs, not their sum
        # (measured on CPU under tensor parallelism, benchmarks/fidelity_tp_cpu.py: the sum was 5-11 % over)
        per_sample = on_stage * layer_input * held + max(layer_tp + scores, ends_here)
    elif mode == "full":  # the first blocks keep their input, the rest everything (estimators/partial_checkpointing.py)
        per_sample = (checkpointed * layer_input + (on_stage - checkpointed) * (layer_tp + scores)) * held + ends_here
    else:
        if mode == "moe":  # the MoE layers keep their input only (estimators/moe_recompute.py): split by t
            layer_tp -= layer * saved_bytes_per_token(shape) / shape.layer_bytes_per_token() / t
        per_sample = on_stage * layer_tp * held + (ends_here if rerun_tp is None else max(rerun_tp, ends_here))
    return per_sample / cp


def activation_moments(profile: ModelProfile, strategy: Strategy, *, stage: int = 0) -> dict[str, int]:
    """Activation bytes at each moment of the step (profile.STEP_PHASES) when the profile's measured fit
    applies and has per-phase envelopes; else ``{"step": activation_bytes(...)}`` (one figure, the peak)."""
    if uses_measured_fit(profile, strategy):
        partial = _compiled_partial_moments(profile, strategy)
        if partial is not None:
            return partial
        fit, copies = measured_fit(profile, strategy)
        phases = fit.phases_at(strategy.mbs, param_copies=copies)
        if phases:
            if not compiles_logit_loss(profile, strategy):
                return dict(phases)
            return compiled_loss_moments(phases, logits_gradient_bytes(profile, strategy, fit.precision))
    peak = activation_bytes(profile, strategy, stage=stage)
    if strategy.model_parallel and strategy.engine == "torch" and strategy.fsdp != "none":
        # the formula gives one peak, taken at every moment: each FSDP buffer then counts at its own moments only
        # (unit gathers while blocks run, the reduce-scatter while gradients are made), not all at once
        # (benchmarks/fidelity_tp_cpu.py: tp x FSDP2 was 25-37 % over with every buffer at one moment)
        return {phase: peak for phase in STEP_PHASES}
    return {"step": peak}
