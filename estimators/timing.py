"""Step time of one strategy on one cluster: compute, recomputation, communication, bubble, host (seconds).

Composition (one optimizer step; the slowest pipeline stage and the slowest rank set the pace)
- Per micro-batch and pipeline stage (compute.py, comm.py): the stage's layers (forward, backward,
  recomputed forward; GEMMs by size, elementwise ops by bytes) with their tensor-parallel collectives
  on the TP group's link (exposed: Megatron runs them on the compute stream; hidden behind GEMMs with Megatron's
  --tp-comm-overlap, tp_overlap.py, and in part with torch's async TP, async_tp.py; the all-gathers per-op selective
  checkpointing issues again, selective.py) and the context-parallel
  K/V ring (overlapped with the attention core, the excess exposed), blended with the host's time to
  issue them (p-norm, compute.py); the embedding on the first stage and logits + loss on the last;
  the pipeline's point-to-point sends (2 per micro-batch and model chunk: activation forward, gradient
  backward; blocking in Megatron and DeepSpeed).
- The pipeline (pipeline.py): m·t_max + (Σ t_s − t_max)/v for 1F1B (v = 1) and interleaved schedules;
  the bubble is the second term (formulas.md: (p−1)/(v·m) of the ideal time for equal stages).
- After the flush, per rank: data-parallel gradient synchronisation over the dp·cp group (ring on the
  group's link by placement: intra-node when the group sits in one node, else inter-node), the tied
  embedding's gradient all-reduce between first and last stage when p > 1 (Megatron; Narayanan et al.
  2021 §2.2), the optimizer step (memory-bound) and a per-step host overhead.
- Host times are the GPU's fitted eager-torch constants (efficiency.py ``GpuEfficiency``: per layer pass, micro-batch
  and step) times the engine's ``host_multiplier`` (DeepSpeed's engine issues about twice eager torch's host
  operators plus per-step synchronisations: 2.1, fitted by benchmarks/fit_engine_host.py on the DeepSpeed runs
  measured on an H200, benchmarks/results/2026-11-28-H200-visit4).
- Data-parallel, ZeRO and FSDP collectives and their overlap as each engine runs them: dp_comm.py;
  megatron's interleaved schedule's pipeline sends run behind other chunks (Megatron's default
  ``overlap_p2p_comm``, tp_overlap.py). ``comm_s`` is all communication time; ``exposed_comm_s`` the part on the
  critical path.
- Profile FLOPs beyond what the shape accounts for (a measured model's extra modules) are priced on the
  last stage at ``UNMODELLED_FLOPS_FRACTION`` of the large-GEMM rate (compute.py).
- Non-transformer profiles (no shape): compute.py's FLOPs-only model, split evenly over pipeline stages.

Throughput and utilisation: model FLOPs utilisation (MFU) follows PaLM (Chowdhery et al. 2022, arXiv
2204.02311, Appendix B): achieved model FLOP/s (forward + backward, no recomputation) ÷ (GPUs × peak
FLOP/s), with the GPU's dense 16-bit tensor-core peak as the one reference for every precision so MFU
compares plans (an fp32 plan is not flattered by fp32's low peak). Hardware FLOPs utilisation (HFU)
also counts the recomputed forward FLOPs (Korthikanti et al. 2022 §6; Narayanan et al. 2021 eq. 3
counts full recomputation as a fourth pass over the layers, the logits excluded).

``step_s`` = compute_s + recompute_s + memory_bound_s + optimizer_s + exposed_comm_s + bubble_s +
host_overhead_s exactly (each on the rank that sets the pace).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.adapter_time import cast_params
from optplan.estimators.async_tp import async_tp_hidden_s
from optplan.estimators.attention_kernels import flash_fractions
from optplan.estimators.cast_traffic import autocast_cast_bytes_per_microbatch
from optplan.estimators.comm import (
    TP_COLLECTIVES_PER_PASS,
    Link,
    cp_ring_exchange_s,
    exposed_s,
    link_for,
    p2p_s,
    ring_all_gather_s,
    ring_all_reduce_s,
    tp_collective_s,
)
from optplan.estimators.compute import (
    FLASH_BACKWARD_FACTOR,
    UNMODELLED_FLOPS_FRACTION,
    GpuEfficiency,
    TransformerDims,
    blend_s,
    compute_time,
    efficiency_for,
    head_time,
    host_layer_passes,
    layer_time,
    transformer_dims,
)
from optplan.estimators.dp_comm import DataParallelComm, comm_grad_bytes, data_parallel_comm
from optplan.estimators.eager_host import layer_host_s, microbatch_host_s
from optplan.estimators.efficiency import EngineEfficiency, engine_efficiency
from optplan.estimators.ep_overlap import overlapped_a2a_s, solo_fraction
from optplan.estimators.finetune import DEQUANT_BANDWIDTH_FRACTION, dequant_bytes_per_layer
from optplan.estimators.hardware import Cluster, GPUSpec
from optplan.estimators.memory import param_split, stage_params
from optplan.estimators.moe_comm import moe_layer_comm
from optplan.estimators.moe_recompute import moe_mlp_share
from optplan.estimators.optimizer_time import PCIE_BYTES_PER_S, optimizer_step_s
from optplan.estimators.own_checkpointing import own_recompute_flops_per_sample, own_recompute_layer_share
from optplan.estimators.parallel import Placement, layers_per_stage, placement
from optplan.estimators.params_placement import one_stage_params
from optplan.estimators.partial_checkpointing import recompute_fraction
from optplan.estimators.pipeline import dualpipe_solo_fraction, dualpipe_time_s, pipeline_time_s
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.ring_attention import torch_ring_attention
from optplan.estimators.selective import recompute_flops_per_sample, recomputed_tp_collectives
from optplan.estimators.selective_host import selective_host_layer_s
from optplan.estimators.strategy import Strategy
from optplan.estimators.temporaries import AdamImpl
from optplan.estimators.tensor_plan import gathers_logits
from optplan.estimators.tp_overlap import (
    P2P_EXPOSED_INTERLEAVED,
    exposed_p2p_s,
    overlapped_tp_s,
    overlaps_p2p,
    overlaps_tp,
)
from optplan.estimators.zero3_hooks import zero3_hooks_host_s


class TimeBreakdown(BaseModel):
    """One optimizer step on one GPU, seconds (the pipeline stage and rank that set the pace)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compute_s: float = Field(ge=0, description="GEMMs and attention, forward + backward, all micro-batches")
    recompute_s: float = Field(ge=0, description="forward re-run under activation checkpointing")
    memory_bound_s: float = Field(ge=0, description="bandwidth-bound elementwise work (roofline)")
    optimizer_s: float = Field(ge=0, description="optimizer step (memory-bound, or on the host)")
    comm_s: float = Field(ge=0, description="all communication: tp + cp + pp + dp + ep (incl. offload transfers)")
    exposed_comm_s: float = Field(ge=0, description="communication not hidden behind compute")
    bubble_s: float = Field(default=0.0, ge=0, description="pipeline fill and drain (0 without pipeline parallelism)")
    host_overhead_s: float = Field(default=0.0, ge=0, description="GPU idle waiting for the host to launch work")
    tp_comm_s: float = Field(default=0.0, ge=0, description="tensor-parallel collectives (exposed)")
    cp_comm_s: float = Field(default=0.0, ge=0, description="context-parallel K/V ring (partly overlapped)")
    pp_comm_s: float = Field(default=0.0, ge=0, description="pipeline point-to-point sends (exposed)")
    ep_comm_s: float = Field(default=0.0, ge=0, description="MoE dispatch/combine all-to-alls (exposed)")
    dp_comm_s: float = Field(default=0.0, ge=0, description="data-parallel / ZeRO / FSDP collectives, tied "
                                                            "embedding all-reduce and offload transfers")
    exposed_dp_comm_s: float = Field(default=0.0, ge=0, description="the part of dp_comm_s not overlapped")
    step_s: float = Field(gt=0)
    step_s_low: float = Field(default=0.0, ge=0, description="fast end of the band the step time lies in (s): the "
                                                          "measured sets' residuals, widened out of domain")
    step_s_high: float = Field(default=0.0, ge=0, description="slow end of the band (s)")
    band_basis: str = Field(default="", description="the measured set the band rests on")
    outside_measured: tuple[str, ...] = Field(default=(), description="what lies outside every measured run")
    efficiency: float = Field(gt=0, description="achieved model FLOP/s ÷ the compute dtype's peak (FLOPs-only "
                                                "model: the matmul efficiency assumed)")
    samples_per_s: float = Field(gt=0)
    tokens_per_s: float | None = None
    samples_per_s_low: float | None = Field(default=None, ge=0, description="throughput at the step band's slow "
                                                                           "end (samples/s): global batch / step_s_high")
    samples_per_s_high: float | None = Field(default=None, ge=0, description="at the band's fast end (samples/s): "
                                                                            "global batch / step_s_low")
    tokens_per_s_low: float | None = Field(default=None, ge=0, description="tokens/s at the step band's slow end")
    tokens_per_s_high: float | None = Field(default=None, ge=0, description="tokens/s at the step band's fast end")
    model_tflops_per_gpu: float = Field(ge=0)
    hardware_tflops_per_gpu: float = Field(ge=0, description="counting recomputation")
    mfu: float = Field(ge=0)
    hfu: float = Field(ge=0)


def mfu_peak_flops(gpu: GPUSpec) -> float:
    """The MFU reference: the GPU's datasheet dense 16-bit tensor-core peak (bf16 or fp16), FLOP/s (PaLM,
    Chowdhery et al. 2022, App. B); measured ceilings (ceilings.py) keep the datasheet figure here."""
    if gpu.mfu_reference_flops is not None:
        return gpu.mfu_reference_flops
    return max(gpu.peak_flops_for("bf16"), gpu.peak_flops_for("fp16"), gpu.peak_flops_for("fp32"))


def _links(pl: Placement, cluster: Cluster, eff: GpuEfficiency) -> dict[str, Link]:
    kw = {"intra_fraction": eff.intra_node_link_fraction, "intra_alpha_s": eff.intra_node_alpha_s}
    return {"tp": link_for(pl.tp, cluster, **kw), "cp": link_for(pl.cp, cluster, **kw),
            "pp": link_for(pl.pp, cluster, **kw), "dp": link_for(pl.grad_reduce, cluster, **kw),
            "shard": link_for(pl.shard, cluster, **kw), "etp": link_for(pl.etp, cluster, **kw)}


def _intra_bytes_per_s(cluster: Cluster, eff: GpuEfficiency) -> float:
    """The intra-node link's achieved bandwidth (bytes/s), as ``link_for`` prices a ring inside one node."""
    return cluster.gpu.intra_node_bandwidth_bytes_per_s * eff.intra_node_link_fraction


def comm_time_s(profile: ModelProfile, strategy: Strategy, cluster: Cluster) -> float:
    """Data-parallel communication per optimizer step on the rank with most parameters (seconds), by
    ZeRO stage (ZeRO paper §7): stages 0-1 all-reduce the gradients (2Ψ); DeepSpeed's stage 2
    reduce-scatters gradients at every micro-step and all-gathers the weights once; stage 3 all-gathers
    parameters in forward and backward and reduce-scatters gradients at every micro-step."""
    eff = efficiency_for(cluster.gpu)
    pl = placement(strategy, cluster.gpus_per_node)
    links = _links(pl, cluster, eff)
    params = max(stage_params(profile, strategy, 0), stage_params(profile, strategy, strategy.pp - 1))
    trainable = profile.trainable_params / profile.params if profile.params else 1.0
    dpc = data_parallel_comm(strategy, params, trainable, links["dp"], links["shard"], pl, step_compute_s=0.0,
                             mb_compute_s=0.0, last_bwd_s=0.0, units=1)
    return dpc.total_s


def _finish(profile: ModelProfile, strategy: Strategy, cluster: Cluster, *, parts: dict[str, float],
            efficiency_peak: float, hardware_flops_per_sample: float) -> TimeBreakdown:
    """Throughput, MFU and HFU from the components (``parts`` sum to the step)."""
    step_s = (parts["compute_s"] + parts["recompute_s"] + parts["memory_bound_s"] + parts["optimizer_s"]
              + parts["exposed_comm_s"] + parts["bubble_s"] + parts["host_overhead_s"])
    samples_per_s = strategy.global_batch / step_s
    tokens_per_s = samples_per_s * profile.tokens_per_sample if profile.tokens_per_sample else None
    gpus = strategy.world_size
    model_flops_per_s = profile.train_flops_per_sample * samples_per_s / gpus
    hw_flops_per_s = hardware_flops_per_sample * samples_per_s / gpus
    peak = mfu_peak_flops(cluster.gpu)
    return TimeBreakdown(step_s=step_s, step_s_low=step_s, step_s_high=step_s, samples_per_s=samples_per_s, tokens_per_s=tokens_per_s,
                         model_tflops_per_gpu=model_flops_per_s / 1e12,
                         hardware_tflops_per_gpu=hw_flops_per_s / 1e12, mfu=model_flops_per_s / peak,
                         hfu=hw_flops_per_s / peak,
                         efficiency=max(1e-9, model_flops_per_s / efficiency_peak),
                         **parts)


def _flops_only_step(profile: ModelProfile, strategy: Strategy, cluster: Cluster, eff: GpuEfficiency,
                     engine: EngineEfficiency, adam_impl: AdamImpl | None = None) -> TimeBreakdown:
    """Profiles without a transformer shape: compute.py's FLOPs-only model, p equal stages."""
    ct = compute_time(profile, strategy, cluster.gpu, ranks_per_node=min(strategy.dp, cluster.gpus_per_node),
                      hbm_fraction=eff.hbm_fraction, adam_impl=adam_impl, gemm_peak_fraction=eff.gemm_peak_fraction,
                      fp32_gemm_fraction=eff.fp32_gemm_fraction, fp8_gemm_fraction=eff.fp8_gemm_fraction)
    pl = placement(strategy, cluster.gpus_per_node)
    links = _links(pl, cluster, eff)
    p, m = strategy.pp, strategy.grad_accum
    work = (ct.compute_s + ct.recompute_s + ct.memory_bound_s) / p
    pipe = pipeline_time_s([work / m] * p, m, strategy.vpp)
    params = profile.params / p
    trainable = profile.trainable_params / profile.params if profile.params else 1.0
    dpc = data_parallel_comm(strategy, params, trainable, links["dp"], links["shard"], pl,
                             step_compute_s=work, mb_compute_s=work / m, last_bwd_s=ct.compute_s / p / m * 2 / 3,
                             units=profile.repeated_block.count if profile.repeated_block else 1,
                             intra_bytes_per_s=_intra_bytes_per_s(cluster, eff))
    optimizer_s = ct.optimizer_s / p
    # the host's floor: one micro-batch's launches and the step's, as the transformer path charges its head
    # (``host_microbatch_s``, ``host_step_s``), plus what eager op-level selective checkpointing costs the host per
    # repeated block (selective_host.py), blended with the device work they overlap. The GPU visits
    # (benchmarks/results/2026-11-2*-H200*) measured a 36 MB MLP at 3-7 ms a step where its kernels take 0.1-0.3 ms
    mb_device = work / m
    blocks = profile.repeated_block.count / p if profile.repeated_block else 0.0
    hm = engine.host_multiplier
    # the kernels the profile counted, each issued by the host (eager_host.py), where it has them and runs eager
    mb_host = hm * microbatch_host_s(profile, strategy, host_kernel_s=eff.host_kernel_s,
                                     checkpoint_block_s=eff.host_checkpoint_block_s, microbatch_s=eff.host_microbatch_s)
    mb_host += blocks * selective_host_layer_s(profile, strategy, eff.host_layer_pass_s)
    mb_host += zero3_hooks_host_s(profile, strategy)  # ZeRO-3's fetch/release hooks (zero3_hooks.py)
    host_s = m * (blend_s(mb_host, mb_device, eff.overlap_exponent) - mb_device) + hm * eff.host_step_s
    hw = profile.train_flops_per_sample + ct.recompute_flops_per_sample
    parts = {"compute_s": ct.compute_s / p, "recompute_s": ct.recompute_s / p,
             "memory_bound_s": ct.memory_bound_s / p, "optimizer_s": optimizer_s, "comm_s": dpc.total_s,
             "exposed_comm_s": dpc.exposed_s, "bubble_s": pipe.bubble_s, "host_overhead_s": host_s,
             "dp_comm_s": dpc.total_s, "exposed_dp_comm_s": dpc.exposed_s}
    tb = _finish(profile, strategy, cluster, parts=parts, efficiency_peak=1.0, hardware_flops_per_sample=hw)
    return tb.model_copy(update={"efficiency": ct.efficiency})


def _transformer_step(profile: ModelProfile, dims: TransformerDims, strategy: Strategy, cluster: Cluster,
                      eff: GpuEfficiency, engine: EngineEfficiency, adam_impl: AdamImpl | None = None,
                      attention_kernel: str | None = None) -> TimeBreakdown:
    """Transformer profiles: per-stage roofline by op class, collectives by placement, 1F1B pipeline."""
    gpu = cluster.gpu
    s_, t, c, p, v, m = strategy, strategy.tp, strategy.cp, strategy.pp, strategy.vpp, strategy.grad_accum
    recipe = get_recipe(s_.precision)
    elem = recipe.activation_bytes
    hbm = gpu.memory_bandwidth_bytes_per_s * eff.hbm_fraction
    pl = placement(s_, cluster.gpus_per_node)
    links = _links(pl, cluster, eff)
    lt = layer_time(dims, s_, gpu, eff, engine, attention_kernel=attention_kernel)
    ht = head_time(dims, s_, gpu, eff, engine)
    tokens = s_.mbs * dims.seq / c
    h = dims.hidden
    full = s_.checkpointing == "full"
    rf = recompute_fraction(s_, dims.layers)  # the blocks full checkpointing re-runs: 1, or partial's share
    selective = s_.checkpointing == "selective"
    moe_rc = s_.checkpointing == "moe"  # the MoE layers re-run from their input (estimators/moe_recompute.py)
    moe_share = moe_mlp_share(profile.transformer) if moe_rc and profile.transformer is not None else 0.0

    # one layer, one micro-batch
    core_fwd = lt.attention_core_fwd_s
    f_fwd, f_bwd = flash_fractions(s_.engine, gpu.name, eff.flash_attention_fraction, eff.flash_backward,
                                   seq=dims.seq / c, kernel=attention_kernel)
    core_bwd = core_fwd * (FLASH_BACKWARD_FACTOR * f_fwd / f_bwd if s_.flash else 2.0)
    layer_compute = lt.fwd_gemm_s + lt.bwd_gemm_s
    layer_mem = lt.fwd_elementwise_s + lt.bwd_elementwise_s
    layer_recompute = rf * (lt.fwd_gemm_s + lt.fwd_elementwise_s) if full else (
        lt.attention_core_fwd_s if selective else moe_share * lt.mlp_fwd_s)
    op_selective = recompute_flops_per_sample(profile, s_)
    if op_selective is not None:
        # the training loop's op-level policy (selective.py): the matmuls the profile measured it re-running, at
        # this layer's linear-GEMM rate, and its element-wise forward ops (an upper bound: recomputation stops
        # early); the attention core is saved, not re-run
        op_selective = op_selective * s_.mbs / (dims.layers * t * c)  # one layer, one micro-batch, this GPU
        linear_flops = lt.fwd_flops - lt.attention_core_fwd_flops
        linear_s = max(0.0, lt.fwd_gemm_s - core_fwd)
        layer_recompute = op_selective * (linear_s / linear_flops if linear_flops > 0 else 0.0) + lt.fwd_elementwise_s
    # the model's own checkpointing re-runs this share of each layer's forward in every plan (own_checkpointing.py);
    # its elementwise kernels are in the backward's bytes where the profile counted the model's step
    own = own_recompute_layer_share(profile, s_, layers=dims.layers, layer_fwd_flops=lt.fwd_flops)
    layer_recompute += own * (lt.fwd_gemm_s + (0.0 if lt.elementwise_counted else lt.fwd_elementwise_s))
    rf_all = rf + own  # the forward passes the recompute repeats, for the collectives they issue again
    moe_comm = moe_layer_comm(profile, s_, cluster, eff, links["etp"], tokens, elem, hbm)
    tp_collectives = TP_COLLECTIVES_PER_PASS - moe_comm.mlp_tp_collectives_skipped  # estimators/moe_comm.py
    tp_one = tp_collective_s(tokens, h, elem, t, links["tp"], sp=s_.sp) if t > 1 else 0.0
    layer_tp_total = tp_collectives * (2 + rf_all) * tp_one
    layer_tp = layer_tp_total
    if overlaps_tp(s_):  # behind the pass's linear GEMMs (estimators/tp_overlap.py)
        pass_tp = tp_collectives * tp_one
        fwd_linear = max(0.0, lt.fwd_gemm_s - core_fwd)  # the attention core overlaps no collective
        bwd_linear = max(0.0, lt.bwd_gemm_s - core_bwd)
        layer_tp = ((1 + rf_all) * overlapped_tp_s(pass_tp, fwd_linear)
                    + overlapped_tp_s(pass_tp, bwd_linear))
    if s_.async_tp:  # torch's async TP hides part of each forward pass's collectives (estimators/async_tp.py)
        layer_tp -= (1 + rf_all) * async_tp_hidden_s(tp_collectives * tp_one, max(0.0, lt.fwd_gemm_s - core_fwd))
    # the op-level selective policy issues the all-gathers (all-reduces) it does not save again (selective.py)
    sac_tp = recomputed_tp_collectives(s_, tp_collectives) * tp_one
    layer_tp_total += sac_tp
    layer_tp += sac_tp
    if c > 1 and s_.engine == "torch":  # torch's ring attention around the kernels (estimators/ring_attention.py)
        ring = torch_ring_attention(dims, s_, elem, links["cp"], core_fwd, core_bwd)
        layer_cp = ring.fwd_comm_s * (1 + rf_all) + ring.bwd_comm_s
        layer_cp_exposed = ring.fwd_exposed_s * (1 + rf_all) + ring.bwd_exposed_s
        layer_mem += ((ring.fwd_memory_bytes * (1 + rf_all) + ring.bwd_memory_bytes) * engine.elementwise_multiplier
                      * eff.elementwise_factor / hbm)
    else:  # Megatron-Core's point-to-point ring beside the kernels (comm.py)
        kv_local = dims.kv_heads * (h / dims.heads) / t
        cp_fwd, cp_bwd = cp_ring_exchange_s(tokens, kv_local, elem, c, links["cp"])
        layer_cp = cp_fwd + cp_bwd + rf_all * cp_fwd
        layer_cp_exposed = (exposed_s(cp_fwd, core_fwd) + exposed_s(cp_bwd, core_bwd)
                            + rf_all * exposed_s(cp_fwd, core_fwd))
    a2a_pass = moe_comm.dispatch_pass_s
    layer_mem += moe_comm.expert_weight_read_s
    # a 4-bit base is dequantised in every pass (estimators/finetune.py): memory traffic per layer
    layer_mem += (dequant_bytes_per_layer(profile.adapter, s_.quant, dims.layers, recompute_share=rf_all, tp=t)
                  / (gpu.memory_bandwidth_bytes_per_s * DEQUANT_BANDWIDTH_FRACTION))
    layer_ep_total = a2a_pass * (3 if moe_rc else 2 + rf) + own * a2a_pass
    layer_ep = layer_ep_total
    dualpipe = s_.dualpipe
    solo = dualpipe_solo_fraction(p, m) if dualpipe else solo_fraction(p, v, m)
    if s_.ep_overlap or dualpipe:  # a partner micro-batch's passes hide the all-to-alls (estimators/ep_overlap.py)
        fwd_window = lt.fwd_gemm_s + lt.fwd_elementwise_s
        bwd_window = lt.bwd_gemm_s + lt.bwd_elementwise_s + layer_recompute
        layer_ep = overlapped_a2a_s(a2a_pass, a2a_pass, fwd_window, bwd_window, solo)
    layer_device = layer_compute + layer_mem + layer_recompute + layer_tp + layer_cp_exposed + layer_ep
    hm = engine.host_multiplier  # the engine's host work against eager torch's (DeepSpeed's engine issues more)
    # an eager engine issues the kernels the profile counted (eager_host.py), each layer its share of the
    # micro-batch's (the head's included); else the fitted constant per layer pass and micro-batch (compiled: at
    # most the eager count's)
    host_layer, head_host_base = layer_host_s(
        profile, s_, host_kernel_s=eff.host_kernel_s, checkpoint_block_s=eff.host_checkpoint_block_s,
        microbatch_s=eff.host_microbatch_s, constant_layer_s=hm * eff.host_layer_pass_s * host_layer_passes(s_, dims.layers),
        host_multiplier=hm, layers_per_stage=dims.layers / p, eager_engine=engine.eager)
    host_layer += selective_host_layer_s(profile, s_, eff.host_layer_pass_s)  # eager op-level policy's host cost
    host_layer += zero3_hooks_host_s(profile, s_) / dims.layers  # ZeRO-3's fetch/release hooks, each layer its share
    host_sync = 2 * (t - 1) * eff.host_collective_step_s  # per tensor-parallel collective
    host_layer += (tp_collectives * (2 + rf_all) + recomputed_tp_collectives(s_, tp_collectives)) * host_sync

    # profile FLOPs the shape does not account for (extra modules): FLOPs-only rate on the last stage
    shape_fwd_per_sample = dims.layers * lt.fwd_flops * t / s_.mbs * c + ht.logits_fwd_flops * t / s_.mbs * c
    extra_fwd = profile.fwd_flops_per_sample - shape_fwd_per_sample
    extra_s = 0.0
    if extra_fwd > 0.01 * shape_fwd_per_sample:
        peak = gpu.peak_flops_for(recipe.compute_dtype)
        extra_s = 3 * extra_fwd * s_.mbs / (peak * eff.gemm_peak_fraction * UNMODELLED_FLOPS_FRACTION)

    grad_bytes = comm_grad_bytes(s_)
    split = param_split(profile)
    lps = layers_per_stage(dims.layers, p)
    p2p = 0.0
    if p > 1:
        p2p = 2 * v * p2p_s(tokens * h * elem / (t if s_.sp else 1), links["pp"])
    p2p_hidden_share = None  # None: the sends are on the critical path (1F1B without overlap)
    if overlaps_p2p(s_):
        p2p_hidden_share = P2P_EXPOSED_INTERLEAVED
    if dualpipe:  # DualPipe's paired chunks hide the point-to-point sends too (DeepSeek-V3 report §3.2.1)
        p2p_hidden_share = solo
    tp_small = 0.0
    if t > 1:  # vocabulary-parallel embedding / logits: one activation collective + 3 tiny CE all-reduces
        tp_small = tp_one
    ce_allreduce = 3 * ring_all_reduce_s(tokens * 4, t, links["tp"].bandwidth_bytes_per_s, links["tp"].alpha_s)
    if gathers_logits(profile, s_):
        # the model's own plan gathers the logits to every rank (estimators/tensor_plan.py): one ring all-gather
        # of tokens x vocab in forward, and every rank runs the whole cross-entropy, (t - 1)/t of it on top of
        # the vocabulary slice head_time priced
        ce_allreduce = ring_all_gather_s(tokens * dims.vocab * elem, t, links["tp"].bandwidth_bytes_per_s,
                                         links["tp"].alpha_s)
        ce_allreduce += (t - 1) * eff.logits_bytes_per_element * tokens * dims.vocab / t / hbm

    stages = [0] if p == 1 else ([0, p - 1] if p == 2 else [0, 1, p - 1])
    trainable = profile.trainable_params / profile.params if profile.params else 1.0
    stage_info: list[dict[str, float]] = []
    for st in stages:
        first, last = st == 0, st == p - 1
        params_local = stage_params(profile, s_, st)
        chunk_params = one_stage_params(profile, s_, st)  # what one micro-batch's chunk runs (DualPipe: one stage)
        layers = lps if p > 1 else dims.layers
        head_compute = head_mem = head_tp = 0.0
        if first:
            head_mem += ht.embedding_s
            head_tp += tp_small
        if last:
            head_compute += ht.logits_gemm_s + extra_s
            head_mem += ht.logits_elementwise_s
            head_tp += tp_small + ce_allreduce
        accum_mem = 3 * grad_bytes * chunk_params * trainable / hbm  # the gradients there are (LoRA: the adapters')
        head_mem += accum_mem
        # a LoRA base is held in 16 bits: autocast casts the fp32 adapters only (adapter_time.py)
        head_mem += autocast_cast_bytes_per_microbatch(recipe, params=cast_params(profile, chunk_params),
                                                       trainable=chunk_params * trainable, recompute=full) / hbm
        head_dev = head_compute + head_mem + head_tp
        layers_dev = layers * layer_device
        layers_host = layers * host_layer
        layers_time = blend_s(layers_host, layers_dev, eff.overlap_exponent)
        head_host = head_host_base + host_sync * ((1 if first else 0) + (4 if last else 0))
        head_time_s = blend_s(head_host, head_dev, eff.overlap_exponent)
        p2p_exposed = exposed_p2p_s(p2p, layers_time + head_time_s, p2p_hidden_share)
        stage_info.append({
            "time": layers_time + head_time_s + p2p_exposed, "params": params_local,
            "compute": layers * layer_compute + head_compute, "mem": layers * layer_mem + head_mem,
            "recompute": layers * layer_recompute, "tp": layers * layer_tp + head_tp,
            "tp_total": layers * layer_tp_total + head_tp, "ep": layers * layer_ep,
            "ep_total": layers * layer_ep_total,
            "cp": layers * layer_cp, "cp_exposed": layers * layer_cp_exposed, "pp": p2p_exposed, "pp_total": p2p,
            "host": (layers_time - layers_dev) + (head_time_s - head_dev),
            "bwd": layers * (lt.bwd_gemm_s + lt.bwd_elementwise_s), "layers": layers,
        })
    # interleaving splits each stage into v chunks: the stage time per micro-batch is unchanged
    times = [info["time"] for info in stage_info]
    if p > 2:  # middle stages are all equal: count them p − 2 times
        times = [times[0]] + [times[1]] * (p - 2) + [times[2]]
    if dualpipe:  # rank r runs half the micro-batches through stage r, half through p - 1 - r
        pipe = dualpipe_time_s(times, m)
        stage_info = _dualpipe_ranks(stage_info)
    else:
        pipe = pipeline_time_s(times, m, v)
    slow = max(stage_info, key=lambda info: info["time"])

    # after the flush, per rank: DP sync, tied-embedding all-reduce, optimizer, host step overhead
    shard_ranks = pl.shard.ranks if s_.shard_stage >= 1 else 1
    post_best: tuple[float, DataParallelComm, float, float] | None = None
    for info in stage_info:
        dpc = data_parallel_comm(s_, info["params"], trainable, links["dp"], links["shard"], pl,
                                 step_compute_s=m * info["compute"], mb_compute_s=info["compute"],
                                 last_bwd_s=info["bwd"], units=int(info["layers"]) or 1, engine=engine,
                                 chunks=v if overlaps_p2p(s_) else 1, rounds=p,
                                 intra_bytes_per_s=_intra_bytes_per_s(cluster, eff))
        tied = 0.0
        if p > 1 and split.tied and split.embed:
            tied = ring_all_reduce_s(split.embed / t * grad_bytes * trainable, 2,
                                     links["pp"].bandwidth_bytes_per_s, links["pp"].alpha_s)
        opt = optimizer_step_s(info["params"], s_, gpu, profile, shard_ranks=shard_ranks,
                               ranks_per_node=min(cluster.gpus_per_node, s_.world_size),
                               hbm_fraction=eff.hbm_fraction, adam_impl=adam_impl)
        post = dpc.exposed_s + tied + opt
        if post_best is None or post > post_best[0]:
            post_best = (post, dpc, tied, opt)
    assert post_best is not None
    _, dpc, tied, opt = post_best

    tp_s, cp_s, pp_s, ep_s = m * slow["tp"], m * slow["cp"], m * slow["pp"], m * slow["ep"]
    cp_exposed = m * slow["cp_exposed"]
    dp_total = dpc.total_s + tied
    dp_exposed = dpc.exposed_s + tied
    exposed = tp_s + cp_exposed + pp_s + dp_exposed + ep_s
    hw_per_sample = profile.train_flops_per_sample
    recompute_flops = (rf * lt.fwd_flops if full else op_selective if op_selective is not None
                       else lt.attention_core_fwd_flops if selective else moe_share * lt.mlp_fwd_flops)
    hw_per_sample += dims.layers * recompute_flops * t * c / s_.mbs + own_recompute_flops_per_sample(profile, s_)
    parts = {
        "compute_s": m * slow["compute"], "recompute_s": m * slow["recompute"],
        "memory_bound_s": m * slow["mem"], "optimizer_s": opt,
        "comm_s": m * (slow["tp_total"] + slow["pp_total"]) + cp_s + dp_total + m * slow["ep_total"],
        "exposed_comm_s": exposed,
        "bubble_s": pipe.bubble_s,
        "host_overhead_s": m * slow["host"] + hm * eff.host_step_s,
        "tp_comm_s": tp_s, "cp_comm_s": cp_s, "pp_comm_s": pp_s, "dp_comm_s": dp_total,
        "exposed_dp_comm_s": dp_exposed, "ep_comm_s": ep_s,
    }
    return _finish(profile, s_, cluster, parts=parts,
                   efficiency_peak=gpu.peak_flops_for(recipe.compute_dtype), hardware_flops_per_sample=hw_per_sample)


def _dualpipe_ranks(stage_info: list[dict[str, float]]) -> list[dict[str, float]]:
    """DualPipe's ranks from the stages priced (first, [middle,] last): the first rank's per-micro-batch figures are
    the mean of the first and last stages' (each micro-batch runs one of its two stages); a middle rank's pair two
    equal middle stages. ``params`` is already the rank's two stages' (params_placement.stage_params)."""
    first, last = stage_info[0], stage_info[-1]
    ends = {key: (first[key] + last[key]) / 2 for key in first}
    ends["params"] = first["params"]
    return [ends, *stage_info[1:-1]]


PAGING_ROUND_TRIPS = 2
"""A paged optimizer's state crosses the host link twice per step when it does not fit beside the forward/backward
peak: out to make room for the activations, back for the optimizer step (optimizers.py)."""


def with_paging(time: TimeBreakdown, paged_out_bytes: int) -> TimeBreakdown:
    """``time`` with a paged optimizer's page traffic (``paged_out_bytes`` of state off the GPU at the
    forward/backward peak, memory.py) added to ``optimizer_s``: :data:`PAGING_ROUND_TRIPS` transfers at
    ``PCIE_BYTES_PER_S``, not overlapped (the driver migrates pages on fault, as the step touches them);
    throughput, MFU and HFU scale with the longer step."""
    if paged_out_bytes <= 0:
        return time
    extra = PAGING_ROUND_TRIPS * paged_out_bytes / PCIE_BYTES_PER_S
    scale = time.step_s / (time.step_s + extra)
    return time.model_copy(update={
        "optimizer_s": time.optimizer_s + extra, "step_s": time.step_s + extra,
        "samples_per_s": time.samples_per_s * scale,
        "tokens_per_s": time.tokens_per_s * scale if time.tokens_per_s is not None else None,
        "model_tflops_per_gpu": time.model_tflops_per_gpu * scale,
        "hardware_tflops_per_gpu": time.hardware_tflops_per_gpu * scale, "mfu": time.mfu * scale,
        "hfu": time.hfu * scale, "efficiency": max(1e-9, time.efficiency * scale)})


def step_time(profile: ModelProfile, strategy: Strategy, cluster: Cluster, *,
              efficiency: GpuEfficiency | None = None, engine: EngineEfficiency | None = None,
              adam_impl: AdamImpl | None = None, attention_kernel: str | None = None) -> TimeBreakdown:
    """Time of one optimizer step of ``strategy`` on ``cluster`` with throughput, MFU and HFU.

    ``efficiency`` overrides the GPU's constants (``efficiency_for(gpu)``, with the GEMM alignment exponent measured
    on the machine when the spec carries one) and ``engine`` the engine family's (efficiency.py); the
    fitting benchmarks (fidelity_vtrain.py, fit_time.py) fit them through these. ``adam_impl`` overrides the
    engine's own AdamW implementation (a torch client optimizer under DeepSpeed, as the probes run it), and
    ``attention_kernel`` the attention kernel the engine runs on that GPU (attention_kernels.py: a measured run
    that ran another, e.g. llm-foundry's MPT Triton flash attention, ``fitted``).
    """
    eff = efficiency or efficiency_for(cluster.gpu)
    engine = engine or engine_efficiency(strategy.engine)
    dims = transformer_dims(profile)
    if dims is None:
        return _flops_only_step(profile, strategy, cluster, eff, engine, adam_impl)
    return _transformer_step(profile, dims, strategy, cluster, eff, engine, adam_impl, attention_kernel)


__all__ = ["TimeBreakdown", "comm_time_s", "data_parallel_comm", "mfu_peak_flops",
           "step_time", "with_paging"]
