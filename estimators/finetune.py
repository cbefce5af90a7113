"""Fine-tuning with adapters: LoRA adapters on a frozen base, the base optionally quantised (QLoRA).

What a LoRA run holds (bytes):
- LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685 §4.1):
  every adapted ``d_out × d_in`` weight ``W`` stays frozen and gains two trainable matrices ``A`` (r × d_in)
  and ``B`` (d_out × r): r·(d_in + d_out) trainable parameters per adapted layer (peft ``lora.Linear``;
  the counts come from the profile, which builds the adapters with peft). Only these have gradients and
  optimizer states; they follow the precision recipe like any trainable parameter (``amp-bf16``: fp32
  adapters under autocast, what peft's ``autocast_adapter_dtype=True`` default keeps; ``bf16-pure``: bf16
  adapters and bf16 AdamW moments, what TRL's ``SFTTrainer`` makes of a quantised model's adapters).
- The frozen base in 16 bits (the Hugging Face ``torch_dtype=bfloat16`` load; fp32 under the fp32 recipe):
  :data:`FROZEN_16BIT_BYTES` per parameter, no gradient, no optimizer state.
- A quantised base (bitsandbytes through ``transformers.BitsAndBytesConfig``) replaces the weight of every
  ``nn.Linear`` except the output head (transformers ``get_keys_to_not_convert``); biases, norms and
  embeddings stay 16-bit:
  - ``int8``: LLM.int8() (Dettmers et al. 2022, arXiv 2208.07339 §3; bitsandbytes ``Int8Params``): one byte per
    weight plus one fp32 scale per output row (``SCB``).
  - ``nf4``: 4-bit NormalFloat (Dettmers et al. 2023, "QLoRA", arXiv 2305.14314 §3): half a byte per weight
    plus one fp32 absmax per block of 64 (32/64 = 0.5 bits per parameter).
  - ``nf4-dq``: NF4 with double quantisation (QLoRA §3, "Double Quantization"): the absmax constants are
    themselves quantised to 8 bits in blocks of 256 with one fp32 constant each: 8/64 + 32/(64·256) =
    0.127 bits per parameter instead of 0.5.
  Checked against bitsandbytes 0.50 on the CPU (tests/estimators/test_finetune.py): the bytes of the
  quantised weight and its quant state match these formulas.
- bitsandbytes' 8-bit matmul (``MatMul8bitLt`` on GPUs, ``MatMul8bitFp`` on CPUs) keeps its input as an attribute
  of the autograd context (``ctx.A``, ``ctx.tensors``), not through ``save_for_backward``, so non-reentrant
  activation checkpointing cannot drop it: under full checkpointing an int8 base keeps, per block, the inputs
  of its quantised layers (attention in, attention out, MLP in: h each; MLP out: F) in the compute dtype
  (:func:`int8_checkpoint_kept_bytes`). Measured on the CPU (benchmarks/fidelity_finetune_cpu.py): without this
  term an int8 base under checkpointing was under-predicted by 7-9 %.
- bitsandbytes' 4-bit matmul before 0.43.2 (``MatMul4Bit`` at 0.42.0: ``ctx.tensors = (A, B)``; dropped by
  bitsandbytes PR #1270, commit 9e753741, "fix QLoRA mem bug: delete useless buffered activation", first in 0.43.2)
  kept its input the same way although backward never reads it. An attribute of the autograd node lives as long
  as the node: through the whole backward, and past it while anything still references the graph. A loop that
  keeps the last step's loss or logits into the next forward (LitGPT's ``fit``: ``logits``/``loss`` are reassigned
  only by the next forward) holds the previous step's inputs at the next forward's peak too; transformers'
  ``Trainer`` returns ``loss.detach()`` and drops the graph with the step. :func:`bnb_kept_input_bytes` counts
  the current step's inputs that autograd does not keep anyway (all of them under non-reentrant checkpointing),
  plus every input of an earlier step the loop still holds (``AdapterProfile.graph_held_steps``). Measured: LitGPT's
  published QLoRA peaks (bitsandbytes 0.42.0; benchmarks/fidelity_finetune_published.py) exceed its LoRA peaks by
  4 bytes per element of these inputs per token and block in five models (2 bytes of this step, 2 of the last).
- LoRA dropout (peft ``lora_dropout`` > 0): each adapted layer draws its own mask and keeps the dropped input for
  its ``lora_A`` gradient, where without dropout ``lora_A`` keeps the layer's input itself (shared by the layers
  that read it). The profile builds the adapters with the requested dropout, so these bytes are measured.
- While a quantised layer computes, bitsandbytes dequantises its weight to the compute dtype (``MatMul4Bit``
  and ``MatMul8bitLt`` in forward and again for the input gradient in backward): one 16-bit copy of the
  largest quantised weight is alive at a time (:func:`dequantized_weight_bytes`).
- Time of that dequantisation (4-bit bases; :func:`dequant_bytes_per_layer`): each pass over a quantised layer
  (forward, the input gradient in backward, the recomputed forward under full checkpointing) reads the packed
  weight with its constants and writes the 16-bit copy; the GEMM then reads that copy where a 16-bit base's GEMM
  reads the weight itself, so the GEMM costs the same. The traffic runs at :data:`DEQUANT_BANDWIDTH_FRACTION` of
  the datasheet HBM bandwidth, fitted on LitGPT's published LoRA and QLoRA runtimes of the same runs
  (benchmarks/fidelity_qlora_time.py). An int8 base multiplies int8 matrices in forward (LLM.int8) and is not
  priced this way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from optplan.estimators.strategy import Strategy

FinetuneMethod = Literal["full", "lora", "qlora"]
QuantName = Literal["none", "int8", "nf4", "nf4-dq"]
QUANT_NAMES: tuple[QuantName, ...] = ("none", "int8", "nf4", "nf4-dq")
QLORA_DEFAULT_QUANT: QuantName = "nf4-dq"
"""QLoRA's recipe (arXiv 2305.14314 §3): NF4 weights with double quantisation."""

LORA_DEFAULT_RANK = 16


class LoraRequest(BaseModel):
    """The adapters asked for: rank, alpha (None: 2·rank) and target module names (None: the model's default)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(default=LORA_DEFAULT_RANK, ge=1)
    alpha: float | None = Field(default=None, gt=0)
    targets: tuple[str, ...] | None = None
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="peft lora_dropout, probability")

    @property
    def scale_alpha(self) -> float:
        """alpha, or 2·rank when not given (a common default; peft's own is 8)."""
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank


FROZEN_16BIT_BYTES = 2
"""Bytes of a frozen base weight held in bf16/fp16, per parameter."""
INT8_ROW_SCALE_BYTES = 4
"""LLM.int8(): one fp32 scale per output row of each quantised weight (bitsandbytes ``Int8Params.SCB``)."""
NF4_BLOCK = 64
"""Weights per 4-bit quantisation block (QLoRA §3; bitsandbytes ``blocksize=64``)."""
NF4_ABSMAX_BYTES = 4
"""One fp32 absmax per 4-bit block without double quantisation."""
DQ_BLOCK = 256
"""Absmax constants per block of the second quantisation (QLoRA §3; bitsandbytes ``compress_statistics``)."""
DQ_ABSMAX_BYTES = 1
"""Each 4-bit block's absmax, quantised to 8 bits under double quantisation."""
DQ_SECOND_BYTES = 4
"""One fp32 constant per block of 256 quantised absmax values."""
DEQUANT_BYTES = 2
"""A dequantised weight in the 16-bit compute dtype, bytes per element."""
DEQUANT_BANDWIDTH_FRACTION = 0.25
"""Achieved ÷ datasheet HBM bandwidth of bitsandbytes' 4-bit dequantisation passes (dimensionless): the median of
LitGPT's nine published LoRA/QLoRA runtime pairs on one A10G (bitsandbytes 0.42.0; config_hub/finetune/README.md
at commit 03ffc551), their QLoRA-minus-LoRA time per micro-batch ÷ the bytes of :func:`dequant_bytes_per_layer`
(0.15-0.28; 7B models 0.25-0.28, gemma-2b and TinyLlama 0.15-0.16, whose LitGPT head is quantised too)."""
BNB_4BIT_KEEPS_INPUT_BEFORE = (0, 43, 2)
"""bitsandbytes versions below this keep every 4-bit layer's input on its autograd node (module docstring)."""


class AdapterProfile(BaseModel):
    """The LoRA adapters the profile was built with, and what a quantiser would replace in the base."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["lora"] = "lora"
    rank: int = Field(ge=1, description="LoRA rank r")
    alpha: float = Field(gt=0, description="LoRA scaling numerator (scale alpha / r)")
    targets: tuple[str, ...] = Field(description="the module names given to peft's target_modules")
    adapted_modules: int = Field(ge=1, description="layers that carry an adapter")
    adapter_params: int = Field(ge=0, description="trainable adapter parameters, r·(d_in + d_out) each")
    quantizable_params: int = Field(
        ge=0, description="weights of the base's nn.Linear layers a bitsandbytes quantiser replaces (every "
                          "Linear but the output head), elements")
    quantizable_rows: int = Field(ge=0, description="output rows of those weights (LLM.int8's row scales), count")
    quantizable_tensors: int = Field(default=0, ge=0, description="those weights, count")
    largest_quantizable_params: int = Field(ge=0, description="the largest of those weights, elements")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="peft lora_dropout the adapters were built with")
    quant_input_elements: int = Field(
        default=0, ge=0, description="distinct inputs of the quantisable layers of one repeated block, elements per "
                                     "token (layers reading one tensor count it once; measured by the profiler)")
    quant_input_unkept_elements: int = Field(
        default=0, ge=0, description="of those, the elements autograd does not keep for backward without "
                                     "checkpointing (elements per token; measured by the profiler)")
    bnb_4bit_keeps_inputs: bool = Field(
        default=False, description="the bitsandbytes where the profile ran keeps each 4-bit layer's input on its "
                                   "autograd node (a version before 0.43.2; module docstring)")
    graph_held_steps: int = Field(
        default=1, ge=1, le=2, description="steps whose autograd graph is alive at a forward's peak: 1 when the "
                                           "training loop drops each step's graph with the step (transformers' "
                                           "Trainer, optplan's exports), 2 when it holds the last step's loss into "
                                           "the next forward (LitGPT's fit loop; module docstring)")


def quantized_weight_bytes(quant: QuantName, elements: int, rows: int, tensors: int = 0) -> float:
    """Bytes of ``elements`` quantised weights in ``rows`` output rows over ``tensors`` tensors (module
    docstring: LLM.int8 §3, QLoRA §3); ``none`` keeps them 16-bit. Block counts round up per tensor, which
    the aggregate figure approximates by adding half a block per tensor."""
    if quant == "none":
        return float(FROZEN_16BIT_BYTES * elements)
    if quant == "int8":
        return float(elements + INT8_ROW_SCALE_BYTES * rows)
    blocks = elements / NF4_BLOCK + 0.5 * tensors
    data = elements / 2
    if quant == "nf4":
        return data + NF4_ABSMAX_BYTES * blocks
    return data + DQ_ABSMAX_BYTES * blocks + DQ_SECOND_BYTES * (blocks / DQ_BLOCK + 0.5 * tensors)


def frozen_weight_bytes(adapter: AdapterProfile, frozen_params: int, quant: QuantName, *,
                        fp32_base: bool = False) -> float:
    """Bytes of the frozen base (``frozen_params`` parameters, adapters excluded): the quantised Linear
    weights at :func:`quantized_weight_bytes`, the rest in 16 bits (fp32 with ``fp32_base``, the fp32
    recipe; a quantised base keeps its other weights 16-bit)."""
    rest_bytes = 4 if fp32_base and quant == "none" else FROZEN_16BIT_BYTES
    if quant == "none":
        return float(frozen_params * rest_bytes)
    quantized = min(adapter.quantizable_params, frozen_params)
    return (quantized_weight_bytes(quant, quantized, adapter.quantizable_rows, adapter.quantizable_tensors)
            + (frozen_params - quantized) * rest_bytes)


def dequantized_weight_bytes(adapter: AdapterProfile | None, quant: QuantName) -> int:
    """The 16-bit copy of the largest quantised weight that bitsandbytes makes while a layer computes (bytes;
    0 without quantisation)."""
    if adapter is None or quant == "none":
        return 0
    return DEQUANT_BYTES * adapter.largest_quantizable_params


def dequant_bytes_per_layer(adapter: AdapterProfile | None, quant: QuantName, layers: int, *,
                            recompute_share: float, tp: int = 1) -> float:
    """Bytes bitsandbytes' 4-bit dequantisation moves per block and micro-batch (module docstring): per pass the
    packed weights and constants read (:func:`quantized_weight_bytes`) plus their 16-bit copy written
    (:data:`DEQUANT_BYTES` per element); 2 passes, plus ``recompute_share`` (1 under full checkpointing, the
    checkpointed blocks' share under partial: estimators/partial_checkpointing.py); the quantisable weights spread
    evenly over ``layers`` blocks and split over ``tp`` ranks. 0 for a 16-bit or int8 base."""
    if adapter is None or quant not in ("nf4", "nf4-dq") or layers < 1:
        return 0.0
    elements = adapter.quantizable_params
    per_pass = (quantized_weight_bytes(quant, elements, adapter.quantizable_rows, adapter.quantizable_tensors)
                + DEQUANT_BYTES * elements)
    return (2 + recompute_share) * per_pass / layers / tp


def int8_checkpoint_kept_bytes(hidden: int, ffn: int, layers: int, tokens: int, micro_batch: int) -> int:
    """Inputs of the int8 layers that full checkpointing cannot free (module docstring): (3·h + F) elements per
    token per block, 2 bytes each, for ``layers`` blocks of ``micro_batch`` × ``tokens`` tokens (bytes)."""
    return DEQUANT_BYTES * (3 * hidden + ffn) * tokens * micro_batch * layers


def bnb_version_keeps_4bit_inputs(version: str) -> bool:
    """Whether bitsandbytes ``version`` (a version string: '0.42.0', '0.43.2.dev0') keeps each 4-bit layer's input
    (below :data:`BNB_4BIT_KEEPS_INPUT_BEFORE`; module docstring). An unreadable version counts as current."""
    parts: list[int] = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        return False
    return tuple(parts + [0] * (3 - len(parts))) < BNB_4BIT_KEEPS_INPUT_BEFORE


def bnb_kept_input_bytes(adapter: AdapterProfile | None, quant: QuantName, *, checkpointing: bool, tokens: int,
                         micro_batch: int, layers: int, tp: int = 1) -> int:
    """Bytes of quantised-layer inputs bitsandbytes keeps on autograd nodes beyond the profiled activations
    (module docstring), 16-bit elements, for ``layers`` blocks of ``micro_batch`` × ``tokens`` tokens.

    The current step keeps the inputs autograd does not keep anyway (``quant_input_unkept_elements``; under
    checkpointing all of them, ``quant_input_elements``); each earlier step the loop still holds
    (``graph_held_steps`` - 1) keeps all of its inputs (its saved activations were freed, the node attributes were
    not). ``int8`` keeps them with every bitsandbytes, ``nf4``/``nf4-dq`` only with ``bnb_4bit_keeps_inputs``."""
    if adapter is None or quant == "none" or (quant != "int8" and not adapter.bnb_4bit_keeps_inputs):
        return 0
    current = adapter.quant_input_elements if checkpointing else adapter.quant_input_unkept_elements
    elements = current + (adapter.graph_held_steps - 1) * adapter.quant_input_elements
    return DEQUANT_BYTES * elements * tokens * micro_batch * layers // tp


def quant_label(quant: QuantName) -> str:
    """Human name: 'NF4 + double quantisation', 'int8 (LLM.int8)'..."""
    return {"none": "16-bit", "int8": "int8 (LLM.int8)", "nf4": "NF4",
            "nf4-dq": "NF4 + double quantisation"}[quant]


def finetune_note(adapter: AdapterProfile, strategy: Strategy) -> str:
    """One line for the estimate's notes: what is trained and how the base is held."""
    return (f"LoRA fine-tune: rank {adapter.rank}, alpha {adapter.alpha:g}, {adapter.adapted_modules} adapted layers "
            f"({adapter.adapter_params:,} trainable parameters); frozen base {quant_label(strategy.quant)}"
            + ("; bitsandbytes dequantises one weight at a time to the compute dtype (bnb_dequantized_weight)"
               + (", its memory traffic priced in memory_bound_s" if strategy.quant in ("nf4", "nf4-dq") else
                  ". Time: the int8 matmul's own cost is not priced (priced as a 16-bit base)")
               if strategy.quant != "none" else ""))
