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
  full recomputation keeps 2·s·h per layer plus one layer's full activations (its rerun in the backward), fp32
  doubles them. The loss: :data:`LOGIT_BYTES` per logit (s·V of them) at an eager cross entropy's peak.
  The moments: without recomputation every layer's activations are held at the loss (their sum); with full or
  selective recomputation a layer's rerun happens in the backward, after the loss and its gradient are freed, so
  the peak is the kept bytes plus the larger of the rerun and the loss, not their sum (as the model-parallel path
  of activations.py counts; measured on CPU under tensor parallelism, benchmarks/fidelity_tp_cpu.py: the sum was
  5-11 % over), one figure for one per-rank step however it is laid out (tp/cp/pp 1 or more).
Units: parameters, FLOPs, bytes.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from optplan.estimators.attention import MlaShape
from optplan.estimators.errors import OptplanError
from optplan.estimators.moe import MoeShape, mean_active_ffn, moe_note, routed_expert_params
from optplan.estimators.profile import (
    SMALL_PARAM_LIMIT,
    ActivationFit,
    ModelProfile,
    RepeatedBlock,
    TransformerShape,
)
from optplan.estimators.selective import recompute_flops_per_token_layer, saved_bytes_per_token

DEFAULT_VOCAB = 51200
LOGIT_BYTES = {"bf16": 12, "fp32": 12}
"""Bytes per logit at an eager cross entropy's peak, its backward: ``cross_entropy(logits.float(), targets)`` keeps
the fp32 log-probabilities (4) for the backward, which makes their gradient (4) and the input's gradient (4) at once;
the logits themselves are freed before the backward by the training loop (probes/trainloop.py ``del out``,
torchtitan's ``del pred``) and the fp32 copy after the forward (log_softmax saves its output only). The forward's
moment holds less (16-bit: logits 2 + fp32 copy 4 + log-probabilities 4 = 10; fp32: 8). Measured on CPU
(benchmarks/compiled_loss_cpu.py): 12.00 bytes per logit above the held logits for 16-bit and fp32 logits alike.
Until 2026-12-01 optplan counted 10 / 16 (the 16-bit forward's moment; fp32 with the logits held) and summed the
loss with a recomputed layer's working set, which made up for the 16-bit shortfall where the model ran unsplit and
was 9 % under torchtitan's context-parallel runs where it did not (benchmarks/fidelity_torchtitan.py)."""


MAX_LAYERS = 10_000
"""Far above any trained decoder (hundreds of layers); the profile lists every layer's tensors, so a
shape like ``layers=1e9`` would otherwise take the memory of a billion-entry tuple."""
MAX_WIDTH = 2**24
"""Largest ``hidden`` and ``ffn`` (16.7M, over 500x today's widest): with the other bounds every figure
(parameters, FLOPs, bytes) stays a finite float."""
MAX_VOCAB = 2**30
MAX_SEQ = 2**30
MAX_EXPERTS = 2**16
"""Far above any trained MoE (DeepSeek-V3 routes over 256 experts)."""


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
    head_dim: int | None = Field(default=None, ge=1, le=MAX_WIDTH)
    qk_norm: bool = Field(default=False, description="an RMSNorm of head width on queries and keys (Qwen3, OLMo 2)")
    kv_lora: int | None = Field(default=None, ge=1, le=MAX_WIDTH)
    q_lora: int | None = Field(default=None, ge=1, le=MAX_WIDTH)
    rope_dim: int = Field(default=64, ge=0, le=MAX_WIDTH)
    nope_dim: int | None = Field(default=None, ge=1, le=MAX_WIDTH)
    v_dim: int | None = Field(default=None, ge=1, le=MAX_WIDTH)
    experts: int | None = Field(default=None, ge=2, le=MAX_EXPERTS)
    topk: int | None = Field(default=None, ge=1, le=MAX_EXPERTS)
    moe_ffn: int | None = Field(default=None, ge=1, le=MAX_WIDTH)
    shared_experts: int = Field(default=0, ge=0, le=MAX_EXPERTS)
    moe_every: int = Field(default=1, ge=1, le=MAX_LAYERS)
    first_dense: int = Field(default=0, ge=0, le=MAX_LAYERS)
    rope_theta: float | None = Field(default=None, gt=0, description="rotary base (numerics: the Megatron export's "
                                     "--rotary-base; not priced)")
    norm_eps: float | None = Field(default=None, gt=0, description="normalisation epsilon (numerics: the Megatron "
                                   "export's --norm-epsilon; not priced)")

    @model_validator(mode="after")
    def _check(self) -> ArchSpec:
        if self.hidden % self.heads and self.head_dim is None:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}: give head_dim=D")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}")
        if self.qk_norm and self.kv_lora is not None:
            raise ValueError("qk_norm describes per-head query/key norms of multi-head attention; latent attention "
                             "(kv_lora) has its own: drop qk_norm")
        mla_keys = [k for k in ("q_lora", "nope_dim", "v_dim") if getattr(self, k) is not None]
        if mla_keys and self.kv_lora is None:
            raise ValueError(f"{mla_keys[0]} describes multi-head latent attention: add kv_lora=R")
        if self.kv_lora is not None and not self.gated:
            raise ValueError("kv_lora (multi-head latent attention, DeepSeek-V2) is modelled on gated decoders: "
                             "add gated=1")
        moe_keys = [k for k in ("topk", "moe_ffn") if getattr(self, k) is not None] + \
            [k for k, d in (("shared_experts", 0), ("moe_every", 1), ("first_dense", 0)) if getattr(self, k) != d]
        if self.experts is None:
            if moe_keys:
                raise ValueError(f"{moe_keys[0]} describes MoE layers: add experts=E and topk=K")
            return self
        if self.topk is None:
            raise ValueError(f"experts={self.experts} needs topk=K (the experts each token is routed to)")
        if self.topk > self.experts:
            raise ValueError(f"topk {self.topk} is more than the {self.experts} experts: use topk <= experts")
        if self.moe.moe_layers(self.layers) == 0:
            raise ValueError(f"no layer is sparse with first_dense={self.first_dense} and moe_every={self.moe_every} "
                             f"of {self.layers} layers: lower them")
        return self

    @property
    def moe(self) -> MoeShape | None:
        """The MoE layers (``moe_ffn`` defaults to ``ffn``), or None for a dense decoder."""
        if self.experts is None or self.topk is None:
            return None
        return MoeShape(experts=self.experts, topk=self.topk, moe_ffn=self.moe_ffn or self.ffn or 4 * self.hidden,
                        shared_experts=self.shared_experts, moe_every=self.moe_every, first_dense=self.first_dense,
                        dense_ffn=self.ffn or 4 * self.hidden)

    @property
    def mla(self) -> MlaShape | None:
        """The multi-head latent attention widths, or None for multi-head / grouped-query attention."""
        if self.kv_lora is None:
            return None
        return MlaShape(kv_lora=self.kv_lora, q_lora=self.q_lora, rope_dim=self.rope_dim,
                        nope_dim=self.nope_dim or self.hidden // self.heads, v_dim=self.v_dim or self.hidden // self.heads)


REAL_KEYS = frozenset({"rope_theta", "norm_eps"})
"""--arch keys that take any positive number (1e-5); the others are whole numbers."""


def parse_arch(text: str, *, seq_len: int | None = None) -> ArchSpec:
    """Parse ``layers=L,hidden=H,heads=A[,kv_heads=K][,ffn=F][,vocab=V][,seq=S][,gated=0|1][,tied=0|1]``
    (sizes may use 1e3)."""
    fields: dict[str, float] = {}
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
        real = key in REAL_KEYS
        if not math.isfinite(number) or (not real and number != int(number)):
            raise OptplanError(f"--arch {key}={value} is not {'a finite number' if real else 'an integer'}: give "
                               f"{'e.g. 1e-5' if real else 'a whole number'}")
        if key in fields:
            raise OptplanError(f"--arch gives {key} twice ({fields[key]:g} and {number:g}): keep one")
        fields[key] = number if real else int(number)
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


Tensor = tuple[int, int, int]
"""(rows, cols, count) of parameter tensors; cols 0 for a 1-D tensor (a bias or norm weight)."""


def _numel(t: Tensor) -> int:
    return t[0] * (t[1] or 1)


def _attention_tensors(spec: ArchSpec) -> list[Tensor]:
    if spec.qk_norm and spec.kv_lora is None:  # Qwen3's q_norm and k_norm: one weight of head width each
        return _projection_tensors(spec) + [(spec.head_dim or spec.hidden // spec.heads, 0, 2)]
    return _projection_tensors(spec)


def _projection_tensors(spec: ArchSpec) -> list[Tensor]:
    h = spec.hidden
    if spec.kv_lora is not None:
        return _mla_tensors(spec)
    if spec.head_dim is not None:  # q (a·d x h), o (h x a·d), k and v (K·d x h); biases of those widths
        q, kv = spec.heads * spec.head_dim, (spec.kv_heads or spec.heads) * spec.head_dim
        if spec.gated:
            return [(q, h, 1), (h, q, 1), (kv, h, 2)]
        return [(q, h, 1), (h, q, 1), (q, 0, 1), (h, 0, 1), (kv, h, 2), (kv, 0, 2)]
    kv = h * (spec.kv_heads or spec.heads) // spec.heads
    if spec.gated:  # q, o, k, v; no biases
        return [(h, h, 2), (kv, h, 2)]
    return [(h, h, 2), (h, 0, 2), (kv, h, 2), (kv, 0, 2)]  # q, o, k, v weights and biases


def _mla_tensors(spec: ArchSpec) -> list[Tensor]:
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 §2.1; transformers ``DeepseekV2Attention``):
    queries straight from h (or through a rank-``q_lora`` bottleneck with its RMSNorm), keys and values from a
    shared rank-``kv_lora`` latent (plus one ``rope_dim`` rotary key) with its RMSNorm, per head ``nope_dim`` +
    ``rope_dim`` query/key and ``v_dim`` value dimensions, output heads·v_dim -> h. No biases."""
    h, a = spec.hidden, spec.heads
    nope, v = spec.nope_dim or h // a, spec.v_dim or h // a
    kv_lora = spec.kv_lora or 0
    q_width = a * (nope + spec.rope_dim)
    query = [(q_width, h, 1)] if spec.q_lora is None else \
        [(spec.q_lora, h, 1), (spec.q_lora, 0, 1), (q_width, spec.q_lora, 1)]
    return query + [(kv_lora + spec.rope_dim, h, 1), (kv_lora, 0, 1), (a * (nope + v), kv_lora, 1), (h, a * v, 1)]


def _mlp_tensors(spec: ArchSpec, width: int, count: int = 1) -> list[Tensor]:
    h = spec.hidden
    if spec.gated:  # gate, up (F x h) and down (h x F)
        return [(width, h, 2 * count), (h, width, count)]
    return [(width, h, count), (h, width, count), (width, 0, count), (h, 0, count)]  # two matrices, two biases


def _norm_tensors(spec: ArchSpec) -> list[Tensor]:
    return [(spec.hidden, 0, 2 if spec.gated else 4)]  # two RMSNorm weights, or two LayerNorms' weight and bias


def _is_moe_layer(spec: ArchSpec, index: int) -> bool:
    """Layer ``index`` (0-based) is sparse: past the ``first_dense`` ones, the last of each ``moe_every``."""
    return spec.experts is not None and index >= spec.first_dense and \
        (index - spec.first_dense + 1) % spec.moe_every == 0


def _layer_tensors(spec: ArchSpec, index: int = 0) -> list[Tensor]:
    """(rows, cols, count) of layer ``index``'s parameter tensors: attention, MLP (or router + experts), norms."""
    if _is_moe_layer(spec, index):
        moe = spec.moe
        assert moe is not None
        experts = _mlp_tensors(spec, moe.moe_ffn, moe.experts + moe.shared_experts)
        return _attention_tensors(spec) + [(moe.experts, spec.hidden, 1)] + experts + _norm_tensors(spec)
    return _attention_tensors(spec) + _mlp_tensors(spec, spec.ffn or 4 * spec.hidden) + _norm_tensors(spec)


def _outer_tensors(spec: ArchSpec) -> list[Tensor]:
    """(rows, cols, count) of the embedding, untied head, position table and final norm."""
    h = spec.hidden
    out = [(spec.vocab, h, 1 if spec.tied else 2), (h, 0, 1 if spec.gated else 2)]
    if spec.seq and not spec.gated:
        out.append((spec.seq, h, 1))
    return out


def _layers(spec: ArchSpec) -> list[list[Tensor]]:
    """Every layer's tensors (dense layers share one list, MoE layers another)."""
    dense, sparse = _layer_tensors(spec, -1), None
    out = []
    for i in range(spec.layers):
        if _is_moe_layer(spec, i):
            sparse = sparse or _layer_tensors(spec, i)
            out.append(sparse)
        else:
            out.append(dense)
    return out


def arch_params(spec: ArchSpec) -> tuple[int, int]:
    """(total parameters, parameters per layer) under the module docstring's conventions; with MoE layers the
    per-layer figure is the mean over the layers, rounded down."""
    layers = sum(sum(_numel(t) * t[2] for t in layer) for layer in _layers(spec))
    return layers + sum(_numel(t) * t[2] for t in _outer_tensors(spec)), layers // spec.layers


def arch_factored_state_elements(spec: ArchSpec) -> int:
    """Adafactor second-moment elements (Shazeer & Stern 2018, arXiv 1804.04235) of the ``arch_params``
    model: rows + cols for each weight matrix, numel for biases and norms (GPT per layer: 15h + 4kv + 3F; gated:
    10h + 2kv + 3(h + F); the embedding and an untied head V + h each, positions s + h, the final norm)."""
    def factored(tensors: list[Tensor]) -> int:
        return sum((t[0] + t[1] if t[1] else t[0]) * t[2] for t in tensors)
    return sum(factored(layer) for layer in _layers(spec)) + factored(_outer_tensors(spec))


def arch_small_param_counts(spec: ArchSpec) -> dict[int, int]:
    """Sizes of the ``arch_params`` model's tensors of at most SMALL_PARAM_LIMIT elements (numel -> count)."""
    counts: dict[int, int] = {}
    for tensors in [*_layers(spec), _outer_tensors(spec)]:
        for t in tensors:
            counts[_numel(t)] = counts.get(_numel(t), 0) + t[2]
    return {k: v for k, v in sorted(counts.items()) if k <= SMALL_PARAM_LIMIT}


def arch_param_numels(spec: ArchSpec) -> tuple[int, ...]:
    """The ``arch_params`` model's tensor sizes in module order (embedding, positions, layers, final norm,
    untied head): what ``ModelProfile.param_numels`` records for a built model."""
    h = spec.hidden
    head = () if spec.tied else (spec.vocab * h,)
    positions = (spec.seq * h,) if spec.seq and not spec.gated else ()
    layers = tuple(_numel(t) for layer in _layers(spec) for t in layer for _ in range(t[2]))
    norm = (h,) if spec.gated else (h, h)
    return (spec.vocab * h, *positions, *layers, *norm, *head)


def profile_from_arch(spec: ArchSpec, *, name: str | None = None) -> ModelProfile:
    """The static profile of a decoder given by shape (per-sample figures at ``spec.seq``)."""
    if spec.seq is None:
        raise OptplanError("--arch needs a sequence length: add seq=S or pass --seq-len")
    s, h, a, v, L = spec.seq, spec.hidden, spec.heads, spec.vocab, spec.layers
    params, per_layer = arch_params(spec)
    moe = spec.moe
    ffn = spec.ffn
    idle = 0  # routed experts a token does not visit: parameters that compute nothing for it
    if moe is not None:
        ffn = round(mean_active_ffn(moe, spec.ffn or 4 * h, L))
        idle = routed_expert_params(moe, h, spec.gated, L) * (moe.experts - moe.topk) // moe.experts
    shape = TransformerShape(hidden=h, layers=L, heads=a, kv_heads=spec.kv_heads, vocab=v, max_seq_len=s,
                             ffn=ffn, gated=spec.gated, head_dim=spec.head_dim, moe=moe, mla=spec.mla,
                             rope_theta=spec.rope_theta, norm_eps=spec.norm_eps)
    # embedding lookups are not matmuls: drop the position table and, when untied, the input embedding
    matmul_params = params - (0 if spec.gated else s * h) - (0 if spec.tied else v * h) - idle
    qk_d, v_d = shape.core_head_dims()  # QK^T and AV: 2·s·a·(d_qk + d_v) per token (4·h·s at d = h / heads)
    fwd = (2 * matmul_params + 2 * L * a * (qk_d + v_d) * s) * s
    attn_term = 0 if spec.flash else 5 * a * s * s
    layer_bytes = s * shape.layer_bytes_per_token() + attn_term
    fits = []
    saved = saved_bytes_per_token(shape)
    rerun = recompute_flops_per_token_layer(shape)
    for precision, scale in (("bf16", 1), ("fp32", 2)):
        logits = s * v * LOGIT_BYTES[precision]
        full = scale * L * layer_bytes + logits
        # a layer's rerun and the loss are never held at once (module docstring): the larger of the two
        ckpt = scale * L * 2 * s * h + max(scale * layer_bytes, logits)
        fits += [ActivationFit(precision=precision, checkpointing="none", fixed_bytes=0, per_sample_bytes=round(full)),
                 ActivationFit(precision=precision, checkpointing="full", fixed_bytes=0, per_sample_bytes=round(ckpt))]
        if saved is not None:  # the op-level selective policy (selective.py): what it keeps, plus one layer's rerun
            kept = s * sum(saved) + (attn_term if not spec.flash else 0)  # a math attention's scores are bmm outputs
            fits.append(ActivationFit(precision=precision, checkpointing="selective", fixed_bytes=0,
                                      per_sample_bytes=round(scale * L * kept + max(scale * layer_bytes, logits))))
    return ModelProfile(
        name=name or f"decoder-L{L}-h{h}", path="--arch", model_class="Decoder", params=params,
        trainable_params=params, params_by_module={"embedding": params - L * per_layer, "layers": L * per_layer},
        factored_state_elements=arch_factored_state_elements(spec),
        small_param_counts=arch_small_param_counts(spec),
        param_numels=arch_param_numels(spec),
        repeated_block=RepeatedBlock(class_name="DecoderLayer", count=L, params_per_block=per_layer),  # MoE: mean
        input_kind="tokens", seq_len=s, tokens_per_sample=s, fwd_flops_per_sample=fwd, bwd_flops_per_sample=2 * fwd,
        selective_recompute_flops_per_sample=None if rerun is None else L * s * rerun,
        activations=tuple(fits), activation_source="formula",
        transformer=shape,
        notes=(f"profile from --arch by formula (Korthikanti et al. 2022 activations"
               f"{', flash attention' if spec.flash else ''}; PaLM FLOPs), not measured",
               *((moe_note(moe, L),) if moe is not None else ())),
    )
