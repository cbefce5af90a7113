"""Compute time on one GPU: a roofline per op class from the model's shape, host overhead, recomputation.

Sources and units (seconds, FLOPs, bytes, FLOP/s, bytes/s throughout)
- Roofline (Williams, Waterman & Patterson 2009, CACM 52(4)): an op takes at least
  max(FLOPs / achievable FLOP/s, bytes moved / memory bandwidth).
- Transformer layer GEMMs (Megatron GPT layer; Narayanan et al. 2021, arXiv 2104.04473, §3 and eq. 3;
  Shoeybi et al. 2019, arXiv 1909.08053 §3): per micro-batch of T = b·s/cp tokens on one of t
  tensor-parallel ranks the forward runs QKV (T × (h + 2·k·d)/t × h), the attention output projection
  (T × h × h/t) and the MLP (T × F/t × h and T × h × F/t; a gated MLP's three matrices are priced as
  two of the same total size), plus the attention core Q·Kᵀ and P·V over b·a/t heads of s/cp × s × d.
  Backward runs two GEMMs of the same FLOPs per forward GEMM (data and weight gradients), so a layer's
  forward + backward is 3× its forward FLOPs: 24·T·h² + 4·T·s·h per layer forward ×3 = eq. 3's 72 for
  F = 4h (96 with full recomputation).
- GEMM efficiency by size (NVIDIA Deep Learning Performance Guide, "Matrix Multiplication Background",
  sections "Tile quantization", "Wave quantization" and "Tensor Core Requirements"): a GEMM runs as
  tiles spread over the SMs in waves; with x = output elements / outputs per full wave, the last,
  partly filled wave wastes on average half a wave, so the achieved fraction of the large-GEMM rate is
  x / (x + ½) (small and narrow GEMMs — small micro-batches, narrow hidden sizes, large t — run far
  below peak). Tensor-core kernels load 16-byte vectors: when a dimension × element size is not a
  multiple of 16 bytes (e.g. an unpadded vocabulary of 50,257 split by t), slower narrow-load kernels
  run; modelled as a factor (alignment bytes / 16)^γ with the alignment the largest power of two
  dividing the dimension's bytes (capped at 16) and γ fitted. The attention core's batched GEMMs have
  K = head dimension (64-128), low arithmetic intensity: the roofline's bandwidth side often binds.
- Memory-bound elementwise ops, counted kernel by kernel for Megatron's GPT layer (fused bias-GeLU,
  fused bias-dropout-add, fused scale-mask-softmax; Korthikanti et al. 2022, arXiv 2205.05198, §4 and
  Table 2 list the same tensors): with T tokens, e bytes per activation element, r = 1 (each TP rank
  runs the norms and dropouts on the full hidden state) or 1/t with sequence parallelism, and
  S = b·(a/t)·(s/cp)·s attention-score elements, the forward moves
  T·h·r·(2 norms × 2e + 2 dropout-adds × (3e + 1)) + T·(F/t)·2e (bias-GeLU) + S·(2e + 2e + 1)
  (softmax, dropout and its 1-byte mask) bytes, and the backward
  T·h·r·(2 × 3e + 2 × (5e + 1)) + T·(F/t)·3e + S·(5e + 1) (read input and gradient, write gradient;
  residual-gradient adds); no score terms with flash attention. Time = ``elementwise_factor`` × bytes /
  (HBM bandwidth × ``hbm_fraction``), the factor fitted (other small kernels: bias adds, casts). That count is
  Megatron's. An eager engine (torch, DeepSpeed: the user's model as written) runs one kernel per ATen operator
  instead: its bytes are the *measured* per-operator count of estimators/eager_traffic.py (probes/traffic.py on a
  Llama and a GPT-2 layer: a gated Llama layer moves ~3x the bytes of a plain one of the same width: RMSNorm in
  fp32, rotary embeddings, repeated k/v), times the engine's fitted ``elementwise_multiplier``. A block compiled by
  torch.compile runs TorchInductor's generated kernels: their bytes are Inductor's own *measured* count for the
  reference block of the layer's kind (benchmarks/compiled_traffic.py; ~1.7x Megatron's count for a Llama layer,
  ~0.33x its eager bytes), split into forward and backward as the eager operators split, times
  ``compile_multiplier``.
- Attention with flash (Dao 2023, FlashAttention-2, arXiv 2307.08691, §3 and Fig. 5-7): one fused
  kernel, causal blocks skipped (half the s² FLOPs), at the measured fraction of peak of the kernel the engine runs
  on that GPU at that sequence length (estimators/attention_kernels.py), else the GPU's fitted one; its backward
  does 2.5× the forward's FLOPs (it recomputes the scores).
- Logits and loss (Megatron's vocabulary-parallel head, Shoeybi et al. 2019 §3): the T × V/t × h GEMM
  forward + two backward GEMMs on the last pipeline stage, and a memory-bound cross entropy over the fp32
  logits (``logits_bytes_per_element`` bytes moved per logit, forward + backward); the embedding's
  backward writes a dense V/t × h gradient on the first stage.
- Recomputation (Chen et al. 2016, arXiv 1604.06174; Korthikanti et al. 2022 §5): full activation
  checkpointing re-runs each checkpointed block's forward (GEMMs, elementwise ops and, in timing.py,
  its tensor-parallel all-reduces) during backward; selective recomputation re-runs only the attention
  core (Q·Kᵀ, softmax, dropout, P·V).
- Host overhead: an eager framework launches every kernel from Python; when the GPU work of a layer is
  shorter than the host's time to issue it the step is host-bound (the "CPU-bound regime"; e.g.
  PyTorch performance tuning guide, "CUDA graphs" and "avoid CPU-GPU synchronization"). Host time per
  layer pass (forward = 1, backward = 2, recomputed forward = 1) and per micro-batch are fitted
  constants; host and device time blend as the p-norm (hᵖ + gᵖ)^(1/p), which is max(h, g) when one
  dominates and adds the imperfect overlap near the crossover. A tensor-parallel collective can start
  only when all t ranks' hosts have issued it, so in the host-bound regime each one waits for the
  slowest rank: the host side adds ``host_collective_step_s`` per ring step (2(t−1) per all-reduce),
  which vanishes behind device time for large layers.
- Gradient accumulation: autograd adds each micro-batch's gradient into ``.grad`` (read, read, write of
  the gradient bytes per local parameter), a memory-bound pass per micro-batch.
- Non-transformer profiles (no shape): FLOPs from the profile / (peak × eff), with
  eff(m) = eff_max(dtype) · m / (m + m_half) for m rows per micro-batch, and memory-bound traffic of
  ``ACTIVATION_TRAFFIC_PASSES`` × the measured activation bytes (stated defaults).
- Optimizer step: estimators/optimizer_time.py; autocast's weight casts per micro-batch: cast_traffic.py.

The per-GPU constants are in ``EFFICIENCY`` (fitted; see ``A100_FIT``) and ``DEFAULT_EFFICIENCY``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.adapter_time import adapter_layer_time_s, adapter_width_per_layer, cast_params
from optplan.estimators.attention_kernels import flash_fractions
from optplan.estimators.cast_traffic import autocast_cast_bytes_per_microbatch
from optplan.estimators.compiled_loss import compiled_loss_traffic_bytes_per_logit, loss_outside_model
from optplan.estimators.counted_traffic import counted_step, seconds_per_flop
from optplan.estimators.counted_traffic import memory_s as counted_memory_s
from optplan.estimators.eager_traffic import layer_bytes_per_token, precision_class
from optplan.estimators.efficiency import (
    EngineEfficiency,
    GpuEfficiency,
    default_efficiency,
    efficiency_for,
    engine_efficiency,
    fitted_gpus,
)
from optplan.estimators.fp8_backend import fp8_backend
from optplan.estimators.gemm import _align_bytes, gemm_time_s, gemm_train_time_s  # noqa: F401 - re-exported
from optplan.estimators.hardware import GPUSpec, find_gpu
from optplan.estimators.optimizer_time import optimizer_step_s
from optplan.estimators.own_checkpointing import own_recompute_flops_per_sample
from optplan.estimators.partial_checkpointing import recompute_fraction
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.selective import recompute_flops_per_sample
from optplan.estimators.strategy import Strategy
from optplan.estimators.temporaries import AdamImpl

MAX_EFFICIENCY: dict[str, float] = {"fp32": 0.80, "tf32": 0.55, "bf16": 0.55, "fp16": 0.55, "fp8": 0.45}
"""FLOPs-only model (profiles without a transformer shape): achievable fraction of dense datasheet peak
for large GEMM-dominated training (stated defaults: Megatron-LM reports 44-52 % MFU for GPT on A100,
Narayanan et al. 2021 Table 1; SIMT fp32 runs closer to its lower peak)."""
HALF_SATURATION_TOKENS = 512
HALF_SATURATION_SAMPLES = 4
ACTIVATION_TRAFFIC_PASSES = 3
GEMM_DTYPE_FRACTION: dict[str, float] = {"fp32": 1.4, "tf32": 1.0, "bf16": 1.0, "fp16": 1.0, "fp8": 0.75}
"""Large-GEMM fraction of peak relative to 16-bit tensor-core GEMMs (stated defaults, capped at 0.9 of
peak): fp32 runs on CUDA cores (SIMT SGEMM reaches ~80-90 % of its lower peak); fp8 tensor-core GEMMs
reach a lower fraction of their doubled peak (Transformer Engine fp8 speeds GEMMs up ~1.5×, not 2×)."""
MAX_GEMM_FRACTION = 0.9
SELECTIVE_HOST_PASSES = 0.25
"""Host cost of selective recomputation in layer-forward passes: the attention core is about a
quarter of a layer's kernels (stated default)."""
MOE_RECOMPUTE_HOST_PASSES = 0.5
"""Host cost of recomputing the MoE layers in layer-forward passes: the MoE block (norm, router, permute, two
grouped GEMMs, activation, unpermute, dispatch and combine) is about half of a layer's kernels (stated default)."""
UNMODELLED_FLOPS_FRACTION = 0.5
"""Profile FLOPs the transformer shape does not account for (extra modules of a measured model) run at
this fraction of the large-GEMM rate on the last pipeline stage (stated default)."""
CAUSAL_FLASH_FRACTION = 0.5
"""Fraction of the s² attention FLOPs a causal flash kernel runs (fully masked blocks are skipped)."""
FLASH_BACKWARD_FACTOR = 2.5
"""FlashAttention-2 backward FLOPs / forward FLOPs (Dao 2023 §3.1: five GEMMs vs two)."""


A100_FIT: GpuEfficiency = efficiency_for(find_gpu("A100-80GB"))
"""A100 constants (data/efficiency.yaml; dimensionless unless the name carries a unit), fitted on the vTrain
data set (Bang et al., MICRO 2024, arXiv 2312.12391): 1,440 measured Megatron-DeepSpeed iterations of GPT
models (hidden 1024/2048, 12-24 layers, sequence 1024, vocabulary 50,257) on 2, 4 and 8 A100s of one node
with tp 1-8, pp 1-4 (1F1B), fp16 and full activation checkpointing; the fit half is every other row in file
order within each GPU count (``python benchmarks/fidelity_vtrain.py`` refits it). Bounds (physical
ceilings, reached): gemm_peak_fraction <= 0.86 (the best measured A100 16-bit matmul, 267.9 of 312 TFLOP/s:
S. Bekman, "Machine Learning Engineering", Maximum Achievable Matmul FLOPS) and intra_node_alpha_s <= 5 µs
per ring step. Read the fitted values as effective: gemm_wave_outputs came out below the 108 SMs × 128²
tile outputs of a full wave (cuBLAS picks smaller tiles and split-K for small GEMMs, and the host floor
covers small micro-batches); intra_node_link_fraction (186 of 300 GB/s) is the bus bandwidth of the 2-32 MB
all-reduces these layers make; host_* are the measured system's Python/launch costs. The flash-attention
fractions come from llm-foundry's A100 FSDP runs (``benchmarks/fit_time.py``): vTrain has no flash."""

EFFICIENCY: dict[str, GpuEfficiency] = {name: efficiency_for(find_gpu(name)) for name in fitted_gpus()}
"""Per-GPU fitted constants by catalogue name (data/efficiency.yaml ``gpus``)."""
DEFAULT_EFFICIENCY: GpuEfficiency = default_efficiency()
"""What a GPU without a fit or derivation takes (efficiency.py ``default_efficiency``)."""


class TransformerDims(BaseModel):
    """The dimensions the time model needs, read from a profile (counts)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    seq: int
    vocab: int = Field(description="0 when the profile does not know it (no logits priced)")
    mlp_params: float = Field(description="MLP weight parameters per layer (2·h·F, or 3·h·F when gated)")
    per_layer_params: float
    attn_params: float = Field(default=0.0, description="attention projection weights per layer; 0: the standard "
                                                         "2·h² + 2·h·kv of head width h / heads")
    qk_head_dim: float = Field(default=0.0, description="per-head query/key width of the core; 0: h / heads")
    v_head_dim: float = Field(default=0.0, description="per-head value width of the core; 0: h / heads")
    gated: bool = Field(default=False, description="gated (SwiGLU) MLP: the eager traffic of eager_traffic.py's "
                                                   "gated block, else its plain one")
    eager_bytes_per_token: dict[str, tuple[float, float]] | None = Field(
        default=None, description="the profile's own measured eager bytes of one layer per token (forward, backward) "
                                  "by precision class (ModelProfile.eager_layer_bytes_per_token); None: the "
                                  "reference block's (eager_traffic.py)")
    eager_head_bytes_per_token: dict[str, float] | None = Field(
        default=None, description="the profile's counted eager bytes per token outside the repeated blocks (final "
                                  "norm, logits and loss, forward + backward) by precision class (eager_head_bytes); "
                                  "None: the GPU's fitted bytes per logit")
    frozen_base: bool = Field(default=False, description="LoRA: the base weights get no gradient (adapter_time.py)")
    adapter_width: float = Field(default=0.0, description="LoRA: Σ(d_in + d_out) of one layer's adapted linear layers "
                                                          "(elements; adapter_time.adapter_width_per_layer)")
    adapter_rank: int = Field(default=0, description="LoRA rank r; 0 without adapters")
    attention_key_heads: int = Field(default=0, description="key heads the model's attention call receives (its "
                                                            "query heads when it repeats K/V first); 0: kv_heads")
    loss_outside_model: bool = Field(default=True, description="the loss is a function of its own over the logits, "
                                                               "which a compiled loss_fn compiles "
                                                               "(compiled_loss.loss_outside_model)")


def transformer_dims(profile: ModelProfile) -> TransformerDims | None:
    """The shape of a transformer profile, or None (no shape or no sequence length).

    The MLP width is what the repeated block's parameters leave after attention (2·h² + 2·h·k·d weights):
    2·h·4h for a GPT block, 3·h·F for a gated (SwiGLU) one; 8·h² when the block is unknown; an MoE shape's
    active width (its ``ffn``) and router.
    """
    shape = profile.transformer
    seq = profile.tokens_per_sample or profile.seq_len or (shape.max_seq_len if shape else None)
    if shape is None or not seq:
        return None
    h, a = shape.hidden, shape.heads
    kv = shape.kv_heads or a
    attn = 2.0 * h * h + 2.0 * h * (h * kv // a)
    standard = shape.head_dim is None and shape.mla is None
    if not standard:
        attn = float(shape.attention_params())
    block = profile.repeated_block
    per_layer = float(block.params_per_block) if block and block.params_per_block else attn + 8.0 * h * h + 13 * h
    adapter = profile.adapter
    if adapter is not None and block and block.params_per_block:  # the block's adapters are no MLP width
        per_layer -= adapter.adapter_params / shape.layers
    mlp = max(0.0, per_layer - attn - 13.0 * h)
    if mlp < 0.5 * h * h:  # not a standard block: price the MLP as 8h²
        mlp = 8.0 * h * h
    if shape.moe is not None and shape.ffn:
        # MoE: a token multiplies by its routed and shared experts only (the active width, estimators/moe.py) and
        # the router, not by every expert the block holds
        router = h * shape.moe.experts * shape.moe.moe_layers(shape.layers) / shape.layers
        mlp = (3.0 if shape.gated else 2.0) * h * shape.ffn + router
    qk, v = (0.0, 0.0) if standard else shape.core_head_dims()
    key_heads = profile.attention_key_heads  # the heads the model's attention call receives: its K/V, or repeated
    return TransformerDims.model_construct(hidden=h, layers=shape.layers, heads=a, kv_heads=kv, seq=int(seq),
                           vocab=shape.vocab or 0, mlp_params=mlp, per_layer_params=per_layer,
                           attn_params=0.0 if standard else attn, qk_head_dim=qk, v_head_dim=v,
                           gated=bool(shape.gated), eager_bytes_per_token=profile.eager_layer_bytes_per_token,
                           eager_head_bytes_per_token=eager_head_bytes(profile, shape.layers, int(seq)),
                           frozen_base=adapter is not None,
                           adapter_width=adapter_width_per_layer(profile, shape.layers),
                           adapter_rank=adapter.rank if adapter is not None else 0,
                           attention_key_heads=key_heads if key_heads and a % key_heads == 0 else 0,
                           loss_outside_model=loss_outside_model(profile))


def eager_head_bytes(profile: ModelProfile, layers: int, seq: int) -> dict[str, float] | None:
    """Memory-bound bytes per token that the model's eager step moves outside its repeated blocks, forward and
    backward, by precision class (bytes): the whole step's counted bytes per sample (``ModelProfile.eager_step``,
    probes/traffic.py, every operator the model file's step dispatches) less ``layers`` blocks' counted bytes
    (``eager_layer_bytes_per_token``), over ``seq`` tokens. What is left is the final norm, the logits' and the
    loss's element-wise kernels (log-softmax, its backward, the gradient's fill), the embedding's gather: GPT-2
    small under bf16 counts 16.3 bytes per logit, under autocast 34.8 (the loss in fp32), where the Megatron fit's
    constant says 90.3 (its vocabulary-parallel cross entropy in fp32 with its own passes); the H200 traced 10.5 ms
    of log-softmax forward and backward at micro-batch 64 x 1,024 (benchmarks/results/2026-11-29-H200-visit5) where
    90.3 bytes price 75 ms. None without a counted step or blocks; a class whose remainder is not positive is left
    out (the fitted constant prices it)."""
    steps, blocks = profile.eager_step, profile.eager_layer_bytes_per_token
    if not steps or not blocks or seq <= 0 or layers <= 0:
        return None
    found: dict[str, float] = {}
    for klass, step in steps.items():
        per_sample = step.memory_bytes_per_sample
        block = blocks.get(klass)
        if per_sample is None or block is None:
            continue
        rest = per_sample / seq - layers * (block[0] + block[1])
        if rest > 0:
            found[klass] = rest
    return found or None


class LayerTime(BaseModel):
    """One transformer layer, one micro-batch, one GPU (seconds; FLOPs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fwd_gemm_s: float
    bwd_gemm_s: float
    fwd_elementwise_s: float
    bwd_elementwise_s: float
    attention_core_fwd_s: float = Field(description="attention core forward incl. its elementwise ops "
                                                    "(what selective recomputation re-runs)")
    fwd_flops: float = Field(description="forward FLOPs on this GPU")
    attention_core_fwd_flops: float
    mlp_fwd_s: float = Field(default=0.0, description="the MLP's forward GEMMs and elementwise ops (what recomputing "
                                                      "the MLP or MoE block re-runs)")
    mlp_fwd_flops: float = Field(default=0.0, description="the MLP's forward FLOPs on this GPU")
    elementwise_counted: bool = Field(default=False, description="the elementwise bytes are the profile's own count of "
                                                                 "the model's step (what its own checkpointing re-runs "
                                                                 "included in the backward's)")


def _peaks(gpu: GPUSpec, strategy: Strategy) -> tuple[float, float, int]:
    """(linear-layer GEMM peak FLOP/s, attention/logits peak FLOP/s, activation element bytes)."""
    recipe = get_recipe(strategy.precision)
    dtype = recipe.compute_dtype
    linear = gpu.peak_flops_for(dtype)
    other = linear
    if dtype == "fp8":  # Transformer Engine: only Linear layers run fp8; attention and logits in bf16
        other = gpu.peak_flops_for("bf16")
    elem = recipe.activation_bytes
    return linear, other, elem


def _fraction(eff: GpuEfficiency, dtype: str, fp8_kernels_only: bool = False) -> float:
    """A large GEMM's achieved / peak in ``dtype``: the fp32 fraction measured on the GPU where there is one
    (gemm_measured.py), else the fitted 16-bit fraction times the dtype's stated ratio, capped. fp8 takes the
    measured fraction only where the fp8 backend adds nothing the GEMM does not (``fp8_kernels_only``: Transformer
    Engine, which fuses its casts into the neighbouring kernels and keeps the fp8 weights across micro-batches,
    fp8_backend.py); torchao's Float8Linear casts every input, weight and gradient to fp8 in kernels of their own,
    per GEMM and micro-batch, which the stated ratio stands in for."""
    if dtype == "fp32" and eff.fp32_gemm_fraction is not None:
        return eff.fp32_gemm_fraction
    if dtype == "fp8" and fp8_kernels_only and eff.fp8_gemm_fraction is not None:
        return eff.fp8_gemm_fraction
    return min(MAX_GEMM_FRACTION, eff.gemm_peak_fraction * GEMM_DTYPE_FRACTION.get(dtype, 1.0))


def layer_time(dims: TransformerDims, strategy: Strategy, gpu: GPUSpec, eff: GpuEfficiency,
               engine: EngineEfficiency | None = None, *, attention_kernel: str | None = None) -> LayerTime:
    """GEMM and elementwise time of one layer for one micro-batch on one GPU (module docstring); ``attention_kernel``
    names the flash kernel when not the engine's own on this GPU (attention_kernels.py)."""
    s, t, c, b = dims.seq, strategy.tp, strategy.cp, strategy.mbs
    h, a = dims.hidden, dims.heads
    d = h / a
    kvd = dims.kv_heads * d
    tokens = b * s / c
    linear_peak, other_peak, elem = _peaks(gpu, strategy)
    dtype = get_recipe(strategy.precision).compute_dtype
    bw = gpu.memory_bandwidth_bytes_per_s
    kw = {"peak_flops": linear_peak, "bandwidth_bytes_per_s": bw, "eff": eff, "elem_bytes": elem,
          "fraction": _fraction(eff, dtype, fp8_backend(strategy) == "transformer_engine")}
    ffn = dims.mlp_params / (2.0 * h)
    fwd = bwd = 0.0
    qkv_n, o_k, attn = (h + 2 * kvd), h, h * (h + 2 * kvd) + h * h
    if dims.attn_params:  # head width other than h / heads, or latent attention: its own projection sizes
        o_k = a * (dims.v_head_dim or d)
        qkv_n, attn = (dims.attn_params - h * o_k) / h, dims.attn_params
    mlp_fwd = 0.0
    for i, (m_, n_, k_) in enumerate(((tokens, qkv_n / t, h), (tokens, h, o_k / t), (tokens, ffn / t, h),
                                      (tokens, h, ffn / t))):
        # the MLP's width is its weights ÷ 2h (1.5 F when gated, a router's h·E added): no dimension to align
        f_, b_ = gemm_train_time_s(m_, n_, k_, **kw, aligned=i >= 2,  # type: ignore[arg-type]
                                   weight_grad=not dims.frozen_base)
        fwd += f_
        bwd += b_
        if i >= 2:
            mlp_fwd += f_
    fwd_flops = 2.0 * tokens * (attn + dims.mlp_params) / t
    # LoRA's rank-r adapters beside the frozen projections (adapter_time.py)
    a_fwd, a_bwd, a_flops = adapter_layer_time_s(tokens, dims.adapter_width, dims.adapter_rank, tp=t, **kw)
    fwd, bwd, fwd_flops = fwd + a_fwd, bwd + a_bwd, fwd_flops + a_flops
    heads = b * a / t
    qk_d, v_d = (dims.qk_head_dim or d), (dims.v_head_dim or d)
    core_flops = 2.0 * heads * (s / c) * s * (qk_d + v_d)
    d = (qk_d + v_d) / 2  # the unfused core's GEMMs below
    if strategy.flash:
        # the measured kernel the engine runs on this GPU at this sequence length, else the fit (attention_kernels.py)
        f_fwd, f_bwd = flash_fractions(strategy.engine, gpu.name, eff.flash_attention_fraction, eff.flash_backward,
                                       seq=s / c, kernel=attention_kernel)
        core_fwd = CAUSAL_FLASH_FRACTION * core_flops / (other_peak * f_fwd)
        core_bwd = FLASH_BACKWARD_FACTOR * CAUSAL_FLASH_FRACTION * core_flops / (other_peak * f_bwd)
    else:
        akw = dict(kw, peak_flops=other_peak, fraction=_fraction(eff, "bf16" if dtype == "fp8" else dtype))
        q = s / c
        core_fwd = (gemm_time_s(q, s, d, batch=heads, **akw)  # type: ignore[arg-type]
                    + gemm_time_s(q, d, s, batch=heads, **akw))  # type: ignore[arg-type]
        core_bwd = (gemm_time_s(q, d, s, batch=heads, **akw) + gemm_time_s(s, d, q, batch=heads, **akw)  # type: ignore[arg-type]
                    + gemm_time_s(q, s, d, batch=heads, **akw) + gemm_time_s(s, d, q, batch=heads, **akw))  # type: ignore[arg-type]
    r = 1.0 / t if strategy.sp else 1.0
    family = engine or engine_efficiency(strategy.engine)
    kind = "gated" if dims.gated else "plain"
    width = dims.mlp_params / ((3.0 if dims.gated else 2.0) * h)
    klass = precision_class(get_recipe(strategy.precision).weight_bytes, elem)
    shape_kw = {"kind": kind, "precision": klass, "hidden": h, "ffn": width, "kv": kvd, "head_dim": qk_d,
                "grouped_query": dims.kv_heads < a}
    counted = False
    if family.eager and strategy.compile:  # TorchInductor's generated kernels, its own count (eager_traffic.py)
        multiplier = family.compile_multiplier
        both, _ = layer_bytes_per_token(**shape_kw, tp=t, sp=strategy.sp, compiled=True)  # type: ignore[arg-type]
        # forward vs backward as the same block's eager operators split (the recomputed forward is the forward's)
        e_fwd, e_bwd = layer_bytes_per_token(**shape_kw, tp=t, sp=strategy.sp)  # type: ignore[arg-type]
        fwd_share = e_fwd / (e_fwd + e_bwd) if e_fwd + e_bwd > 0 else 0.5
        ew_fwd_bytes, ew_bwd_bytes = tokens * both * fwd_share, tokens * both * (1.0 - fwd_share)
        mlp_both, _ = layer_bytes_per_token(kind=kind, precision=klass, hidden=0.0, ffn=width, kv=0.0,  # type: ignore[arg-type]
                                            head_dim=0.0, grouped_query=False, tp=t, sp=strategy.sp, compiled=True)
        mlp_ew_bytes = tokens * mlp_both * fwd_share
    elif family.eager:  # the model's own kernels, counted operator by operator
        multiplier = family.elementwise_multiplier
        per_fwd, per_bwd = layer_bytes_per_token(**shape_kw, tp=t, sp=strategy.sp)  # type: ignore[arg-type]
        own = (dims.eager_bytes_per_token or {}).get(klass)
        if own is not None:  # the model's own operators, measured; the reference's split across tensor ranks
            one_fwd, one_bwd = layer_bytes_per_token(**shape_kw)  # type: ignore[arg-type]
            per_fwd = own[0] * (per_fwd / one_fwd if one_fwd else 1.0)
            per_bwd = own[1] * (per_bwd / one_bwd if one_bwd else 1.0)
            counted = True
        ew_fwd_bytes, ew_bwd_bytes = tokens * per_fwd, tokens * per_bwd
        mlp_ew_bytes = tokens * layer_bytes_per_token(kind=kind, precision=klass, hidden=0.0, ffn=width, kv=0.0,
                                                      head_dim=0.0, grouped_query=False, tp=t, sp=strategy.sp)[0]
    else:  # Megatron's own fused kernels (module docstring)
        multiplier = family.elementwise_multiplier
        ew_fwd_bytes = tokens * h * r * (4 * elem + 2 * (3 * elem + 1)) + tokens * (ffn / t) * 2 * elem
        ew_bwd_bytes = tokens * h * r * (6 * elem + 2 * (5 * elem + 1)) + tokens * (ffn / t) * 3 * elem
        mlp_ew_bytes = tokens * (ffn / t) * 2 * elem
    ew_fwd_bytes *= multiplier
    ew_bwd_bytes *= multiplier
    score_fwd = score_bwd = 0.0
    if not strategy.flash:
        scores = heads * (s / c) * s
        score_fwd, score_bwd = scores * (4 * elem + 1), scores * (5 * elem + 1)
    hbm = bw * eff.hbm_fraction / eff.elementwise_factor
    ew_fwd = (ew_fwd_bytes + score_fwd) / hbm
    ew_bwd = (ew_bwd_bytes + score_bwd) / hbm
    core_ew = score_fwd / hbm
    return LayerTime.model_construct(fwd_gemm_s=fwd + core_fwd, bwd_gemm_s=bwd + core_bwd, fwd_elementwise_s=ew_fwd,
                     bwd_elementwise_s=ew_bwd, attention_core_fwd_s=core_fwd + core_ew,
                     fwd_flops=fwd_flops + core_flops, attention_core_fwd_flops=core_flops,
                     mlp_fwd_s=mlp_fwd + mlp_ew_bytes * multiplier / hbm,
                     mlp_fwd_flops=2.0 * tokens * dims.mlp_params / t, elementwise_counted=counted)


class HeadTime(BaseModel):
    """Embedding (first stage) and logits + loss (last stage) of one micro-batch on one GPU (seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    embedding_s: float
    logits_gemm_s: float = Field(description="logits GEMM forward + backward")
    logits_elementwise_s: float = Field(description="final norm and cross entropy (memory-bound)")
    logits_fwd_flops: float


def head_time(dims: TransformerDims, strategy: Strategy, gpu: GPUSpec, eff: GpuEfficiency,
              engine: EngineEfficiency | None = None) -> HeadTime:
    """Vocabulary-parallel embedding and logits/cross entropy of one micro-batch (module docstring). An eager engine
    (torch, DeepSpeed: the model file's own loss, compiled blocks or not) moves the bytes its profile counted
    outside the blocks (:func:`eager_head_bytes`, split across tensor ranks with the vocabulary) at the layers'
    element-wise rate and multiplier; Megatron, or a profile without the count, ``logits_bytes_per_element``."""
    if not dims.vocab:
        return HeadTime.model_construct(embedding_s=0.0, logits_gemm_s=0.0, logits_elementwise_s=0.0, logits_fwd_flops=0.0)
    s, t, c, b, h = dims.seq, strategy.tp, strategy.cp, strategy.mbs, dims.hidden
    tokens = b * s / c
    _, peak, elem = _peaks(gpu, strategy)
    dtype = get_recipe(strategy.precision).compute_dtype
    bw = gpu.memory_bandwidth_bytes_per_s
    hbm = bw * eff.hbm_fraction
    v_local = dims.vocab / t
    kw = {"peak_flops": peak, "bandwidth_bytes_per_s": bw, "eff": eff, "elem_bytes": elem,
          "fraction": _fraction(eff, "bf16" if dtype == "fp8" else dtype)}
    f_, b_ = gemm_train_time_s(tokens, v_local, h, **kw, weight_grad=not dims.frozen_base)  # type: ignore[arg-type]
    ce = eff.logits_bytes_per_element * tokens * v_local / hbm
    norm = eff.elementwise_factor * 5.0 * tokens * h * elem / hbm  # final layer norm: fwd 2, bwd 3 passes
    family = engine or engine_efficiency(strategy.engine)
    counted = (dims.eager_head_bytes_per_token or {}).get(
        precision_class(get_recipe(strategy.precision).weight_bytes, elem)) if family.eager else None
    if counted is not None:  # the final norm is in the count
        ce, norm = family.elementwise_multiplier * counted * tokens / t * eff.elementwise_factor / hbm, 0.0
    if strategy.loss_compiled and dims.loss_outside_model and not (strategy.engine == "torch" and t > 1):
        # Inductor's fused cross entropy: its own byte count per logit (estimators/compiled_loss.py); the final
        # norm as the formula's passes
        ce = compiled_loss_traffic_bytes_per_logit("fp32" if elem == 4 else "bf16") * tokens * v_local / hbm
        norm = eff.elementwise_factor * 5.0 * tokens * h * elem / hbm
    # embedding: gather forward, dense V/t × h gradient written in backward (none for a frozen LoRA base)
    embed = (2.0 * tokens * h * elem + (0.0 if dims.frozen_base else v_local * h * elem)) / hbm
    return HeadTime.model_construct(embedding_s=embed, logits_gemm_s=f_ + b_, logits_elementwise_s=ce + norm,
                    logits_fwd_flops=2.0 * tokens * v_local * h)


def host_layer_passes(strategy: Strategy, blocks: int | None = None) -> float:
    """Layer-forward passes the host issues per layer and micro-batch: forward 1 + backward 2, plus 1
    under full recomputation (its checkpointed share of the ``blocks`` under partial checkpointing,
    estimators/partial_checkpointing.py) or ``SELECTIVE_HOST_PASSES`` under selective recomputation."""
    extra = {"full": recompute_fraction(strategy, blocks), "selective": SELECTIVE_HOST_PASSES,
             "moe": MOE_RECOMPUTE_HOST_PASSES}.get(strategy.checkpointing, 0.0)
    return 3.0 + extra


def blend_s(host_s: float, device_s: float, exponent: float) -> float:
    """Host-bound vs device-bound time: the p-norm (hᵖ + gᵖ)^(1/p) (seconds; max(h, g) as p → ∞)."""
    if host_s <= 0:
        return device_s
    if device_s <= 0:
        return host_s
    hi = max(host_s, device_s)
    return hi * ((host_s / hi) ** exponent + (device_s / hi) ** exponent) ** (1.0 / exponent)


class ComputeTime(BaseModel):
    """Per-step compute components on one GPU (seconds) and the efficiency used (FLOPs-only model)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compute_s: float
    recompute_s: float
    memory_bound_s: float
    optimizer_s: float
    efficiency: float
    recompute_flops_per_sample: float = Field(default=0.0, description="forward FLOPs per sample re-run in backward: "
                                                                       "the plan's checkpointing and the model's own")


def matmul_efficiency(profile: ModelProfile, strategy: Strategy) -> float:
    """FLOPs-only model: eff_max(dtype) · m/(m + m_half) for the micro-batch's rows m (dimensionless)."""
    dtype = get_recipe(strategy.precision).compute_dtype
    if profile.input_kind == "tokens" and profile.tokens_per_sample:
        rows, half = strategy.mbs * profile.tokens_per_sample, HALF_SATURATION_TOKENS
    else:
        rows, half = strategy.mbs, HALF_SATURATION_SAMPLES
    return MAX_EFFICIENCY[dtype] * rows / (rows + half)


def compute_time(profile: ModelProfile, strategy: Strategy, gpu: GPUSpec, *,
                 ranks_per_node: int = 1, hbm_fraction: float = 1.0,
                 adam_impl: AdamImpl | None = None, gemm_peak_fraction: float | None = None,
                 fp32_gemm_fraction: float | None = None, fp8_gemm_fraction: float | None = None) -> ComputeTime:
    """FLOPs-only model (profiles without a transformer shape): forward+backward, recompute (full: one more
    forward; the op-level selective policy: the matmul FLOPs the profile measured it re-running, selective.py),
    memory-bound and optimizer-step time of one step on one GPU without model parallelism (seconds).

    An eager step whose profile counted its bytes and FLOPs is priced from them (estimators/counted_traffic.py:
    GEMMs at the GPU's ``gemm_peak_fraction``, convolutions at TF32 under fp32, the counted bytes); otherwise the
    FLOPs at :func:`matmul_efficiency` and ``ACTIVATION_TRAFFIC_PASSES`` over the saved activations.
    ``ranks_per_node`` GPUs share one host's CPU Adam throughput under optimizer offload.
    """
    recipe = get_recipe(strategy.precision)
    peak = gpu.peak_flops_for(recipe.compute_dtype)
    eff = matmul_efficiency(profile, strategy)
    samples = strategy.mbs * strategy.grad_accum
    counted = counted_step(profile, strategy) if gemm_peak_fraction is not None else None
    full = strategy.checkpointing == "full" and profile.supports_checkpointing
    share = recompute_fraction(strategy, profile.repeated_block.count if profile.repeated_block else None)
    if counted is not None:
        assert gemm_peak_fraction is not None
        saturation = eff / MAX_EFFICIENCY[recipe.compute_dtype]

        def fraction(dtype: str) -> float:
            if dtype == "fp32" and fp32_gemm_fraction is not None:  # measured on the GPU (gemm_measured.py)
                return fp32_gemm_fraction * saturation
            if dtype == "fp8" and fp8_gemm_fraction is not None and fp8_backend(strategy) == "transformer_engine":
                return fp8_gemm_fraction * saturation
            return min(MAX_GEMM_FRACTION, gemm_peak_fraction * GEMM_DTYPE_FRACTION.get(dtype, 1.0)) * saturation

        flop_s = seconds_per_flop(counted, profile, strategy, gpu, fraction)
        eff = 1.0 / (flop_s * peak)
    else:
        flop_s = 1.0 / (peak * eff)
    compute_s = profile.train_flops_per_sample * samples * flop_s
    recompute_flops = 0.0
    passes = ACTIVATION_TRAFFIC_PASSES
    if full:  # the checkpointed blocks' share of one more forward (partial_checkpointing.py)
        recompute_flops = profile.fwd_flops_per_sample * share
        passes += share
    elif (selective := recompute_flops_per_sample(profile, strategy)) is not None:
        recompute_flops = selective  # the matmuls the op-level policy re-runs (selective.py)
    own = own_recompute_flops_per_sample(profile, strategy)  # the model's own checkpointing (own_checkpointing.py)
    if own > 0:
        recompute_flops += own
        passes += min(1.0, own / profile.fwd_flops_per_sample) if profile.fwd_flops_per_sample > 0 else 0.0
    recompute_s = recompute_flops * samples * flop_s
    if counted is not None:
        plain = strategy.model_copy(update={"checkpointing": "none", "checkpoint_layers": None})
        moved_s = counted_memory_s(counted, strategy if full else plain, gpu, hbm_fraction)
        if full and share < 1.0:  # the replayed forward's bytes, the checkpointed blocks' share of them
            plain_s = counted_memory_s(counted, plain, gpu, hbm_fraction)
            moved_s = plain_s + share * (moved_s - plain_s)
        memory_bound_s = strategy.grad_accum * moved_s
    else:
        traffic = profile.activation(recipe.activation_precision, "none").bytes_at(strategy.mbs)
        memory_bound_s = strategy.grad_accum * passes * traffic / gpu.memory_bandwidth_bytes_per_s
        casts = autocast_cast_bytes_per_microbatch(recipe, params=cast_params(profile, float(profile.params)),
                                                   trainable=float(profile.trainable_params),
                                                   recompute=recompute_s > 0)
        memory_bound_s += strategy.grad_accum * casts / (gpu.memory_bandwidth_bytes_per_s * hbm_fraction)
    # ZeRO 1-3 and FSDP shard the optimizer over the data-parallel ranks (HSDP over a node's), as timing.py does
    shard_ranks = (1 if strategy.shard_stage < 1 else
                   min(strategy.dp, ranks_per_node) if strategy.fsdp == "hybrid" else strategy.dp)
    optimizer_s = optimizer_step_s(float(profile.params), strategy, gpu, profile, shard_ranks=shard_ranks,
                                   ranks_per_node=ranks_per_node, hbm_fraction=hbm_fraction, adam_impl=adam_impl)
    return ComputeTime(compute_s=compute_s, recompute_s=recompute_s, memory_bound_s=memory_bound_s,
                       optimizer_s=optimizer_s, efficiency=eff, recompute_flops_per_sample=recompute_flops)
