"""What the static profile measures on a model instance, and the fits it keeps (probes/static.py has the definitions).

:func:`measure` warms a :class:`~optplan.probes.step_runner.StepRunner` up, counts the step's FLOPs (and what the
training loop's selective policy re-runs) and records, for every precision (fp32, bf16 autocast) and checkpointing
mode (none, the op-level selective policy, every repeated block), the live-bytes timelines at two micro-batches,
whose upper envelope over the micro-batch is the activation fit (probes/envelope.py); then the same with the model
held in bf16 (``bf16-weights``) and, for LoRA models, with the frozen base in bf16 (``bf16-frozen``). Without
checkpointing the same steps also count one repeated block's memory-bound bytes per sample by eager precision class
(probes/traffic.py; ``ModelProfile.eager_layer_bytes_per_token``) and, with or without blocks, the kernels the step
launches (``ModelProfile.eager_step``, the host's work: estimators/eager_host.py). :func:`extrapolate` carries a value
measured at one and two blocks to the full depth; :func:`fit_activations` turns the envelopes into the profile's fits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from optplan.estimators.profile import (
    FROZEN_16BIT,
    WEIGHTS_16BIT,
    ActivationFit,
    ActivationPrecision,
    CheckpointMode,
    EagerStep,
)
from optplan.probes.adapters import LORA_MARK
from optplan.probes.envelope import StepEnvelope, activation_fit
from optplan.probes.loader import ModelFileError
from optplan.probes.step_runner import BatchInfo, StepRunner, cast_floating
from optplan.probes.traffic import Traffic, TrafficCounter
from optplan.probes.trainloop import selective_context

PRECISIONS: tuple[ActivationPrecision, ...] = ("fp32", "bf16")
"""The precisions measured on the model as built (fp32 weights), with and without autocast."""
PRECISION_ORDER: tuple[ActivationPrecision, ...] = (*PRECISIONS, WEIGHTS_16BIT, FROZEN_16BIT)
"""Every measured precision, in the profile's order; ``bf16-weights`` is measured on the model cast to
bf16 (:func:`measure_16bit_weights`), ``bf16-frozen`` (LoRA profiles) on its frozen weights cast to bf16
(:func:`measure_frozen_16bit`)."""


@dataclass
class Measurement:
    """Raw numbers of one model instance (one depth)."""

    fwd_flops: int
    bwd_flops: int
    envelopes: dict[tuple[ActivationPrecision, CheckpointMode], StepEnvelope]
    batch_info: BatchInfo
    loss_note: str | None
    first_block_input_grad: bool | None = None
    weights_16bit_note: str | None = None
    selective_recompute_flops: int | None = None
    eager_block_bytes: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Memory-bound bytes of one repeated block per sample by eager precision class: (forward, backward)."""
    self_recompute_flops: int = 0
    """The part of ``bwd_flops`` the model's own activation checkpointing re-runs (probes/self_recompute.py)."""
    eager_block_ops: dict[str, float] = field(default_factory=dict)
    """ATen operators one repeated block's forward dispatches, by eager precision class (probes/traffic.py)."""
    attention_key_heads: int | None = None
    """Key heads the model's attention call receives (probes/attention_heads.py); None: no call seen."""
    eager_step: dict[str, EagerStep] = field(default_factory=dict)
    """The kernels one micro-batch's step launches without checkpointing (at the first batch size) and its counted
    traffic per sample, by eager precision class (probes/traffic.py)."""


def checkpoint_modes(has_blocks: bool) -> tuple[CheckpointMode, ...]:
    """No checkpointing, and when the model has repeated blocks every block checkpointed in full and under the
    training loop's selective policy (the latter where torch has ``create_selective_checkpoint_contexts``)."""
    if not has_blocks:
        return ("none",)
    return ("none", "selective", "full") if selective_context() is not None else ("none", "full")


def modes_for(has_blocks: bool) -> list[tuple[ActivationPrecision, CheckpointMode]]:
    return [(p, c) for p in PRECISIONS for c in checkpoint_modes(has_blocks)]


def measure(runner: StepRunner, batch_sizes: tuple[int, int], *, flops: bool = True) -> Measurement:
    """Warm up, count FLOPs at ``batch_sizes[0]`` and fit the activation envelope of every mode from
    the step's timelines at the two ``batch_sizes``."""
    input_grad = runner.warm_up(batch_sizes[0])
    fwd, bwd, reruns = runner.flops(batch_sizes[0]) if flops else (0, 0, 0)
    recompute = None
    if flops and "selective" in checkpoint_modes(bool(runner.blocks)):  # what the selective policy re-runs
        recompute = max(0, runner.flops(batch_sizes[0], "selective")[1] - bwd)
    envelopes = {}
    eager: dict[str, tuple[float, float]] = {}
    ops: dict[str, float] = {}
    kernels: dict[str, EagerStep] = {}
    for precision, ckpt in modes_for(bool(runner.blocks)):
        envelopes[(precision, ckpt)] = _mode_envelope(runner, batch_sizes, precision, ckpt, eager, ops, kernels)
    sixteen, note = measure_16bit_weights(runner, batch_sizes, eager, ops, kernels)
    envelopes.update(sixteen)
    if any(LORA_MARK in name for name, _ in runner.model.named_parameters()):
        # its AMP plans hold the frozen base in bf16: the amp class's bytes and kernels are that step's
        envelopes.update(measure_frozen_16bit(runner, batch_sizes, eager, ops, kernels))
    assert runner.batch_info is not None
    loss_note = "; ".join(n for n in (runner.batch_note, runner.loss_note, runner.unused_note) if n) or None
    return Measurement(fwd, bwd, envelopes, runner.batch_info, loss_note, input_grad, note, recompute,
                       eager_block_bytes=eager, eager_block_ops=ops, eager_step=kernels, self_recompute_flops=reruns,
                       attention_key_heads=runner.attention_key_heads)


EAGER_CLASS: dict[str, str] = {"fp32": "fp32", "bf16": "amp", WEIGHTS_16BIT: "bf16", FROZEN_16BIT: "amp"}
"""The eager-traffic precision class (estimators/eager_traffic.py) of each profiled activation precision; a LoRA
model's ``bf16-frozen`` steps (its base in bf16 under autocast, as its AMP plans run) replace the ``amp`` class's
counts, measured after the fp32-base autocast steps (which cast every frozen weight, as no AMP LoRA plan does)."""


def _mode_envelope(runner: StepRunner, batch_sizes: tuple[int, int], precision: ActivationPrecision,
                   ckpt: CheckpointMode, eager: dict[str, tuple[float, float]] | None = None,
                   ops: dict[str, float] | None = None,
                   kernels: dict[str, EagerStep] | None = None) -> StepEnvelope:
    """The envelope of one mode from its timelines at the two ``batch_sizes``.

    When a phase's timelines do not line up, the step also runs at the next size (``2 * b1 - b0``: 3 after 1 and
    2) and the phases that line up between the second and third sizes are fitted there
    (:meth:`StepEnvelope.refitted`: micro-batch 1 is often a step of its own). Without checkpointing (and
    ``eager`` given), the memory-bound bytes of one repeated block per sample (forward, backward: the slope
    between the two sizes fitted, probes/traffic.py) go into ``eager``, the operators one block's forward
    dispatched (at the first of them) into ``ops`` and the kernels the whole step launched (:func:`eager_step`)
    into ``kernels``; after a refit these come from the later pair too."""
    b0, b1 = batch_sizes
    counted = eager is not None and ckpt == "none" and precision in EAGER_CLASS
    counters = [TrafficCounter() if counted else None for _ in range(3)]
    t0, t1 = (runner.activation_timeline(b, precision, ckpt, traffic=c) for b, c in zip(batch_sizes, counters[:2], strict=True))
    envelope = StepEnvelope.from_timelines(t0, t1, batch_sizes)
    sizes, first, second = batch_sizes, counters[0], counters[1]
    if envelope.misaligned:
        b2 = 2 * b1 - b0
        later = StepEnvelope.from_timelines(t1, runner.activation_timeline(b2, precision, ckpt, traffic=counters[2]),
                                            (b1, b2))
        envelope = envelope.refitted(later)
        if envelope.later:
            sizes, first, second = (b1, b2), counters[1], counters[2]
    if first is None or second is None or eager is None:
        return envelope
    if kernels is not None:
        kernels[EAGER_CLASS[precision]] = eager_step(first.traffic, second.traffic, sizes)
    if runner.blocks:
        (f0, k0), (f1, k1) = first.traffic.per_block(), second.traffic.per_block()
        n = sizes[1] - sizes[0]
        eager[EAGER_CLASS[precision]] = (max(0.0, (f1 - f0) / n), max(0.0, (k1 - k0) / n))
        if ops is not None:
            ops[EAGER_CLASS[precision]] = first.traffic.ops_per_block()
    return envelope


def eager_step(first: Traffic, second: Traffic, batch_sizes: tuple[int, int]) -> EagerStep:
    """One counted step at each of ``batch_sizes``: the kernels (forward with the loss, backward, one repeated
    block's forward; the first step's) and the per-sample slopes of the memory-bound bytes, the convolutions' FLOPs
    and their channels-first activation bytes, with the bytes' intercept (what a micro-batch moves whatever its
    size: gradient accumulation, the parameters' casts)."""
    n = batch_sizes[1] - batch_sizes[0]

    def slope(field: str) -> float:
        return max(0.0, (getattr(second, field) - getattr(first, field)) / n)

    moved = [t.forward_bytes + t.backward_bytes for t in (first, second)]
    per_sample = max(0.0, (moved[1] - moved[0]) / n)
    return EagerStep(forward_kernels=first.forward_kernels, backward_kernels=first.backward_kernels,
                     block_forward_kernels=first.kernels_per_block(), memory_bytes_per_sample=per_sample,
                     memory_bytes_fixed=max(0.0, moved[0] - per_sample * batch_sizes[0]),
                     memory_forward_bytes_per_sample=slope("forward_bytes"),
                     conv_flops_per_sample=slope("conv_flops"), nchw_conv_bytes_per_sample=slope("nchw_conv_bytes"))


def measure_16bit_weights(runner: StepRunner, batch_sizes: tuple[int, int],
                          eager: dict[str, tuple[float, float]] | None = None,
                          ops: dict[str, float] | None = None,
                          kernels: dict[str, EagerStep] | None = None,
                          ) -> tuple[dict[tuple[ActivationPrecision, CheckpointMode], StepEnvelope], str | None]:
    """The ``bf16-weights`` envelopes: the model's floating parameters and buffers cast to bf16 (tied weights
    kept tied), floating inputs cast, no autocast, one warm-up step (bf16 gradients), then the same
    timelines as the other modes; the model is cast back afterwards. A model that fails to run in bf16
    (an op without a bf16 kernel, a tensor the model creates in fp32 and mixes with its weights) gets no
    such envelopes, and a note: its 16-bit recipes are then priced from the autocast fit without its
    weight copies."""
    model = runner.model
    dtypes = {name: t.dtype for name, t in (*model.named_parameters(remove_duplicate=False),
                                             *model.named_buffers(remove_duplicate=False))}
    envelopes: dict[tuple[ActivationPrecision, CheckpointMode], StepEnvelope] = {}
    note = None
    try:
        cast_floating(model, lambda _name: torch.bfloat16)
        runner.input_dtype = torch.bfloat16
        runner.warm_up(batch_sizes[0])
        for ckpt in checkpoint_modes(bool(runner.blocks)):
            envelopes[(WEIGHTS_16BIT, ckpt)] = _mode_envelope(runner, batch_sizes, WEIGHTS_16BIT, ckpt,
                                                               eager if eager is not None else {}, ops, kernels)
    except ModelFileError as exc:
        envelopes = {}
        note = (f"the model does not train with bf16 weights ({exc.problem}): its 16-bit-weight recipes are "
                "priced from the autocast profile without autocast's weight copies")
    finally:
        runner.input_dtype = None
        cast_floating(model, lambda name: dtypes.get(name))
    return envelopes, note


def measure_frozen_16bit(runner: StepRunner, batch_sizes: tuple[int, int],
                         eager: dict[str, tuple[float, float]] | None = None, ops: dict[str, float] | None = None,
                         kernels: dict[str, EagerStep] | None = None
                         ) -> dict[tuple[ActivationPrecision, CheckpointMode], StepEnvelope]:
    """The ``bf16-frozen`` envelopes of a LoRA model: its frozen parameters cast to bf16, the trainable adapters
    kept in fp32, steps under bf16 autocast (peft's default on a base loaded in bf16, with a Hugging Face
    ``Trainer(bf16=True)``): one warm-up step, then the timelines of the other modes; the model is cast back
    afterwards. A model that fails so gets none (its AMP recipes then use the autocast fit). With ``eager`` (and
    ``ops``, ``kernels``) the step without checkpointing counts the ``amp`` class's traffic (:data:`EAGER_CLASS`)."""
    model = runner.model
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    dtypes = {name: p.dtype for name, p in model.named_parameters(remove_duplicate=False)}
    envelopes: dict[tuple[ActivationPrecision, CheckpointMode], StepEnvelope] = {}
    try:
        cast_floating(model, lambda name: torch.bfloat16 if name in frozen else None)
        runner.warm_up(batch_sizes[0], FROZEN_16BIT)
        for ckpt in checkpoint_modes(bool(runner.blocks)):
            envelopes[(FROZEN_16BIT, ckpt)] = _mode_envelope(runner, batch_sizes, FROZEN_16BIT, ckpt, eager, ops,
                                                             kernels)
    except ModelFileError:
        envelopes = {}
    finally:
        cast_floating(model, lambda name: dtypes.get(name))
    return envelopes



def extrapolate(one: float, two: float, layers: int, base: int = 1) -> float:
    """Value at ``layers`` blocks from values at ``base`` and ``base + 1`` blocks (linear in depth)."""
    return one + (two - one) * (layers - base)


def deeper_step(one: EagerStep, two: EagerStep, layers: int, base: int = 1) -> EagerStep:
    """``two``'s step (measured at ``base + 1`` blocks) carried to ``layers`` blocks with ``one``'s (at ``base``):
    whole-step kernels linear in depth, one block's kept."""
    def line(field: str) -> float:
        value = getattr(two, field)
        if value is None:
            return value
        return max(0.0, extrapolate(getattr(one, field) or 0.0, value, layers, base))

    return two.model_copy(update={f: line(f) for f in DEPTH_FIELDS})


DEPTH_FIELDS: tuple[str, ...] = ("forward_kernels", "backward_kernels", "memory_bytes_per_sample", "memory_bytes_fixed",
                                 "memory_forward_bytes_per_sample", "conv_flops_per_sample",
                                 "nchw_conv_bytes_per_sample")
"""The ``EagerStep`` figures of the whole step, linear in depth (one block's are kept as measured)."""


def fit_activations(envelopes: Mapping[tuple[ActivationPrecision, CheckpointMode], StepEnvelope]
                    ) -> tuple[ActivationFit, ...]:
    """One :class:`ActivationFit` per (precision, checkpointing), fp32 first, no checkpointing first."""
    modes = sorted(envelopes, key=lambda m: (PRECISION_ORDER.index(m[0]), m[1] != "none"))
    return tuple(activation_fit(precision, ckpt, envelopes[(precision, ckpt)]) for precision, ckpt in modes)


__all__ = ["EAGER_CLASS", "PRECISIONS", "PRECISION_ORDER", "Measurement", "checkpoint_modes", "deeper_step",
           "eager_step", "extrapolate", "fit_activations", "measure", "measure_16bit_weights", "measure_frozen_16bit",
           "modes_for"]
