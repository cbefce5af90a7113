"""What LoRA changes in a transformer layer's time: the frozen base's GEMMs lose their weight gradients, the
adapters' rank-r GEMMs are added, and autocast casts only the weights held in fp32 (seconds; FLOPs).

LoRA (Hu et al. 2021, arXiv 2106.09685, §4.1-4.2) freezes every base weight W and trains a low-rank update B·A
(A: d_in → r, B: r → d_out) beside each adapted linear layer, so its backward computes the base's input gradient
(data gradient) but no weight gradient: the base GEMMs' backward is one GEMM where full training runs two
(Narayanan et al. 2021 §3). The adapters' own GEMMs are thin (one dimension r) and so bound by their memory traffic:
each re-reads the layer's input or writes an output as wide as the layer's. Priced by the roofline
(estimators/gemm.py) on one aggregate per layer: the layer's adapted widths Σ(d_in + d_out) (the profile's adapter
parameters per layer ÷ r, AdapterProfile), split evenly between the A and B sides. The frozen base is held in 16
bits under autocast (estimators/finetune.py ``frozen_weight_bytes``), so autocast casts the fp32 adapters only.

Units: seconds, FLOPs, parameter counts; widths in elements.
"""

from __future__ import annotations

from optplan.estimators.gemm import gemm_train_time_s
from optplan.estimators.profile import ModelProfile


def adapter_width_per_layer(profile: ModelProfile, layers: int) -> float:
    """Σ(d_in + d_out) of one layer's adapted linear layers (elements): adapter parameters per layer ÷ rank; 0 without
    adapters."""
    a = profile.adapter
    if a is None or layers <= 0 or a.rank <= 0:
        return 0.0
    return a.adapter_params / layers / a.rank


def adapter_layer_time_s(tokens: float, width: float, rank: int, *, tp: int = 1,
                         **gemm_kw: object) -> tuple[float, float, float]:
    """(forward s, backward s, forward FLOPs) of one layer's adapter GEMMs for ``tokens`` tokens on one of ``tp``
    ranks: A (tokens × d_in → r) and B (tokens × r → d_out) with d_in = d_out = width / 2, each with its data and
    weight gradients (the adapters train); ``gemm_kw`` are gemm_time_s's rate arguments."""
    if width <= 0 or rank <= 0 or tokens <= 0:
        return 0.0, 0.0, 0.0
    half = width / (2.0 * tp)
    a_fwd, a_bwd = gemm_train_time_s(tokens, rank, half, **gemm_kw)  # x·Aᵀ
    b_fwd, b_bwd = gemm_train_time_s(tokens, half, rank, **gemm_kw)  # (x·Aᵀ)·Bᵀ
    return a_fwd + b_fwd, a_bwd + b_bwd, 2.0 * tokens * rank * width / tp


def cast_params(profile: ModelProfile, params: float) -> float:
    """Of ``params`` parameters, those autocast casts each forward (counts): all of them for full training, only the
    trainable ones (the fp32 adapters) when a LoRA base is held in 16 bits."""
    if profile.adapter is None or not profile.params:
        return params
    return params * profile.trainable_params / profile.params


__all__ = ["adapter_layer_time_s", "adapter_width_per_layer", "cast_params"]
