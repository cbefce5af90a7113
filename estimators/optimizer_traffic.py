"""HBM bytes one optimizer step moves per parameter, by implementation (bytes per parameter).

An optimizer step is memory-bound: its time is the bytes it reads and writes over the achieved HBM
bandwidth (roofline, Williams et al. 2009, CACM 52(4)). The bytes depend on *how* the step runs, not only on
what it keeps. ``torch.optim.AdamW`` (``torch.optim.Adam`` with ``decoupled_weight_decay=True``) has three
implementations (estimators/temporaries.py says which one runs where); read off torch 2.13's
torch/optim/adam.py, with P the stepped parameter's bytes (the fp32 master copy when there is one, else the
weight), G the gradient's bytes as the optimizer sees it and s one moment's bytes (two moments):

* ``foreach`` (``_multi_tensor_adam``, non-capturable) and ``single_tensor`` (``_single_tensor_adam``) run the
  same element-wise kernels, one pass each over whole tensors:

  ======================================================  =============
  ``param.mul_(1 - lr·wd)``                                2P
  ``exp_avg.lerp_(grad, 1 - beta1)``                       2s + G
  ``exp_avg_sq.mul_(beta2)``                               2s
  ``exp_avg_sq.addcmul_(grad, grad, 1 - beta2)``           2s + G
  ``sqrt(exp_avg_sq)`` (a new tensor)                      2s
  ``/ bias_correction2_sqrt``                              2s
  ``+ eps``                                                2s
  ``param.addcdiv_(exp_avg, denom, step_size)``            2P + 2s
  ======================================================  =============

  in all 4P + 2G + 14s: 80 bytes for fp32 parameters and moments, against 28 for a fused kernel
  (tests/estimators/test_optimizer_traffic.py counts it again on the installed torch with a dispatch mode).
* ``fused`` (``torch._fused_adamw_``; DeepSpeed's ``FusedAdam`` and apex's/Transformer Engine's
  ``multi_tensor_adam`` likewise): one kernel reads P, G and both moments and writes P and both moments:
  2P + G + 4s.

A recipe with fp32 master weights and 16-bit weights (``bf16``, ``fp16``: precision.py) adds, outside the
optimizer, the 16-bit gradient made fp32 (G16 + 4) and the master copied back into the weight (4 + W16),
and its optimizer then sees fp32 gradients. Measured (benchmarks/results/2026-11-26-H200-visit2/call1/
trace.json, kernel time by category, annotation spans left out): torch AdamW (foreach) on the Llama-3 1B
layout (1.24 B parameters, bf16 recipe) took 26.7 ms of optimizer kernels on an H200, GPT-2 small
(124 M) 2.8 ms: 80 bytes per parameter at 3.6-3.7 TB/s, 0.75-0.77 of the datasheet's 4.8 TB/s, where the
previous count (28 bytes at the datasheet rate) predicted 7.2 and 0.73 ms.

Other optimizers (SGD with momentum, Adafactor, bitsandbytes' 8-bit and paged AdamW, all one kernel or
close to it on a GPU) keep the fused count over their own state bytes: not measured on a GPU.
"""

from __future__ import annotations

from optplan.estimators.precision import Recipe
from optplan.estimators.temporaries import AdamImpl

ADAMW_FAMILY = frozenset({"adamw"})
"""Optimizer names priced by torch AdamW's implementations (the others take the one-kernel count)."""

MASTER_BYTES = 4
"""An fp32 master weight or gradient (bytes)."""


def master_handling_bytes(recipe: Recipe) -> float:
    """Bytes per parameter around the step under fp32 master weights: the 16-bit gradient read and written
    as fp32, the master read and written back as the 16-bit weight (0 without a master copy)."""
    if not recipe.master_bytes:
        return 0.0
    return float(recipe.grad_bytes + MASTER_BYTES + recipe.master_bytes + recipe.weight_bytes)


def optimizer_step_bytes_per_param(optimizer: str, recipe: Recipe, state_bytes_per_param: float,
                                   impl: AdamImpl) -> float:
    """HBM bytes one optimizer step moves per (trainable, local) parameter: the implementation's own traffic
    (module docstring) plus the master-weight handling. ``state_bytes_per_param``: the optimizer's state
    (optimizers.py; both AdamW moments together)."""
    if state_bytes_per_param < 0:
        raise ValueError("state_bytes_per_param must be >= 0")
    stepped = float(recipe.master_bytes or recipe.weight_bytes)
    grad = float(MASTER_BYTES if recipe.master_bytes else recipe.grad_bytes)
    if optimizer in ADAMW_FAMILY and impl in ("foreach", "single_tensor"):
        moment = state_bytes_per_param / 2
        own = 4 * stepped + 2 * grad + 14 * moment
    else:
        own = 2 * stepped + grad + 2 * state_bytes_per_param
    return own + master_handling_bytes(recipe)


UNFUSED_NOTE_SHARE = 0.10
"""An unfused AdamW step taking at least this share of the step gets a note (dimensionless)."""


def unfused_step_note(optimizer: str, recipe: Recipe, state_bytes_per_param: float, impl: AdamImpl,
                      optimizer_s: float, step_s: float) -> str | None:
    """One note when torch's unfused AdamW (foreach or single-tensor) takes a noticeable share of the step: what
    it costs, and what ``fused=True`` (one pass, same states) would cost instead (seconds scale with bytes)."""
    if optimizer not in ADAMW_FAMILY or impl == "fused" or step_s <= 0 or optimizer_s < UNFUSED_NOTE_SHARE * step_s:
        return None
    unfused = optimizer_step_bytes_per_param(optimizer, recipe, state_bytes_per_param, impl)
    fused = optimizer_step_bytes_per_param(optimizer, recipe, state_bytes_per_param, "fused")
    return (f"optimizer: torch.optim.AdamW's default ({impl}) moves {unfused:.0f} B per parameter per step "
            f"(master-weight copies included): "
            f"{optimizer_s * 1e3:,.1f} ms, {100 * optimizer_s / step_s:.0f} % of the step (an H200 measured 26.7 ms "
            f"for 1.24 B parameters); AdamW(fused=True) makes one pass: {fused:.0f} B, about "
            f"{optimizer_s * fused / unfused * 1e3:,.1f} ms (the exported train.py runs the default)")


__all__ = ["ADAMW_FAMILY", "MASTER_BYTES", "UNFUSED_NOTE_SHARE", "master_handling_bytes",
           "optimizer_step_bytes_per_param", "unfused_step_note"]
