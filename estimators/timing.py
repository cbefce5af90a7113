"""Step time of one strategy on one cluster: compute, recomputation, communication, bubble (seconds).

Sources: compute.py (roofline compute and the optimizer step), comm.py (alpha-beta collectives).
Model FLOPs utilisation (MFU) follows PaLM (Chowdhery et al. 2022, arXiv 2204.02311, Appendix B):
achieved model FLOP/s (forward + backward, no recomputation) ÷ (GPUs × peak FLOP/s), with the GPU's
dense 16-bit tensor-core peak as the one reference for every precision so MFU compares plans (an fp32
plan is not flattered by fp32's low peak). Hardware FLOPs utilisation (HFU) also counts the recomputed
forward (Korthikanti et al. 2022 §6). Step time adds the parts with no overlap of communication and
compute (a stated simplification: exposed communication = all communication).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.comm import (
    data_parallel_link,
    ring_all_gather_s,
    ring_all_reduce_s,
    ring_reduce_scatter_s,
)
from optplan.estimators.compute import PCIE_BYTES_PER_S, compute_time
from optplan.estimators.hardware import Cluster, GPUSpec
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy


class TimeBreakdown(BaseModel):
    """One optimizer step on one GPU, seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compute_s: float = Field(ge=0, description="forward + backward of all micro-batches")
    recompute_s: float = Field(ge=0, description="forward re-run under activation checkpointing")
    memory_bound_s: float = Field(ge=0, description="bandwidth-bound elementwise work (roofline)")
    optimizer_s: float = Field(ge=0, description="optimizer step (memory-bound, or on the host)")
    comm_s: float = Field(ge=0, description="data-parallel collectives and offload transfers")
    exposed_comm_s: float = Field(ge=0, description="communication not hidden behind compute")
    bubble_s: float = Field(default=0.0, ge=0, description="pipeline bubble (0 without pipeline parallelism)")
    step_s: float = Field(gt=0)
    efficiency: float = Field(gt=0, description="fraction of peak FLOP/s assumed for matmuls")
    samples_per_s: float = Field(gt=0)
    tokens_per_s: float | None = None
    model_tflops_per_gpu: float = Field(ge=0)
    hardware_tflops_per_gpu: float = Field(ge=0, description="counting recomputation")
    mfu: float = Field(ge=0)
    hfu: float = Field(ge=0)


def comm_time_s(profile: ModelProfile, strategy: Strategy, cluster: Cluster) -> float:
    """Data-parallel communication per optimizer step (seconds), by ZeRO stage.

    ZeRO paper (arXiv 1910.02054) §7: stages 0-2 move 2Ψ per step (all-reduce, or reduce-scatter +
    all-gather); DeepSpeed's stage 2 reduce-scatters gradients at every micro-step; stage 3 adds an
    all-gather of parameters in forward and backward of every micro-step (3Ψ in all).
    """
    recipe = get_recipe(strategy.precision)
    n = strategy.dp
    grads = profile.trainable_params * recipe.grad_bytes
    weights = profile.params * recipe.weight_bytes
    bw, alpha = data_parallel_link(cluster, n)
    accum = strategy.grad_accum
    stage = strategy.shard_stage
    if stage <= 1:
        total = ring_all_reduce_s(grads, n, bw, alpha)
    elif stage == 2:
        total = accum * ring_reduce_scatter_s(grads, n, bw, alpha) + ring_all_gather_s(weights, n, bw, alpha)
    else:
        total = accum * (2 * ring_all_gather_s(weights, n, bw, alpha) + ring_reduce_scatter_s(grads, n, bw, alpha))
    if strategy.offload_params != "none":
        total += accum * 2 * (weights / n) / PCIE_BYTES_PER_S
    return total


def mfu_peak_flops(gpu: GPUSpec) -> float:
    """The MFU reference: the GPU's dense 16-bit tensor-core peak (bf16 or fp16), FLOP/s."""
    return max(gpu.peak_flops_for("bf16"), gpu.peak_flops_for("fp16"), gpu.peak_flops_for("fp32"))


def step_time(profile: ModelProfile, strategy: Strategy, cluster: Cluster) -> TimeBreakdown:
    """Time of one optimizer step of ``strategy`` on ``cluster`` with throughput, MFU and HFU."""
    ct = compute_time(profile, strategy, cluster.gpu, ranks_per_node=min(strategy.dp, cluster.gpus_per_node))
    comm_s = comm_time_s(profile, strategy, cluster)
    step_s = ct.compute_s + ct.recompute_s + ct.memory_bound_s + ct.optimizer_s + comm_s
    samples_per_s = strategy.global_batch / step_s
    tokens_per_s = samples_per_s * profile.tokens_per_sample if profile.tokens_per_sample else None
    gpus = strategy.world_size
    model_flops_per_s = profile.train_flops_per_sample * samples_per_s / gpus
    hw_flops_per_s = model_flops_per_s + (
        profile.fwd_flops_per_sample * samples_per_s / gpus if ct.recompute_s > 0 else 0.0)
    peak = mfu_peak_flops(cluster.gpu)
    return TimeBreakdown(compute_s=ct.compute_s, recompute_s=ct.recompute_s, memory_bound_s=ct.memory_bound_s,
                         optimizer_s=ct.optimizer_s, comm_s=comm_s, exposed_comm_s=comm_s, step_s=step_s,
                         efficiency=ct.efficiency, samples_per_s=samples_per_s, tokens_per_s=tokens_per_s,
                         model_tflops_per_gpu=model_flops_per_s / 1e12,
                         hardware_tflops_per_gpu=hw_flops_per_s / 1e12, mfu=model_flops_per_s / peak,
                         hfu=hw_flops_per_s / peak)
