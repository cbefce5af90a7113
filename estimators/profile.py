"""ModelProfile: what the static probe learned about a model, as plain serialisable data.

Produced by ``optplan.probes.static`` (in a child process) and consumed by the estimators. All byte
counts are bytes; FLOP counts are floating-point operations (multiply and add counted as 2).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.attention import MlaShape
from optplan.estimators.finetune import AdapterProfile
from optplan.estimators.moe import MoeShape, moe_extra_bytes_per_token
from optplan.estimators.tensor_plan import TensorPlan

ActivationPrecision = Literal["fp32", "bf16", "bf16-weights", "bf16-frozen"]
"""How a profiled step ran: ``fp32`` weights and math; ``bf16`` autocast over fp32 weights (AMP: the weights,
their gradients and the loss stay fp32, autocast caches bf16 copies of the weights); ``bf16-weights`` the
model held in bf16 (parameters, gradients and buffers) with floating inputs cast to bf16 and no autocast:
what a model ``.to(bf16)``, DeepSpeed's bf16/fp16 engines and FSDP2's ``MixedPrecisionPolicy(param_dtype)``
run, where every gradient temporary (a tied weight's two gradients and their sum) and the loss's own
tensors are 16-bit too; ``bf16-frozen`` (profiles with LoRA adapters only) the frozen weights held in bf16, the
trainable adapters in fp32, under bf16 autocast: what peft (``autocast_adapter_dtype=True``) and a Hugging Face
``Trainer(bf16=True)`` run on a base loaded in bf16."""
WEIGHTS_16BIT: ActivationPrecision = "bf16-weights"
FROZEN_16BIT: ActivationPrecision = "bf16-frozen"
CheckpointMode = Literal["none", "selective", "full"]
StepPhase = Literal["forward", "loss", "backward", "grads", "stem_grads"]
STEP_PHASES: tuple[StepPhase, ...] = ("forward", "loss", "backward", "grads", "stem_grads")
"""The moments of a training step that decide which engine buffers are alive beside the activations:
``forward`` the model's forward (its parameters are in use), ``loss`` from the model's output to the
gradient of that output (the loss function's forward and backward, outside the model: FSDP has
resharded every unit, no parameter gradient exists yet), ``backward`` the model's backward until the
first parameter gradient is accumulated, ``grads`` the rest of the repeated blocks' backward (gradient
buckets, partitions and reduce-scatters are alive), ``stem_grads`` the backward before the first block
(the embedding or stem, once every block's gradient exists: FSDP has resharded the block units). Profiles
made before ``stem_grads`` existed count that part in ``grads``."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RepeatedBlock(_Frozen):
    """The block class a model repeats (a transformer layer, a ResNet bottleneck...).

    Used for FSDP wrapping and activation checkpointing. ``path`` is the dotted attribute path of the
    container holding the blocks (e.g. ``transformer.h``) when they sit in one ``nn.ModuleList``.
    """

    class_name: str
    count: int = Field(ge=1)
    params_per_block: int = Field(ge=0)
    path: str | None = None


class ActivationFit(_Frozen):
    """Activation memory of one forward+backward as a function of the micro-batch ``b`` (bytes).

    Measured as the peak of live tensor bytes during forward, loss and backward above the resident
    model states (parameters and already-allocated gradients), i.e. activations plus temporaries,
    on the fake CPU device (FakeTensorMode), at two micro-batch sizes.

    Profiles record ``lines``: the live bytes after each allocation of the step are a line
    ``intercept + bytes_per_sample * b`` (the same operator allocates a tensor linear in ``b`` at either
    size), so the peak at any ``b`` is the largest of those lines — the upper envelope kept here, by
    increasing slope. The peak moves along the step as ``b`` grows (e.g. from the embedding's backward,
    whose vocabulary-sized buffers do not grow with ``b``, to the start of backward, which does), which
    one straight line through two sizes misses. ``fixed_bytes + per_sample_bytes * b`` is the steepest
    line (the peak at large ``b``); with no ``lines`` (hand-made or formula fits, older profiles) it is
    the whole fit.
    """

    precision: ActivationPrecision
    checkpointing: CheckpointMode
    fixed_bytes: int
    per_sample_bytes: int = Field(ge=0)
    param_copy_bytes: int = Field(
        default=0, ge=0,
        description="how much of bytes_at(1) is autocast's low-precision copies of the parameters (bytes). "
                    "Only AMP (fp32 weights under autocast) holds them: with 16-bit weights the weights "
                    "themselves are used, so an estimator drops them for such recipes. The share depends on "
                    "the micro-batch when the fit has lines: use bytes_at(b, param_copies=False) (0 for fp32)",
    )
    lines: tuple[tuple[int, int], ...] = Field(
        default=(),
        description="upper envelope of the step's live-bytes lines, (intercept bytes, bytes per sample) by "
                    "increasing slope: bytes_at(b) is the largest of them; () means the single line "
                    "fixed_bytes + per_sample_bytes * b",
    )
    lines_without_copies: tuple[tuple[int, int], ...] = Field(
        default=(),
        description="the same envelope not counting autocast's parameter copies (what a model with 16-bit "
                    "weights holds); () means lines minus param_copy_bytes",
    )
    phase_lines: dict[StepPhase, tuple[tuple[int, int], ...]] = Field(
        default_factory=dict,
        description="the envelope of each moment of the step (STEP_PHASES), so that an engine's buffers are "
                    "added only to the moments they live in; the largest of them is ``lines``. Empty when "
                    "unknown (older, hand-made or formula fits): every buffer is then added to the peak",
    )
    phase_lines_without_copies: dict[StepPhase, tuple[tuple[int, int], ...]] = Field(
        default_factory=dict, description="``phase_lines`` without autocast's parameter copies")

    def bytes_at(self, micro_batch: int, param_copies: bool = True) -> int:
        """Activation bytes for ``micro_batch`` samples (bytes); with ``param_copies=False``, without
        autocast's copies of the parameters (for recipes whose weights are already 16-bit)."""
        if not param_copies and self.lines_without_copies:
            return _envelope_at(self.lines_without_copies, micro_batch)
        if self.lines:
            total = _envelope_at(self.lines, micro_batch)
        else:
            total = max(0, self.fixed_bytes + self.per_sample_bytes * micro_batch)
        return total if param_copies else max(0, total - self.param_copy_bytes)

    def phases_at(self, micro_batch: int, param_copies: bool = True) -> dict[StepPhase, int]:
        """Activation bytes at each moment of the step (STEP_PHASES) for ``micro_batch`` samples (bytes);
        empty when the fit has no phase lines. Their maximum is :meth:`bytes_at`."""
        lines = self.phase_lines if param_copies else (self.phase_lines_without_copies or self.phase_lines)
        return {phase: _envelope_at(ls, micro_batch) for phase, ls in lines.items() if ls}

    def param_copies_at(self, micro_batch: int) -> int:
        """How much of ``bytes_at(micro_batch)`` is autocast's copies of the parameters (bytes)."""
        return self.bytes_at(micro_batch) - self.bytes_at(micro_batch, param_copies=False)

    def fixed_at(self, micro_batch: int) -> int:
        """``bytes_at(micro_batch)`` less ``per_sample_bytes * micro_batch``: the part of the peak that
        does not scale with the samples at this micro-batch (bytes; ``fixed_bytes`` without lines). An
        estimator that rescales the per-sample part (tensor/pipeline parallelism) keeps this part."""
        return self.bytes_at(micro_batch) - self.per_sample_bytes * micro_batch


def _envelope_at(lines: tuple[tuple[int, int], ...], micro_batch: int) -> int:
    """The largest ``intercept + slope * micro_batch`` of ``lines``, at least 0 (bytes)."""
    return max(0, max(a + c * micro_batch for a, c in lines))


class TransformerShape(_Frozen):
    """Transformer dimensions when the profile can read them from the model (else None).

    ``ffn`` None means 4·hidden; ``gated`` marks a Llama-style block (SwiGLU MLP of three matrices, no
    biases, no dropout) rather than a GPT one (two-matrix GeLU MLP, dropout).
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int | None = None
    vocab: int | None = None
    max_seq_len: int | None = None
    ffn: int | None = None
    gated: bool = False
    head_dim: int | None = Field(default=None, description="per-head query/key/value width when it is not "
                                                          "hidden / heads (Qwen3, Gemma); None: hidden / heads")
    moe: MoeShape | None = Field(default=None, description="the sparse (Mixture-of-Experts) layers; ``ffn`` is then "
                                                          "the per-layer mean width a token computes through "
                                                          "(estimators/moe.py mean_active_ffn)")
    mla: MlaShape | None = Field(default=None, description="multi-head latent attention (DeepSeek-V2), or None for "
                                                          "multi-head / grouped-query attention")
    rope_theta: float | None = Field(default=None, gt=0, description="rotary embedding base (theta) as the model "
                                     "states it; numerics only, not priced: carried to the Megatron export "
                                     "(--rotary-base). None: not stated")
    norm_eps: float | None = Field(default=None, gt=0, description="epsilon of the model's normalisation layers; "
                                   "numerics only, carried to the Megatron export (--norm-epsilon). None: not stated")

    @property
    def kv_dim(self) -> int:
        """Width of the key (or value) projection: kv_heads · head_dim (hidden · kv_heads / heads by default)."""
        if self.head_dim is not None:
            return (self.kv_heads or self.heads) * self.head_dim
        return self.hidden * (self.kv_heads or self.heads) // self.heads

    def attention_params(self) -> int:
        """Weights of one layer's attention projections (count): q, k, v, o for multi-head / grouped-query
        attention at ``head_dim``; the latent projections of multi-head latent attention (estimators/attention.py)."""
        h, a = self.hidden, self.heads
        if self.mla is not None:
            m = self.mla
            q = a * (m.nope_dim + m.rope_dim)
            query = q * h if m.q_lora is None else m.q_lora * h + q * m.q_lora
            return query + (m.kv_lora + m.rope_dim) * h + a * (m.nope_dim + m.v_dim) * m.kv_lora + h * a * m.v_dim
        d = self.head_dim or h / a
        return round(2 * h * a * d + 2 * h * self.kv_dim)

    def core_head_dims(self) -> tuple[float, float]:
        """(query/key, value) widths per head that the attention core multiplies by (elements)."""
        if self.mla is not None:
            return float(self.mla.nope_dim + self.mla.rope_dim), float(self.mla.v_dim)
        d = float(self.head_dim or self.hidden / self.heads)
        return d, d

    def layer_bytes_per_token(self) -> int:
        """Activation bytes one layer stores per token with 16-bit activations and no s×s scores.

        Korthikanti et al. 2022 (arXiv 2205.05198) §4.1 counts a GPT layer as 34·h: attention 11·h (QKV
        input 2h, Q and K 4h, V 2h, projection input 2h, dropout mask h), MLP 19·h (input 2h, two 4h-wide
        outputs 8h each, dropout mask h) and two layer-norm inputs 4h. Generalised to key-value width kv
        and MLP width F: GPT 14·h + 4·kv + 4·F; gated (Llama: SwiGLU's gate, up, activation and product
        outputs 2F each, no dropout masks) 12·h + 4·kv + 8·F. Bytes per token. An MoE shape adds its
        router and dispatch bytes (estimators/moe.py ``moe_extra_bytes_per_token``) averaged over the layers.
        """
        h, kv, ffn = self.hidden, self.kv_dim, self.ffn or 4 * self.hidden
        dense = 12 * h + 4 * kv + 8 * ffn if self.gated else 14 * h + 4 * kv + 4 * ffn
        if self.moe is None:
            return dense
        # MoE layers also keep router logits/probabilities and the dispatched token copies (estimators/moe.py),
        # spread over every layer like the mean active width
        share = self.moe.moe_layers(self.layers) / self.layers
        return dense + round(share * moe_extra_bytes_per_token(self.moe, h, 2))

    def replicated_bytes_per_token(self) -> int:
        """Of :meth:`layer_bytes_per_token`, what tensor parallelism alone does not split (Korthikanti
        §4.2.1): the layer-norm inputs 4h, attention and MLP inputs 2h + 2h, dropout masks 2h (GPT only)."""
        return 8 * self.hidden if self.gated else 10 * self.hidden


class EagerStep(_Frozen):
    """The kernels one micro-batch's eager step launches, counted on the profile's own step without checkpointing
    (probes/traffic.py: every ATen operator with a tensor output but views and aliases; counts, at the model's full
    depth), and what its kernels move and compute. The host issues the kernels one by one (estimators/eager_host.py);
    the device time of a model without a transformer shape comes from the bytes and FLOPs
    (estimators/counted_traffic.py)."""

    forward_kernels: float = Field(ge=0, description="kernels of the forward and the loss")
    backward_kernels: float = Field(ge=0, description="kernels of the backward (gradient accumulation included)")
    block_forward_kernels: float = Field(default=0.0, ge=0, description="kernels of one repeated block's forward "
                                                                          "(what full checkpointing replays per block)")
    memory_bytes_per_sample: float | None = Field(
        default=None, ge=0, description="bytes the step's memory-bound kernels read and write per sample (forward and "
                                        "backward; None: not counted, an older profile)")
    memory_bytes_fixed: float = Field(default=0.0, ge=0, description="of those, what a micro-batch moves whatever "
                                                                     "its size (gradient accumulation, casts) (bytes)")
    memory_forward_bytes_per_sample: float = Field(default=0.0, ge=0, description="of the bytes per sample, the "
                                                                                  "forward's (full checkpointing "
                                                                                  "moves them again)")
    conv_flops_per_sample: float = Field(default=0.0, ge=0, description="convolution FLOPs per sample (forward, input "
                                                                        "and weight gradients)")
    nchw_conv_bytes_per_sample: float = Field(
        default=0.0, ge=0, description="activation bytes per sample of the convolutions on channels-first (NCHW) "
                                       "tensors: inputs, outputs and their gradients")


class ModelDefaults(_Frozen):
    """The model file's ``OPTPLAN`` dict, parsed (never executed)."""

    seq_len: int | None = None
    global_batch: int | None = None
    tokens: float | None = None
    optimizer: str | None = None
    precision: str | None = None
    extra: dict[str, str | int | float | bool | None] = Field(default_factory=dict)


SMALL_PARAM_LIMIT = 1_000_000
"""Largest tensor size (elements) recorded in ``ModelProfile.small_param_counts``: DeepSpeed's persistence
thresholds are 1e5 by default and 10·h under Hugging Face's "auto" (h <= 1e5 in practice)."""


RUN_FIELDS = frozenset({"profile_s", "notes", "from_cache"})
NUMERICS_FIELDS = ("rope_theta", "norm_eps")
"""TransformerShape fields that change the numbers a model computes, not its memory or time: left out of the
calibration key (planner/calibrate.py profile_hash)."""
"""ModelProfile fields that say how one profiling run went, not what the model is: left out of the profile's hash
(planner/calibrate.py) and of a study's name (planner/search.py)."""


SHAPE_PATHS = ("--arch", "--params", "")
"""``ModelProfile.path`` of a profile made from a shape, not a model file (estimators/arch.py, params_only.py)."""


class ModelProfile(_Frozen):
    """Static profile of one model at one sequence length (per-sample figures)."""

    name: str
    path: str
    model_class: str
    params: int = Field(ge=0, description="unique parameters (tied weights once)")
    trainable_params: int = Field(ge=0)
    params_by_module: dict[str, int]
    factored_state_elements: int | None = Field(
        default=None, ge=0,
        description="trainable parameters' Adafactor second-moment elements (Shazeer & Stern 2018; "
                    "torch.optim.Adafactor): rows+cols (times leading dims) for >=2-D tensors, numel for 0-D/1-D; "
                    "tied weights once. None when unknown (profiles made before this field)",
    )
    sparse_grad_params: int = Field(
        default=0, ge=0,
        description="trainable parameters whose gradients are sparse (nn.Embedding / nn.EmbeddingBag with "
                    "sparse=True): torch's AdamW and the other dense optimizers refuse them, SGD takes them "
                    "(planner/sparse_grads.py)")
    small_param_counts: dict[int, int] | None = Field(
        default=None,
        description="number of unique parameter tensors of each size up to SMALL_PARAM_LIMIT elements "
                    "(numel -> count): what DeepSpeed ZeRO-3 keeps unpartitioned under "
                    "stage3_param_persistence_threshold. None when unknown",
    )
    param_numels: tuple[int, ...] = Field(
        default=(),
        description="elements of each trainable parameter tensor in model.parameters() order (tied weights "
                    "once): the order torch.optim steps them, for the optimizer step's scratch "
                    "(estimators.temporaries). () when unknown",
    )
    buffer_bytes: int = Field(default=0, ge=0, description="non-parameter buffers (bytes)")
    param_dtype: str = "float32"
    repeated_block: RepeatedBlock | None = None
    input_kind: Literal["tokens", "other"] = "other"
    seq_len: int | None = None
    tokens_per_sample: int | None = None
    fwd_flops_per_sample: float = Field(ge=0)
    bwd_flops_per_sample: float = Field(ge=0, description="backward FLOPs per sample as the step runs them: with "
                                                          "what the model's own checkpointing re-runs")
    self_recompute_flops_per_sample: float = Field(
        default=0.0, ge=0,
        description="forward FLOPs per sample that the model's own activation checkpointing (torch.utils.checkpoint "
                    "in its forward) re-runs in backward, part of bwd_flops_per_sample (probes/self_recompute.py): "
                    "hardware FLOPs, not model FLOPs; 0: the model does not checkpoint itself (or unknown)")
    attention_key_heads: int | None = Field(
        default=None, ge=1,
        description="key heads the model's scaled_dot_product_attention call receives (probes/attention_heads.py): "
                    "its query heads when it repeats its key/value heads first, its key/value heads when it passes "
                    "them as they are (enable_gqa); what torch's ring attention exchanges under context parallelism "
                    "(estimators/ring_attention.py). None: no such call seen (--arch shapes, older profiles)")
    selective_recompute_flops_per_sample: float | None = Field(
        default=None, ge=0,
        description="forward FLOPs per sample that the training loop's selective checkpointing recomputes in "
                    "backward (probes/trainloop.py selective_context: every other matmul of each block), counted "
                    "by FlopCounterMode as the backward's FLOPs with that policy less those without (an --arch "
                    "shape: estimators/selective.py's formula); None when unknown (no repeated block, MoE or "
                    "latent-attention shapes, older profiles)")
    eager_layer_bytes_per_token: dict[str, tuple[float, float]] | None = Field(
        default=None,
        description="bytes the memory-bound kernels of one repeated block read and write per token, (forward, "
                    "backward), by eager precision class (fp32, amp, bf16: estimators/eager_traffic.py), counted on "
                    "the profile's own steps (probes/traffic.py); None for shapes (--arch: the reference "
                    "blocks' coefficients), models without repeated blocks or tokens, and older profiles")
    eager_layer_ops: dict[str, float] | None = Field(
        default=None, description="ATen operators one repeated block's forward dispatches in eager mode (views "
                                  "included), by eager precision class (fp32, amp, bf16; probes/traffic.py); the "
                                  "host cost of eager op-level selective checkpointing is per operator "
                                  "(estimators/selective_host.py); None: not measured")
    eager_step: dict[str, EagerStep] | None = Field(
        default=None, description="the kernels one micro-batch's eager step launches, by eager precision class (fp32, "
                                  "amp, bf16; probes/traffic.py): the host's work of a model without a transformer "
                                  "shape (estimators/eager_host.py); None: not measured (an --arch shape, an older "
                                  "profile)")
    activations: tuple[ActivationFit, ...]
    transformer: TransformerShape | None = None
    profiled_blocks: int | None = Field(
        default=None, description="when set, the profile ran this many blocks and scaled by layers"
    )
    defaults: ModelDefaults = Field(default_factory=ModelDefaults)
    adapter: AdapterProfile | None = Field(
        default=None, description="the LoRA adapters the model was profiled with (--finetune lora|qlora); "
                                  "None: full training")
    tensor_plan: TensorPlan | None = Field(
        default=None, description="the model's own tensor-parallel plan (a Hugging Face tp_plan), which the torch "
                                  "engine's tensor parallelism follows; None: the model has none")
    activation_source: Literal["measured", "formula"] = Field(
        default="measured", description="measured: fits from a fake-tensor step; formula: Korthikanti et al. 2022 "
                                        "Table 2 from the shape (--arch), so the strategy's flash/selective apply")
    notes: tuple[str, ...] = ()
    torch_version: str = ""
    profile_s: float = 0.0
    from_cache: bool = Field(
        default=False, description="True when this profile was read from the profile cache (probes/profile_cache.py) "
                                   "instead of made by this run; profile_s is then the time the cached run took")

    @property
    def model_file(self) -> str:
        """The model file the profile was made from; '' for a shape (``--arch``, ``--params``: their ``path``)."""
        return "" if self.path in SHAPE_PATHS else self.path

    @property
    def train_flops_per_sample(self) -> float:
        """Model FLOPs per sample, forward + backward, without what the model's own checkpointing re-runs (the
        FLOPs MFU counts: Chowdhery et al. 2022, PaLM, Appendix B) (FLOPs)."""
        return self.fwd_flops_per_sample + self.bwd_flops_per_sample - self.self_recompute_flops_per_sample

    @property
    def step_flops_per_sample(self) -> float:
        """Forward + backward FLOPs per sample as the model's own step runs them, its own recompute included
        (FLOPs)."""
        return self.fwd_flops_per_sample + self.bwd_flops_per_sample

    def activation(self, precision: ActivationPrecision, checkpointing: CheckpointMode) -> ActivationFit:
        """The fit for one (precision, checkpointing) mode; falls back to no checkpointing."""
        for fit in self.activations:
            if fit.precision == precision and fit.checkpointing == checkpointing:
                return fit
        for fit in self.activations:
            if fit.precision == precision and fit.checkpointing == "none":
                return fit
        raise KeyError(f"profile has no activation fit for {precision}/{checkpointing}")

    def has_activation(self, precision: ActivationPrecision, checkpointing: CheckpointMode | None = None) -> bool:
        """True when the profile measured ``precision`` (``bf16-weights`` is missing from older profiles and
        from models that do not run with 16-bit weights), under ``checkpointing`` when given (``selective``
        is missing from profiles made before it was measured)."""
        return any(fit.precision == precision and checkpointing in (None, fit.checkpointing)
                   for fit in self.activations)

    @property
    def supports_checkpointing(self) -> bool:
        """True when the profile measured a checkpointed mode (a repeated block exists)."""
        return any(fit.checkpointing == "full" for fit in self.activations)
