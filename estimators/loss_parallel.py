"""Activation bytes of PyTorch's loss parallelism: the vocabulary-parallel cross entropy a torch-engine plan with
tensor parallelism runs when the model carries no plan of its own (torchtitan's ``loss_parallel``), per sample
(bytes).

torchtitan shards the output projection's result over the vocabulary (``ColwiseParallel(output_layouts=Shard(-1))``)
and computes ``cross_entropy(pred.flatten(0, 1).float(), labels)`` under
``torch.distributed.tensor.parallel.loss_parallel()``. That context decomposes the loss into DTensor handlers
(``torch/distributed/tensor/parallel/loss.py``, ``_log_softmax`` and ``_nll_loss_and_log_softmax_backward``) that
hold more fp32 tensors of the local logits' shape (T tokens × V/t) than a fused cross-entropy kernel:

* forward: the 16-bit logits (2 bytes per local logit, held by the training step), their fp32 copy (4), ``shifted =
  x - max`` (4) and ``exp(shifted)`` (4) at once: 14 bytes; the log-probabilities (4) stay for the backward;
* backward: the saved log-probabilities (4), ``grad_input = zeros_like(x)`` (4), ``exp(x)`` (4) and their sum (4)
  at once: 16 bytes per local logit, the loss's peak.

optplan's ``--arch`` profiles (estimators/arch.py ``LOGIT_BYTES``) count 12 bytes per logit (an eager cross
entropy's backward: fp32 log-probabilities, their gradient and the input's, the logits freed): loss parallelism adds
the difference, ``LOSS_PARALLEL_PEAK_BYTES_PER_LOGIT - LOGIT_BYTES``, on the last pipeline stage. Found on torchtitan's
Llama 3 70B runs (tp 8, local batch 16, sequence 8,192: 2.1 G local logits), whose reserved memory was 20-25 %
above the prediction (benchmarks/fidelity_torchtitan.py). A model's own tensor plan that gathers the logits
(estimators/tensor_plan.py) runs its own, measured loss instead, and Megatron its fused vocabulary-parallel kernel.
"""

from __future__ import annotations

from optplan.estimators.arch import LOGIT_BYTES
from optplan.estimators.profile import ActivationPrecision, ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.tensor_plan import gathers_logits

LOSS_PARALLEL_PEAK_BYTES_PER_LOGIT = 16
"""Bytes per local logit at loss parallelism's peak, its backward (module docstring): fp32 log-probabilities, the
zero-filled gradient, exp of the log-probabilities and their sum."""


def runs_loss_parallel(profile: ModelProfile, strategy: Strategy) -> bool:
    """True when ``strategy`` computes its loss with PyTorch's loss parallelism: the torch engine with tensor
    parallelism, the logits left sharded over the vocabulary (no model plan gathering them)."""
    return (strategy.engine == "torch" and strategy.tp > 1 and not gathers_logits(profile, strategy)
            and profile.transformer is not None and bool(profile.transformer.vocab))


def loss_parallel_extra_bytes_per_sample(profile: ModelProfile, strategy: Strategy,
                                         precision: ActivationPrecision) -> float:
    """Bytes per sample loss parallelism holds on one tensor-parallel rank of the last stage beyond the fused
    cross entropy the profile counts (module docstring); 0 when the plan does not run it."""
    if not runs_loss_parallel(profile, strategy) or not profile.tokens_per_sample:
        return 0.0
    assert profile.transformer is not None
    counted = LOGIT_BYTES["fp32" if precision == "fp32" else "bf16"]
    extra = max(0, LOSS_PARALLEL_PEAK_BYTES_PER_LOGIT - counted)
    return float(extra * profile.tokens_per_sample * profile.transformer.vocab / strategy.tp)


__all__ = ["LOSS_PARALLEL_PEAK_BYTES_PER_LOGIT", "loss_parallel_extra_bytes_per_sample", "runs_loss_parallel"]
