"""A loss function compiled with torch.compile: the bytes Inductor's fused cross entropy holds and moves per logit.

torchtitan compiles its loss with its blocks (``build_cross_entropy_loss``: ``torch.compile(loss_fn)`` under
``--training.compile``, torchtitan 2025; its 2024-12 ``train.py`` left it commented out, "compiling loss function
causes CUDA errors"), and optplan's training loop compiles the model file's ``loss_fn`` when a plan compiles
(``Strategy.loss_compiled``; probes/trainloop.py). The loss is ``cross_entropy(logits.float(), targets)``.

Eager, ``cross_entropy`` is ``log_softmax`` then ``nll_loss`` on the fp32 upcast: the fp32 copy and the fp32
log-probabilities stay for backward (8 bytes per logit beyond the 16-bit logits the step holds), and the backward
adds fp32 gradients. Compiled, TorchInductor fuses the forward into one reduction kernel and the backward into one
pointwise kernel; the min-cut partitioner saves the 16-bit logits (the step holds them anyway) and two fp32 values
per row (max, log-sum-exp), and the backward writes the gradient in the logits' dtype. Measured on this CPU
(benchmarks/compiled_loss_cpu.py: the process's resident-memory high-water mark over one forward + backward above
the held logits, and Inductor's own byte count of its generated kernels; Inductor's CPU code generation stands for
its Triton one: the fusion and what is saved are the scheduler's and the partitioner's, device-independent):

====================================  ==============  ===========
per logit (the loss's peak)           16-bit logits   fp32 logits
====================================  ==============  ===========
eager, above the held logits          12 B            12 B
compiled, above the held logits       2 B (grad)      4 B (grad)
compiled, moved (forward + backward)  8 B             16 B
====================================  ==============  ===========

So the loss's peak holds the logits and their gradient: :data:`COMPILED_LOSS_PEAK_BYTES_PER_LOGIT`, against the 12
bytes optplan's ``--arch`` profiles count for an eager loss (estimators/arch.py ``LOGIT_BYTES``: the eager backward's
fp32 log-probabilities, their gradient and the input's, the logits freed by the training loop before the backward:
the 12 measured here above logits the harness holds); with recomputation an ``--arch`` profile's peak is the larger
of a layer's rerun and the loss, and a compiled loss saves only what the eager one held above the rerun
(activations.py). Its kernels move :data:`COMPILED_LOSS_TRAFFIC_BYTES_PER_LOGIT` (two reads forward: the row's max,
then its sum of exponentials; a read and a write backward), against the eager ``logits_bytes_per_element``.

A measured profile records the loss as its own moment of the step (``loss``: the loss's forward and backward,
profile.STEP_PHASES). Compiled, that moment holds what the model's forward left (its ``forward`` moment: the logits are
its last and largest tensor) plus the logits' gradient (:func:`compiled_loss_moments`). On examples/llama.py (bf16,
full recomputation) the eager loss holds 10 bytes per logit over the forward's moment (which holds the 16-bit logits: 12 in all), the model's backward 0.5. Under PyTorch's loss parallelism (torch engine, tensor parallelism, logits sharded
over the vocabulary: estimators/loss_parallel.py) the loss runs DTensor's decomposed handlers: priced as those.
"""

from __future__ import annotations

from collections.abc import Mapping

from optplan.estimators.arch import LOGIT_BYTES
from optplan.estimators.loss_parallel import runs_loss_parallel
from optplan.estimators.profile import ActivationPrecision, ModelProfile
from optplan.estimators.strategy import Strategy

COMPILED_LOSS_PEAK_BYTES_PER_LOGIT: dict[str, int] = {"bf16": 4, "fp32": 8}
"""Bytes per logit at a compiled cross entropy's peak: the logits (2 or 4, held by the step) and their gradient in
the same dtype (module docstring's table: 2 / 4 above the held logits)."""
COMPILED_LOSS_TRAFFIC_BYTES_PER_LOGIT: dict[str, int] = {"bf16": 8, "fp32": 16}
"""Bytes per logit Inductor's compiled cross entropy reads and writes, forward + backward (module docstring)."""


def _key(precision: ActivationPrecision | str) -> str:
    return "fp32" if precision == "fp32" else "bf16"


LOSS_OUTSIDE_BYTES_PER_LOGIT = 1.0
"""A measured ``loss`` moment this many bytes per logit above the ``forward`` one (at one sample) shows a loss
function of its own over the logits (an eager cross entropy holds 8-12); a loss the model's forward computes
(Hugging Face's ``output.loss``, which compiling ``loss_fn`` cannot reach) shows about none."""


def loss_outside_model(profile: ModelProfile) -> bool:
    """Whether the profile's loss is a function of its own over the logits, which compiling ``loss_fn`` compiles:
    always for an ``--arch`` shape (its formula counts an eager cross entropy); for a measured profile when a fit's
    ``loss`` moment holds logit-sized tensors above its ``forward`` one (:data:`LOSS_OUTSIDE_BYTES_PER_LOGIT`);
    unknown (older profiles without moments) counts as not."""
    shape = profile.transformer
    if shape is None or not shape.vocab or not profile.tokens_per_sample:
        return False
    if profile.activation_source == "formula":
        return True
    logits = profile.tokens_per_sample * shape.vocab
    for fit in profile.activations:
        phases = fit.phases_at(1, param_copies=False)
        if "loss" in phases and "forward" in phases:
            return phases["loss"] - phases["forward"] >= LOSS_OUTSIDE_BYTES_PER_LOGIT * logits
    return False


def compiles_logit_loss(profile: ModelProfile, strategy: Strategy) -> bool:
    """Whether ``strategy`` runs a compiled cross entropy over the model's logits: the loss compiled
    (``Strategy.loss_compiled``), a language model whose loss is a function of its own (:func:`loss_outside_model`),
    not PyTorch's loss parallelism."""
    return strategy.loss_compiled and loss_outside_model(profile) and not runs_loss_parallel(profile, strategy)


def compiled_loss_saving_bytes_per_logit(precision: ActivationPrecision | str) -> int:
    """Bytes per logit a compiled loss holds less than the eager one an ``--arch`` profile counts (``LOGIT_BYTES`` −
    :data:`COMPILED_LOSS_PEAK_BYTES_PER_LOGIT`: 8 for 16-bit logits, 4 for fp32)."""
    key = _key(precision)
    return max(0, LOGIT_BYTES[key] - COMPILED_LOSS_PEAK_BYTES_PER_LOGIT[key])


def eager_loss_on(strategy: Strategy, device: str) -> Strategy:
    """``strategy`` as a ``device`` run's tracked steps hold their loss: on the CPU the memory tracker's steps run
    eagerly (dynamo skips frames under it), so the loss is priced eager there (probes/trainloop.py records
    ``loss_compiled`` for a CUDA run only); unchanged on a GPU."""
    return strategy if device == "cuda" else strategy.model_copy(update={"compile_loss": False})


def compiled_loss_saving_bytes_per_sample(profile: ModelProfile, strategy: Strategy,
                                          precision: ActivationPrecision) -> float:
    """Bytes per sample (whole vocabulary, every token of the sample) a compiled loss holds less than the eager loss
    an ``--arch`` profile counts (``LOGIT_BYTES`` − :data:`COMPILED_LOSS_PEAK_BYTES_PER_LOGIT`: 8 / 4); 0 when the plan
    does not compile its loss over the logits. The caller splits it as the logits are split (tensor, context
    parallelism)."""
    if not compiles_logit_loss(profile, strategy):
        return 0.0
    assert profile.transformer is not None and profile.tokens_per_sample
    saved = compiled_loss_saving_bytes_per_logit(precision)
    return float(saved * profile.tokens_per_sample * profile.transformer.vocab)


def eager_loss_bytes_per_sample(profile: ModelProfile, precision: ActivationPrecision) -> float:
    """Bytes per sample at an eager cross entropy's peak as an ``--arch`` profile counts it (``LOGIT_BYTES`` per
    logit, whole vocabulary, every token of the sample); 0 for a profile without a vocabulary."""
    shape = profile.transformer
    if shape is None or not shape.vocab or not profile.tokens_per_sample:
        return 0.0
    return float(LOGIT_BYTES[_key(precision)] * profile.tokens_per_sample * shape.vocab)


def logits_gradient_bytes(profile: ModelProfile, strategy: Strategy, precision: ActivationPrecision) -> float:
    """Bytes of the logits' gradient of one micro-batch (whole vocabulary; 16-bit unless the activations are fp32):
    what a compiled loss holds beyond the logits the step already holds (module docstring's table); 0 when the plan
    does not compile its loss over the logits."""
    if not compiles_logit_loss(profile, strategy):
        return 0.0
    assert profile.transformer is not None and profile.tokens_per_sample
    key = _key(precision)
    grad_per_logit = COMPILED_LOSS_PEAK_BYTES_PER_LOGIT[key] // 2  # the peak is the logits and their gradient
    return float(grad_per_logit * profile.tokens_per_sample * profile.transformer.vocab * strategy.mbs)


def compiled_loss_moments(moments: Mapping[str, int], gradient_bytes: float) -> dict[str, int]:
    """A measured profile's activation bytes per moment of the step with the loss compiled: the ``loss`` moment is
    what the forward left (its ``forward`` moment, the logits last) plus the logits' gradient
    (:func:`logits_gradient_bytes`), never more than the eager loss measured; unchanged without both moments."""
    out = dict(moments)
    if "loss" in out and "forward" in out:
        out["loss"] = min(out["loss"], round(out["forward"] + gradient_bytes))
    return out


def compiled_loss_traffic_bytes_per_logit(precision: ActivationPrecision | str) -> int:
    """:data:`COMPILED_LOSS_TRAFFIC_BYTES_PER_LOGIT` of the logits' precision (bytes per logit, forward + backward)."""
    return COMPILED_LOSS_TRAFFIC_BYTES_PER_LOGIT[_key(precision)]


__all__ = [
    "COMPILED_LOSS_PEAK_BYTES_PER_LOGIT",
    "COMPILED_LOSS_TRAFFIC_BYTES_PER_LOGIT",
    "compiled_loss_moments",
    "compiled_loss_saving_bytes_per_logit",
    "compiled_loss_saving_bytes_per_sample",
    "compiled_loss_traffic_bytes_per_logit",
    "compiles_logit_loss",
    "eager_loss_bytes_per_sample",
    "eager_loss_on",
    "logits_gradient_bytes",
    "loss_outside_model",
]
