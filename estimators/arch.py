"""A ModelProfile from a decoder's shape alone (``--arch layers=L,hidden=H,heads=A,...``), no model file.

Conventions (a GPT-style decoder, Megatron's counting): per layer attention with q/o of h×h and k/v
of h×(h·K/A) for K key-value heads, an MLP of two h×F matrices (F = 4h by default), two layer norms and
biases; tied input/output embeddings of V×h and learned positions of s×h. With F = 4h and K = A that is
Narayanan et al. 2021 (arXiv 2104.04473) §3's 12·L·h² + 13·L·h + V·h + s·h parameters.
``gated=1`` is a Llama decoder (Touvron et al. 2023, arXiv 2302.13971 §2.2): SwiGLU MLP of three h×F
matrices, RMSNorm (weights only), rotary positions (no position table), no biases; ``tied=0`` gives an
untied output head (Llama 3 8B/70B).
- FLOPs (PaLM, Chowdhery et al. 2022, Appendix B): training 6·N + 12·L·h·s per token with N the
  matmul parameters (positions excluded), i.e. forward 2·N + 4·L·h·s per token, backward twice that.
- Activations (Korthikanti et al. 2022, arXiv 2205.05198, Table 2), bytes per layer per sample with
  16-bit activations: s·h·(34 + 5·a·s/h), the 5·a·s/h term dropped with flash attention (default);
  full recomputation keeps 2·s·h per layer plus one layer's full activations. fp32 doubles them.
  Logits: s·V values held as 16-bit logits, fp32 softmax and fp32 gradient (10 bytes each; 16 in fp32).
Units: parameters, FLOPs, bytes.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from optplan.estimators.errors import OptplanError
from optplan.estimators.profile import (
    SMALL_PARAM_LIMIT,
    ActivationFit,
    ModelProfile,
    RepeatedBlock,
    TransformerShape,
)

DEFAULT_VOCAB = 51200
LOGIT_BYTES = {"bf16": 10, "fp32": 16}


MAX_LAYERS = 10_000
"""Far above any trained decoder (hundreds of layers); the profile lists every layer's tensors, so a
shape like ``layers=1e9`` would otherwise take the memory of a billion-entry tuple."""
MAX_WIDTH = 2**24
"""Largest ``hidden`` and ``ffn`` (16.7M, over 500x today's widest): with the other bounds every figure
(parameters, FLOPs, bytes) stays a finite float."""
MAX_VOCAB = 2**30
MAX_SEQ = 2**30


class ArchSpec(BaseModel):
    """A decoder shape; ``ffn`` defaults to 4·hidden, ``kv_heads`` to heads. Sizes are bounded far above
    real models (``MAX_*``) so a mistyped exponent is one error line, not an exhausted memory or an
    infinite figure."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: int = Field(ge=1, le=MAX_LAYERS)
    hidden: int = Field(ge=1, le=MAX_WIDTH)
    heads: int = Field(ge=1)
    kv_heads: int | None = Field(default=None, ge=1)
    ffn: int | None = Field(default=None, ge=1, le=MAX_WIDTH)
    vocab: int = Field(default=DEFAULT_VOCAB, ge=1, le=MAX_VOCAB)
    seq: int | None = Field(default=None, ge=1, le=MAX_SEQ)
    gated: bool = False
    tied: bool = True
    flash: bool = True

    @model_validator(mode="after")
    def _check(self) -> ArchSpec:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}")
        return self


def parse_arch(text: str, *, seq_len: int | None = None) -> ArchSpec:
    """Parse ``layers=L,hidden=H,heads=A[,kv_heads=K][,ffn=F][,vocab=V][,seq=S][,gated=0|1][,tied=0|1]``
    (sizes may use 1e3)."""
    fields: dict[str, int] = {}
    given: dict[str, str] = {}  # as written, for messages (``1e30``, not its 31 digits)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise OptplanError(f"--arch item {part!r} is not key=value: write e.g. layers=32,hidden=4096,heads=32")
        key = key.strip()
        try:
            number = float(value)
        except ValueError:
            raise OptplanError(f"--arch {key}={value!r} is not a number: give an integer") from None
        if not math.isfinite(number) or number != int(number):
            raise OptplanError(f"--arch {key}={value} is not an integer: give a whole number")
        if key in fields:
            raise OptplanError(f"--arch gives {key} twice ({fields[key]} and {int(number)}): keep one")
        fields[key] = int(number)
        given[key] = f"--arch {key}={value.strip()}"
    known = set(ArchSpec.model_fields) - {"flash"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise OptplanError(f"--arch has unknown key {unknown[0]!r}: use {', '.join(sorted(known))}")
    missing = [k for k in ("layers", "hidden", "heads") if k not in fields]
    if missing:
        raise OptplanError(f"--arch needs {', '.join(missing)}: e.g. layers=32,hidden=4096,heads=32")
    if seq_len is not None:
        if seq_len < 1:
            raise OptplanError(f"--seq-len must be >= 1 (got {seq_len})")
        if "seq" in fields and fields["seq"] != seq_len:
            raise OptplanError(f"--arch seq={fields['seq']} and --seq-len {seq_len} disagree: give the sequence "
                               "length once")
        fields["seq"] = seq_len
        given["seq"] = f"--seq-len {seq_len}"
    try:
        return ArchSpec(**fields)
    except ValueError as err:
        first = err.errors()[0] if hasattr(err, "errors") else {"msg": str(err)}  # type: ignore[attr-defined]
        loc = [str(p) for p in first.get("loc", ())]
        where = given[loc[-1]] if loc and loc[-1] in given else "--arch"
        raise OptplanError(f"invalid {where}: {str(first['msg']).removeprefix('Value error, ')}") from None


def _layer_tensors(spec: ArchSpec) -> list[tuple[int, int]]:
    """(numel, count) of one layer's parameter tensors."""
    h, ffn = spec.hidden, spec.ffn or 4 * spec.hidden
    kv = h * (spec.kv_heads or spec.heads) // spec.heads
    if spec.gated:  # q, o, k, v, gate, up, down, two RMSNorm weights; no biases
        return [(h * h, 2), (kv * h, 2), (h * ffn, 3), (h, 2)]
    # q, o, k, v weights and biases, two MLP matrices and biases, two LayerNorms' weight and bias
    return [(h * h, 2), (h, 2), (kv * h, 2), (kv, 2), (h * ffn, 2), (ffn, 1), (h, 1), (h, 4)]


def _outer_tensors(spec: ArchSpec) -> list[tuple[int, int]]:
    """(numel, count) of the embedding, untied head, position table and final norm."""
    h = spec.hidden
    out = [(spec.vocab * h, 1 if spec.tied else 2), (h, 1 if spec.gated else 2)]
    if spec.seq and not spec.gated:
        out.append((spec.seq * h, 1))
    return out


def arch_params(spec: ArchSpec) -> tuple[int, int]:
    """(total parameters, parameters per layer) under the module docstring's conventions."""
    per_layer = sum(size * n for size, n in _layer_tensors(spec))
    return spec.layers * per_layer + sum(size * n for size, n in _outer_tensors(spec)), per_layer


def arch_factored_state_elements(spec: ArchSpec) -> int:
    """Adafactor second-moment elements (Shazeer & Stern 2018, arXiv 1804.04235) of the ``arch_params``
    model: rows + cols for each weight matrix, numel for biases and norms.

    GPT per layer: q and o (h×h) 2·2h, k and v (kv×h) 2·(h + kv), their biases 2h + 2kv, the MLP's two
    h×F matrices 2·(h + F) and biases F + h, two layer norms 4h: 15h + 4kv + 3F. Plus the tied
    embedding V×h (V + h), the positions s×h (s + h) and the final norm (2h). Gated: q, o 4h, k, v
    2(h + kv), three MLP matrices 3(h + F), two norms 2h; the embedding (and an untied head) V + h, the
    final norm h.
    """
    h, ffn = spec.hidden, spec.ffn or 4 * spec.hidden
    kv = h * (spec.kv_heads or spec.heads) // spec.heads
    if spec.gated:
        per_layer = 4 * h + 2 * (h + kv) + 3 * (h + ffn) + 2 * h
        return spec.layers * per_layer + (spec.vocab + h) * (1 if spec.tied else 2) + h
    per_layer = 4 * h + 2 * (h + kv) + 2 * h + 2 * kv + 2 * (h + ffn) + ffn + h + 4 * h
    positions = spec.seq + h if spec.seq else 0
    return spec.layers * per_layer + (spec.vocab + h) * (1 if spec.tied else 2) + positions + 2 * h


def arch_small_param_counts(spec: ArchSpec) -> dict[int, int]:
    """Sizes of the ``arch_params`` model's tensors of at most SMALL_PARAM_LIMIT elements (numel -> count)."""
    counts: dict[int, int] = {}
    for size, n in _layer_tensors(spec):
        counts[size] = counts.get(size, 0) + n * spec.layers
    for size, n in _outer_tensors(spec):
        counts[size] = counts.get(size, 0) + n
    return {k: v for k, v in sorted(counts.items()) if k <= SMALL_PARAM_LIMIT}


def arch_param_numels(spec: ArchSpec) -> tuple[int, ...]:
    """The ``arch_params`` model's tensor sizes in module order (embedding, positions, layers, final norm,
    untied head): what ``ModelProfile.param_numels`` records for a built model."""
    h = spec.hidden
    head = () if spec.tied else (spec.vocab * h,)
    positions = (spec.seq * h,) if spec.seq and not spec.gated else ()
    layer = tuple(size for size, n in _layer_tensors(spec) for _ in range(n))
    norm = (h,) if spec.gated else (h, h)
    return (spec.vocab * h, *positions, *(layer * spec.layers), *norm, *head)


def profile_from_arch(spec: ArchSpec, *, name: str | None = None) -> ModelProfile:
    """The static profile of a decoder given by shape (per-sample figures at ``spec.seq``)."""
    if spec.seq is None:
        raise OptplanError("--arch needs a sequence length: add seq=S or pass --seq-len")
    s, h, a, v, L = spec.seq, spec.hidden, spec.heads, spec.vocab, spec.layers
    params, per_layer = arch_params(spec)
    shape = TransformerShape(hidden=h, layers=L, heads=a, kv_heads=spec.kv_heads, vocab=v, max_seq_len=s,
                             ffn=spec.ffn, gated=spec.gated)
    # embedding lookups are not matmuls: drop the position table and, when untied, the input embedding
    matmul_params = params - (0 if spec.gated else s * h) - (0 if spec.tied else v * h)
    fwd = (2 * matmul_params + 4 * L * h * s) * s
    attn_term = 0 if spec.flash else 5 * a * s * s
    layer_bytes = s * shape.layer_bytes_per_token() + attn_term
    fits = []
    for precision, scale in (("bf16", 1), ("fp32", 2)):
        logits = s * v * LOGIT_BYTES[precision]
        full = scale * L * layer_bytes + logits
        ckpt = scale * (L * 2 * s * h + layer_bytes) + logits
        fits += [ActivationFit(precision=precision, checkpointing="none", fixed_bytes=0, per_sample_bytes=round(full)),
                 ActivationFit(precision=precision, checkpointing="full", fixed_bytes=0, per_sample_bytes=round(ckpt))]
    return ModelProfile(
        name=name or f"decoder-L{L}-h{h}", path="--arch", model_class="Decoder", params=params,
        trainable_params=params, params_by_module={"embedding": params - L * per_layer, "layers": L * per_layer},
        factored_state_elements=arch_factored_state_elements(spec),
        small_param_counts=arch_small_param_counts(spec),
        param_numels=arch_param_numels(spec),
        repeated_block=RepeatedBlock(class_name="DecoderLayer", count=L, params_per_block=per_layer),
        input_kind="tokens", seq_len=s, tokens_per_sample=s, fwd_flops_per_sample=fwd, bwd_flops_per_sample=2 * fwd,
        activations=tuple(fits), activation_source="formula",
        transformer=shape,
        notes=(f"profile from --arch by formula (Korthikanti et al. 2022 activations"
               f"{', flash attention' if spec.flash else ''}; PaLM FLOPs), not measured",),
    )
