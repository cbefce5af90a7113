"""Compute time of a training step from profiled FLOPs (seconds).

Sources
- Roofline (Williams, Waterman & Patterson 2009, CACM 52(4)): an op takes at least
  max(FLOPs / peak FLOP/s, bytes / memory bandwidth). Training is dominated by matmuls, so compute
  time = FLOPs / (peak × efficiency) with a stated efficiency; the optimizer step is memory-bound and
  timed as bytes touched / HBM bandwidth.
- Recomputation: full activation checkpointing re-runs each block's forward in backward, adding one
  forward's FLOPs (Chen et al. 2016, arXiv 1604.06174; Korthikanti et al. 2022 §4).
- Memory-bound operations (norms, activations functions, softmax, residual adds, optimizer-free
  elementwise work) are timed by the roofline's bandwidth side and added to the matmul time (they run
  as separate kernels): bytes moved ≈ ACTIVATION_TRAFFIC_PASSES × the un-checkpointed activation bytes
  of a micro-batch (written in forward, read in backward, gradient written), one more pass under
  recomputation; over HBM bandwidth (stated default, calibrated by probes later).
- Efficiency saturation: small GEMMs under-fill the GPU. Stated default model
  eff(m) = eff_max · m / (m + m_half) with m the rows per micro-batch (tokens for language models,
  samples otherwise); probes calibrate eff_max later.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from optplan.estimators.hardware import GPUSpec
from optplan.estimators.optimizers import optimizer_state_bytes_per_param
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy

MAX_EFFICIENCY: dict[str, float] = {"fp32": 0.80, "tf32": 0.55, "bf16": 0.55, "fp16": 0.55, "fp8": 0.45}
"""Achievable fraction of dense datasheet peak for large GEMM-dominated training (stated defaults:
Megatron-LM reports 44-52 % MFU for GPT on A100 bf16, Narayanan et al. 2021 Table 1; SIMT fp32 runs
closer to its lower peak)."""
HALF_SATURATION_TOKENS = 512
HALF_SATURATION_SAMPLES = 4
ACTIVATION_TRAFFIC_PASSES = 3
HOST_OPTIMIZER_BYTES_PER_S = 50e9
"""CPU Adam memory throughput of one node under ZeRO-Offload, shared by its ranks (stated default for
a 2-socket server)."""
PCIE_BYTES_PER_S = 25e9
"""Host<->GPU transfer, PCIe Gen4 x16 achieved (stated default)."""


class ComputeTime(BaseModel):
    """Per-step compute components on one GPU (seconds) and the efficiency used."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compute_s: float
    recompute_s: float
    memory_bound_s: float
    optimizer_s: float
    efficiency: float


def matmul_efficiency(profile: ModelProfile, strategy: Strategy) -> float:
    """eff_max(dtype) · m/(m + m_half) for the micro-batch's rows m (dimensionless)."""
    dtype = get_recipe(strategy.precision).compute_dtype
    if profile.input_kind == "tokens" and profile.tokens_per_sample:
        rows, half = strategy.mbs * profile.tokens_per_sample, HALF_SATURATION_TOKENS
    else:
        rows, half = strategy.mbs, HALF_SATURATION_SAMPLES
    return MAX_EFFICIENCY[dtype] * rows / (rows + half)


def compute_time(profile: ModelProfile, strategy: Strategy, gpu: GPUSpec, *,
                 ranks_per_node: int = 1) -> ComputeTime:
    """Forward+backward, recompute, memory-bound and optimizer-step time of one step on one GPU (s).

    ``ranks_per_node`` GPUs share one host's CPU Adam throughput under optimizer offload.
    """
    recipe = get_recipe(strategy.precision)
    peak = gpu.peak_flops_for(recipe.compute_dtype)
    eff = matmul_efficiency(profile, strategy)
    samples = strategy.mbs * strategy.grad_accum
    compute_s = profile.train_flops_per_sample * samples / (peak * eff)
    recompute_s = 0.0
    passes = ACTIVATION_TRAFFIC_PASSES
    if strategy.checkpointing == "full" and profile.supports_checkpointing:
        recompute_s = profile.fwd_flops_per_sample * samples / (peak * eff)
        passes += 1
    traffic = profile.activation(recipe.activation_precision, "none").bytes_at(strategy.mbs)
    memory_bound_s = strategy.grad_accum * passes * traffic / gpu.memory_bandwidth_bytes_per_s
    # Optimizer step: read+write master and moments, read grads, write weights, on this rank's shard.
    k = recipe.master_bytes + optimizer_state_bytes_per_param(strategy.optimizer, recipe, profile)
    shard = profile.trainable_params / (strategy.dp if strategy.zero >= 1 else 1)
    touched = shard * (2 * k + recipe.grad_bytes + recipe.weight_bytes)
    if strategy.offload_optimizer != "none":
        # host Adam shared by the node's ranks; gradients cross PCIe every micro-step, weights once
        host_s = touched * ranks_per_node / HOST_OPTIMIZER_BYTES_PER_S
        pcie_s = shard * (strategy.grad_accum * recipe.grad_bytes + recipe.weight_bytes) / PCIE_BYTES_PER_S
        optimizer_s = host_s + pcie_s
    else:
        optimizer_s = touched / gpu.memory_bandwidth_bytes_per_s
    return ComputeTime(compute_s=compute_s, recompute_s=recompute_s, memory_bound_s=memory_bound_s,
                       optimizer_s=optimizer_s, efficiency=eff)
