"""Data-parallel, ZeRO and FSDP collectives of one step on one rank, and the part each engine leaves exposed
(seconds; sizes in bytes, parameters as counts).

- Volumes (ZeRO paper, Rajbhandari et al. 2020, arXiv 1910.02054 §7): stages 0-1 all-reduce the gradients once
  per step; stage 2 reduce-scatters them at every micro-step and all-gathers the updated weights; stage 3
  (and FSDP FULL_SHARD) all-gathers the parameters in forward and backward and reduce-scatters the
  gradients at every micro-step; FSDP SHARD_GRAD_OP gathers once per micro-step (forward) and keeps them
  through backward. The ring collectives and their links are comm.py's (alpha-beta model).
- Overlap as each engine does it by default (stated defaults):
  * megatron: no overlap of the data-parallel reduction (Megatron-LM's --overlap-grad-reduce and
    --overlap-param-gather are opt-in; Megatron-DeepSpeed of vTrain's era reduced after the flush) unless the
    plan sets ``comm_overlap`` (those two and --tp-comm-overlap: estimators/tp_overlap.py);
  * deepspeed ZeRO 0-2: ``overlap_comm`` defaults to false: exposed; ZeRO-3: ``overlap_comm`` true and
    parameter prefetch: hidden behind the micro-step's compute, the first layer's gather exposed;
  * torch DDP: bucketed (25 MiB) all-reduce overlapped with the last micro-batch's backward (``no_sync``
    before it), the last bucket exposed; FSDP: all-gathers prefetched and reduce-scatters overlapped
    with each micro-step's compute, the first unit's gather exposed.
  Overlap is not free: NCCL's kernels run on SMs and stream through HBM while the GEMMs they hide behind
  run, so a share of the overlapped time (the engine's ``overlap_interference``, efficiency.py; fitted
  on llm-foundry's FSDP runs) still lands on the critical path: the whole share inside a node, and across nodes
  the share of the collective's time its kernels spend on the GPU's side, the link's bandwidth over NVLink's
  (``gpu_side_share``).
- Offloaded parameters cross PCIe (and the node's NVMe array) twice per micro-step: forward and backward.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from optplan.estimators.comm import (
    DDP_BUCKET_BYTES,
    Link,
    all_reduce_s,
    exposed_s,
    ring_all_gather_s,
    ring_reduce_scatter_s,
)
from optplan.estimators.efficiency import EngineEfficiency, engine_efficiency
from optplan.estimators.fsdp_grad_sync import strategy_reduce_bytes, syncs_once_per_step
from optplan.estimators.optimizer_time import NVME_BYTES_PER_S, PCIE_BYTES_PER_S
from optplan.estimators.parallel import Placement
from optplan.estimators.pipeline_fsdp import keeps_stage_unsharded
from optplan.estimators.precision import get_recipe
from optplan.estimators.strategy import Strategy
from optplan.estimators.tp_overlap import interleaved_dp_s, overlaps_dp


def comm_grad_bytes(strategy: Strategy) -> int:
    """Bytes per gradient element in the data-parallel reduction: Megatron all-reduces fp32 main
    gradients under bf16 (``accumulate_allreduce_grads_in_fp32`` is forced for bf16); torch FSDP reduces in
    its ``reduce_dtype`` (fsdp_grad_sync.strategy_reduce_bytes: fp32 under the 16-bit recipes by default,
    torchtitan's and Composer's DEFAULT and optplan's train.py; 16-bit with ``fsdp_reduce_dtype``); else the
    recipe's."""
    recipe = get_recipe(strategy.precision)
    if strategy.engine == "megatron" and strategy.precision in ("bf16", "fp8") and recipe.master_bytes > 0:
        return 4
    if strategy.engine == "torch" and strategy.fsdp != "none":  # reduce_dtype (fsdp_grad_sync.py)
        return strategy_reduce_bytes(strategy)
    return recipe.grad_bytes


def gpu_side_share(link: Link, intra_bytes_per_s: float | None) -> float:
    """The share of a collective's time over ``link`` that its kernels spend moving and reducing data on the GPU
    (dimensionless, 0-1): 1 inside a node; across nodes the link's bandwidth over the intra-node link's
    (``intra_bytes_per_s``, bytes/s achieved), as the GPU-side work (HBM reads and writes, reductions, the SM cycles
    that do them) is the bytes moved and the rest of the collective's time waits on the NICs. 1 when
    ``intra_bytes_per_s`` is None.

    Source: what the overlapped collectives contend for, HBM bandwidth and SMs (NCCL's kernels copy and reduce through
    one CTA per channel; NCCL user guide, "Environment variables", NCCL_MIN/MAX_NCHANNELS), is per byte moved; the
    ``overlap_interference`` that prices it is fitted on llm-foundry's FSDP runs, nearly all inside one NVLink node.
    Measured, never fitted: the PyTorch/IBM FSDP runs of Llama 2 13B-70B at 400 Gb/s (A100) and 800 Gb/s (H100) per
    node hide nearly all of their 7-15 s of all-gathers and reduce-scatters ("almost full overlap in computation and
    communication": PyTorch blog, "Maximizing training throughput using PyTorch FSDP", 2024-03-13, Table 1;
    benchmarks/data/fms_fsdp_published.json), where the time-proportional interference priced them 1.3-1.5x slow."""
    if intra_bytes_per_s is None or not link.inter_node:
        return 1.0
    return min(1.0, link.bandwidth_bytes_per_s / intra_bytes_per_s)


class DataParallelComm(BaseModel):
    """Data-parallel communication of one step on one rank (seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    total_s: float
    exposed_s: float


def data_parallel_comm(strategy: Strategy, params_local: float, trainable_fraction: float, dp_link: Link,
                       shard_link: Link, pl: Placement, *, step_compute_s: float, mb_compute_s: float,
                       last_bwd_s: float, units: int, engine: EngineEfficiency | None = None,
                       chunks: int = 1, rounds: int = 1, intra_bytes_per_s: float | None = None) -> DataParallelComm:
    """Data-parallel / ZeRO / FSDP collectives of one step and the part left exposed (module docstring).

    ``params_local`` are this rank's parameters after tensor and pipeline parallelism (count);
    ``step_compute_s``/``mb_compute_s`` the compute windows of the step and of one micro-step,
    ``last_bwd_s`` the last micro-batch's backward, ``units`` the FSDP/ZeRO-3 units (layers) per rank;
    ``chunks``/``rounds`` Megatron's interleaved schedule (virtual stages per rank, micro-batches per chunk round),
    which issues the overlapped collectives chunk by chunk (tp_overlap.interleaved_dp_s); ``intra_bytes_per_s`` the
    intra-node link's achieved bandwidth, which scales the interference of collectives across nodes
    (:func:`gpu_side_share`; None: every collective interferes for its whole time).
    """
    recipe = get_recipe(strategy.precision)
    m = strategy.grad_accum
    grads = params_local * trainable_fraction * comm_grad_bytes(strategy)
    weights = params_local * recipe.weight_bytes
    stage = strategy.shard_stage
    if stage <= 1:
        n, link = pl.grad_reduce.ranks, dp_link
    else:
        n, link = pl.shard.ranks, shard_link
    bw, a = link.bandwidth_bytes_per_s, link.alpha_s
    per_mb = 0.0
    overlapped_once = None
    if stage <= 1:
        if strategy.engine == "megatron" and strategy.zero == 1:  # distributed optimizer: RS grads + AG params
            rs, ag = ring_reduce_scatter_s(grads, n, bw, a), ring_all_gather_s(weights, n, bw, a)
            once = rs + ag
            if overlaps_dp(strategy):  # --overlap-grad-reduce / --overlap-param-gather (tp_overlap.py)
                per_unit = max(1, units)
                overlapped_once = (interleaved_dp_s(rs, last_bwd_s / chunks, rs / per_unit, chunks=chunks,
                                                    rounds=rounds)
                                   + interleaved_dp_s(ag, mb_compute_s / 3 / chunks, ag / per_unit, chunks=chunks,
                                                      rounds=rounds))
        else:
            once = all_reduce_s(grads, n, link)
            if overlaps_dp(strategy):
                overlapped_once = interleaved_dp_s(once, last_bwd_s / chunks, once / max(1, units), chunks=chunks,
                                                   rounds=rounds)
    elif stage == 2:
        per_mb = ring_reduce_scatter_s(grads, n, bw, a)
        once = ring_all_gather_s(weights, n, bw, a)
        if strategy.fsdp == "grad_op":
            per_mb += ring_all_gather_s(weights, n, bw, a)
            once = 0.0
    else:
        per_mb = 2 * ring_all_gather_s(weights, n, bw, a) + ring_reduce_scatter_s(grads, n, bw, a)
        once = 0.0
    synced_once_s = 0.0
    if keeps_stage_unsharded(strategy):  # one gather and one reduce-scatter per step (pipeline_fsdp.py)
        per_mb = ring_all_gather_s(weights, n, bw, a) + ring_reduce_scatter_s(grads, n, bw, a)
        once = 0.0
        m = 1
    elif syncs_once_per_step(strategy):  # the reduce-scatter after the last micro-batch only (fsdp_grad_sync.py)
        synced_once_s = ring_reduce_scatter_s(grads, n, bw, a)
        per_mb -= synced_once_s
    hsdp = 0.0
    if strategy.fsdp == "hybrid" and pl.grad_reduce.nodes > 1:  # HSDP: replicas all-reduce across nodes
        replicas = max(1, pl.grad_reduce.ranks // max(1, pl.shard.ranks))
        hsdp = all_reduce_s(grads / max(1, pl.shard.ranks), replicas, dp_link)
        once += hsdp
    total = once + m * per_mb + synced_once_s
    # the collectives' GPU-side work: their time at the intra-node link's speed (the interference below scales with it)
    once_link = dp_link if stage <= 1 else shard_link
    gpu_side_s = ((once - hsdp) * gpu_side_share(once_link, intra_bytes_per_s)
                  + hsdp * gpu_side_share(dp_link, intra_bytes_per_s)
                  + (m * per_mb + synced_once_s) * gpu_side_share(shard_link, intra_bytes_per_s))
    if strategy.engine == "torch":
        if strategy.fsdp == "none":  # DDP: overlap with the last backward, the last bucket exposed
            bucket = all_reduce_s(min(grads, DDP_BUCKET_BYTES), n, link)
            exposed = max(exposed_s(once, last_bwd_s), bucket)
        else:  # FSDP: prefetched gathers, overlapped reduce-scatters; the first unit's gather exposed
            exposed = m * max(exposed_s(per_mb, mb_compute_s), per_mb / max(1, units)) + once
            if synced_once_s:  # behind the last backward, unit by unit; the last unit's exposed
                exposed += max(exposed_s(synced_once_s, last_bwd_s), synced_once_s / max(1, units))
    elif strategy.engine == "deepspeed" and stage == 3:  # overlap_comm true, prefetch
        exposed = m * max(exposed_s(per_mb, mb_compute_s), per_mb / max(1, units)) + once
    elif overlapped_once is not None:
        exposed = overlapped_once + m * per_mb
    else:
        exposed = total
    # overlapped collectives still take SMs and HBM bandwidth from the compute they hide behind, in proportion to the
    # bytes they move (gpu_side_share): a NIC-bound collective waits on the network for most of its time
    kappa = (engine or engine_efficiency(strategy.engine)).overlap_interference
    exposed += kappa * max(0.0, total - exposed) * (gpu_side_s / total if total > 0 else 1.0)
    if strategy.offload_params != "none":
        pcie = m * 2 * (weights / max(1, pl.shard.ranks)) / PCIE_BYTES_PER_S
        if strategy.offload_params == "nvme":  # read from the node's NVMe array for forward and backward (shared)
            pcie += m * 2 * (weights / max(1, pl.shard.ranks)) * pl.gpus_per_node / NVME_BYTES_PER_S
        total += pcie
        exposed += pcie
    return DataParallelComm.model_construct(total_s=total, exposed_s=min(total, exposed))


__all__ = ["DataParallelComm", "comm_grad_bytes", "data_parallel_comm", "gpu_side_share"]
