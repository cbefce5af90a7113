"""What padding an unaligned vocabulary would save: one note where it matters (seconds per step, a share of it).

A vocabulary that is not a multiple of 8 elements (GPT-2's 50,257) makes every logits GEMM unaligned: cuBLAS runs
its fallback kernels, which the fifth H200 visit measured at 5.4x the time per FLOP of the padded GEMMs in bf16
(gemm_measured.py; GPT-2 small's three head GEMMs took 120 of its 228 ms at micro-batch 64 x 1,024). Padding the
embedding and the output layer to a multiple of 64 (nanoGPT's ``vocab_size=50304``; Megatron's
``--make-vocab-size-divisible-by``, which is why Megatron plans never pay it) costs a few unused rows and removes
it. The saving is the head's GEMM time (compute.py ``head_time``) at the vocabulary as it is less at the padded one,
per micro-batch, times the micro-batches of a step (the last pipeline stage's, which holds the head):

    saved = grad_accum x (logits GEMM s(vocab) - logits GEMM s(ceil(vocab / 64) x 64))

A note names it when it is at least ``NOTE_SHARE`` of the step.
"""

from __future__ import annotations

from optplan.estimators.compute import TransformerDims, _align_bytes, head_time, transformer_dims
from optplan.estimators.efficiency import GpuEfficiency, efficiency_for
from optplan.estimators.gemm_measured import catalogue_alignment
from optplan.estimators.hardware import Cluster
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy

PAD_MULTIPLE = 64
"""The multiple a padded vocabulary is rounded up to (elements: 128 bytes in 16-bit, every kernel's alignment)."""
NOTE_SHARE = 0.02
"""A saving of at least this share of the step gets a note (dimensionless)."""


def padded_vocab(vocab: int) -> int:
    """``vocab`` rounded up to a multiple of :data:`PAD_MULTIPLE` (elements)."""
    return -(-vocab // PAD_MULTIPLE) * PAD_MULTIPLE


def _saving_s(dims: TransformerDims | None, strategy: Strategy, cluster: Cluster, eff: GpuEfficiency) -> float:
    if dims is None or not dims.vocab or dims.vocab % PAD_MULTIPLE == 0 or strategy.engine == "megatron":
        return 0.0
    now = head_time(dims, strategy, cluster.gpu, eff).logits_gemm_s
    padded = head_time(dims.model_copy(update={"vocab": padded_vocab(dims.vocab)}), strategy, cluster.gpu,
                       eff).logits_gemm_s
    return max(0.0, now - padded) * strategy.grad_accum


def padding_saving_s(profile: ModelProfile, strategy: Strategy, cluster: Cluster) -> float:
    """Seconds per step that padding the vocabulary would save (module docstring); 0 when it is aligned, unknown,
    or the engine pads it itself (Megatron)."""
    return _saving_s(transformer_dims(profile), strategy, cluster, efficiency_for(cluster.gpu))


def vocab_padding_notes(profile: ModelProfile, strategy: Strategy, cluster: Cluster, step_s: float) -> tuple[str, ...]:
    """One note when padding the vocabulary would save at least :data:`NOTE_SHARE` of the step (the model's
    dimensions and the GPU's efficiencies read once)."""
    dims = transformer_dims(profile)
    eff = efficiency_for(cluster.gpu)
    saved = _saving_s(dims, strategy, cluster, eff)  # 0 when aligned, unknown, or Megatron's
    if dims is None or step_s <= 0 or saved <= 0 or saved < NOTE_SHARE * step_s:
        return ()
    vocab = dims.vocab
    elem = get_recipe(strategy.precision).activation_bytes
    slowdown = (16.0 / _align_bytes(vocab, elem)) ** eff.alignment_exponent
    measured = catalogue_alignment(cluster.gpu.name)
    basis = ("this machine's microbenchmark" if cluster.gpu.gemm_alignment_exponent is not None
             else "measured on the same kind of GPU" if measured is not None else "the GPU's fitted exponent")
    return (f"time: the vocabulary ({vocab:,}) is not a multiple of 8, so the logits GEMMs run unaligned kernels, "
            f"priced at {slowdown:.1f}x the time per FLOP of aligned ones on {cluster.gpu.name} ({basis}); padding "
            f"the embedding and output layer to {padded_vocab(vocab):,} rows "
            f"would save about {saved * 1e3:,.1f} ms a step ({100 * saved / step_s:.0f} %)",)


__all__ = ["NOTE_SHARE", "PAD_MULTIPLE", "padded_vocab", "padding_saving_s", "vocab_padding_notes"]
