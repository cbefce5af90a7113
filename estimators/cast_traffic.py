"""HBM bytes autocast's weight casts move per micro-batch (bytes per parameter).

Under an autocast recipe (``amp-bf16``, ``amp-fp16``: fp32 weights, 16-bit matmuls; precision.py) every matmul
casts its fp32 weight to 16 bits on first use inside the autocast region (torch's autocast weight cache keeps the
cast for the rest of that forward: aten/src/ATen/autocast_mode.cpp ``cached_cast``, leaf tensors that require
grad) and autograd casts the 16-bit weight gradient back to fp32 (the backward of ``_to_copy``). Per parameter and
micro-batch (roofline: bytes read + written over the achieved HBM rate, Williams et al. 2009, CACM 52(4)):

* forward cast: read 4, write 2 bytes: 6 for every weight the forward uses (frozen ones too);
* weight-gradient cast: read 2, write 4 bytes: 6 for every trainable weight;
* full activation checkpointing recomputes the forward in backward, outside the cache's lifetime
  (``torch.utils.checkpoint`` re-enters autocast with the saved state): 6 more.

A recipe with 16-bit weights (``bf16``, ``fp16``, ``bf16-pure``) casts nothing per micro-batch; its master-weight
copies are once per step (optimizer_traffic.py). Measured (benchmarks/results/2026-11-26-H200-visit2): the
Llama-3 1B layout ran 5 % fewer samples/s under amp-bf16 than under bf16 at micro-batches 2 and 4 on an H200, and
GPT-2 small 10 %, where the model without these casts put amp-bf16 ahead (its optimizer moves 12 bytes per
parameter less than bf16's, once per step).
"""

from __future__ import annotations

from optplan.estimators.precision import Recipe

CAST_BYTES = 6
"""One cast of one parameter between fp32 and 16 bits: 4 read + 2 written, or 2 read + 4 written (bytes)."""


def autocast_cast_bytes_per_microbatch(recipe: Recipe, *, params: float, trainable: float,
                                       recompute: bool) -> float:
    """Bytes the weight casts of one micro-batch move on one rank holding ``params`` parameters of which
    ``trainable`` are trained (module docstring); 0 for recipes without autocast."""
    if not (recipe.name.startswith("amp-") and recipe.weight_bytes == 4):
        return 0.0
    if params < 0 or trainable < 0:
        raise ValueError("params and trainable must be >= 0")
    forward = CAST_BYTES * params * (2 if recompute else 1)
    return forward + CAST_BYTES * trainable


__all__ = ["CAST_BYTES", "autocast_cast_bytes_per_microbatch"]
