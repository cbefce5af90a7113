"""Activations Transformer Engine keeps in fp8: the inputs of the fp8 GEMMs (bytes per token and layer). Only plans
that run Transformer Engine (Megatron) keep them so: torchao's Float8Linear saves bf16 inputs (fp8_backend.py).

Under ``te.fp8_autocast`` (the ``fp8`` recipe, estimators/precision.py) a TE ``Linear`` / ``LayerNormLinear`` casts
its input to fp8 for the GEMM and saves that fp8 copy (one byte per value, plus a per-tensor or per-32-block scale)
for the weight-gradient GEMM, where the bf16 recipe saves the bf16 input (two bytes): TE's
``transformer_engine/pytorch/module/linear.py`` / ``layernorm_linear.py`` save ``inputmat`` / ``ln_out`` after the
fp8 cast (TE user guide, "Using FP8 with Transformer Engine"; Micikevicius et al. 2022, "FP8 Formats for Deep
Learning", arXiv 2209.05433: GEMM inputs in fp8, accumulation in higher precision). TE's
``GroupedLinear`` does the same for the experts. Everything else a layer keeps — norms' inputs, the attention core's
Q/K/V and output, the MLP's gate/up outputs and activation, the router's fp32 logits — stays bf16.

Of Korthikanti et al. 2022 (arXiv 2205.05198) Table 2's per-token count (profile.TransformerShape
``layer_bytes_per_token``) the GEMM inputs are the QKV input (2h, the first layer norm's output) and the MLP / MoE
input (2h, the second's), replicated across tensor-parallel ranks without sequence parallelism; the attention
projection's input (2h) and the down projection's input (2F at the width a token computes through) split by tp; and
an MoE layer's dispatched token copies (2·topk·h), the experts' first GEMM input. fp8 halves each: the saving is
2h replicated and h + F + topk·h·(share of MoE layers) split, bytes per token at 16-bit (activation) scale.

With the MoE layers recomputed (``--checkpointing moe``, estimators/moe_recompute.py) their expert MLPs and copies
are not kept, so only the dense layers' down-projection input counts. Units: bytes per token per layer.
"""

from __future__ import annotations

from optplan.estimators.profile import TransformerShape


def fp8_saved_bytes_per_token(shape: TransformerShape, *, moe_recomputed: bool = False) -> tuple[float, float]:
    """(replicated, tensor-parallel-split) bytes per token and layer that fp8-saved GEMM inputs take off the bf16
    count (module docstring), averaged over the layers like the profile's mean active width."""
    h = shape.hidden
    replicated = 2.0 * h  # QKV input and MLP input: 2h bytes each in bf16, h in fp8
    moe = shape.moe
    if moe is None:
        return replicated, float(h + (shape.ffn or 4 * h))
    share = moe.moe_layers(shape.layers) / shape.layers
    dense_ffn = moe.dense_ffn or moe.moe_ffn
    down = (1 - share) * dense_ffn + (0.0 if moe_recomputed else share * moe.active_ffn())
    copies = 0.0 if moe_recomputed else share * moe.topk * h
    return replicated, h + down + copies
