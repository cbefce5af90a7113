"""Elementwise traffic of one eager transformer layer per token (data/eager_traffic.yaml).

The torch and DeepSpeed engines run the user's model as written: every norm, activation, rotary embedding,
residual add, autocast cast and copy is its own memory-bound kernel that reads its inputs from HBM and writes its
outputs. Megatron's fused kernels move far fewer bytes (estimators/compute.py counts those, Korthikanti et al. 2022
§4). The eager bytes are *measured*, not assumed: ``benchmarks/eager_traffic.py`` counts the bytes of every
memory-bound ATen operator of one layer (probes/traffic.py, a ``TorchDispatchMode`` on fake tensors) on the two
reference blocks of examples/ and fits, per token,

    bytes = c_h·h + c_ffn·F + c_kv·kv + c_d·d (+ c_gqa·h when grouped-query k/v heads are repeated)

for the forward and the backward, per MLP kind (``gated``: examples/llama.py's Llama layer, RMSNorm in fp32,
rotate-half RoPE, SwiGLU; ``plain``: examples/gpt2.py's nanoGPT block, LayerNorm, GELU, biases) and precision
class (``fp32``; ``amp``: bf16 autocast over fp32 weights, its casts included; ``bf16``: 16-bit weights, no
autocast; also the fp8 recipe, whose per-GEMM casts to fp8 are not counted). The counts are linear in the widths
(largest fit residual 0.5 %). A model file's (or ``--hf`` config's) profile counts its own block's operators the
same way (``ModelProfile.eager_layer_bytes_per_token``, probes/activation_measure.py): those replace the reference, split across
tensor-parallel ranks as the reference splits (a transformers Llama layer under autocast moves ~9 % more than
examples/llama.py's); ``--arch`` shapes take the reference of their kind (``gated``).

Tensor parallelism (Shoeybi et al. 2019 §3): a rank runs its heads' and its MLP slice's kernels (kv, F and the
repeated k/v split by t) and, with sequence parallelism (Korthikanti et al. 2022 §4.2.2), the norms and residual
adds of s/t tokens; without it every rank runs those on all tokens (the h term is not split; the q-side RoPE
share of it, split by heads in truth, is then over-counted: stated).

Compiled blocks (``--compile``: TorchInductor fuses each block's elementwise operators into a few generated kernels)
move fewer bytes, and those are measured too: ``benchmarks/compiled_traffic.py`` compiles the same two reference blocks
and sums Inductor's own count of the bytes its generated kernels read and write (``GraphLowering.count_bytes``), fitted
to the same terms (data/compiled_traffic.yaml: forward and backward in one figure). A compiled Llama layer moves ~0.33x
its eager bytes under AMP (Inductor fuses the fp32 RMSNorm, RoPE, the k/v repeat and SwiGLU) and ~1.7x Megatron's
hand-fused count, which compiled plans were priced at before; a plain GPT-2 block moves about what it moves eager
(its eager kernels are already one per fused group), less autocast's casts.

Units: bytes per token per layer; h, F, kv (kv heads × head width) and d (head width) are element counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict

T = TypeVar("T")

BlockKind = Literal["gated", "plain"]
PrecisionClass = Literal["fp32", "amp", "bf16"]


class TrafficCoefficients(BaseModel):
    """Bytes per token of one layer per unit of each width (forward or backward)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    h: float
    ffn: float
    kv: float = 0.0
    head_dim: float = 0.0
    gqa: float = 0.0


class EagerTrafficData(BaseModel):
    """The fitted coefficients of data/eager_traffic.yaml and their source."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str
    unit: str
    blocks: dict[str, dict[str, dict[str, TrafficCoefficients]]]


@cache
def eager_traffic_data() -> EagerTrafficData:
    """The packaged eager coefficients (read once)."""
    text = resources.files("optplan.estimators").joinpath("data/eager_traffic.yaml").read_text()
    return EagerTrafficData.model_validate(yaml.safe_load(text))


@cache
def compiled_traffic_data() -> EagerTrafficData:
    """The packaged compiled (TorchInductor) coefficients (read once; same schema, forward + backward in ``fwd``)."""
    text = resources.files("optplan.estimators").joinpath("data/compiled_traffic.yaml").read_text()
    return EagerTrafficData.model_validate(yaml.safe_load(text))


def precision_class(weight_bytes: int, activation_bytes: int) -> PrecisionClass:
    """``fp32`` (4-byte activations), ``amp`` (16-bit activations over fp32 weights: autocast) or ``bf16``."""
    if activation_bytes >= 4:
        return "fp32"
    return "amp" if weight_bytes >= 4 else "bf16"


def class_figure(by_class: Mapping[str, T], weight_bytes: int, activation_bytes: int) -> T | None:
    """A profile's per-class figure (``ModelProfile.eager_layer_ops``, ``eager_step``) for a recipe's bytes: its own
    class's, else the nearest class counted (amp, bf16, fp32, in that order); None when it counted none."""
    for key in (precision_class(weight_bytes, activation_bytes), "amp", "bf16", "fp32"):
        if key in by_class:
            return by_class[key]
    return None


def layer_bytes_per_token(*, kind: BlockKind, precision: PrecisionClass, hidden: float, ffn: float, kv: float,
                          head_dim: float, grouped_query: bool, tp: int = 1, sp: bool = False, compiled: bool = False
                          ) -> tuple[float, float]:
    """(forward, backward) eager elementwise bytes per token of one layer on one tensor-parallel rank (module
    docstring). ``ffn`` is the MLP width F (a gated MLP's gate/up width), ``kv`` the k (or v) projection width.
    ``compiled``: the block compiled by TorchInductor (forward + backward returned as the forward, backward 0)."""
    coef = (compiled_traffic_data() if compiled else eager_traffic_data()).blocks[kind][precision]
    r = 1.0 / tp if sp else 1.0
    out = []
    for c in (coef["fwd"], coef["bwd"]):
        moved = (c.h * hidden * r + c.ffn * ffn / tp + c.kv * kv / tp + c.head_dim * head_dim
                 + (c.gqa * hidden / tp if grouped_query else 0.0))
        out.append(max(0.0, moved))
    return out[0], out[1]
