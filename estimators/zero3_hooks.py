"""DeepSpeed ZeRO-3's module hooks: host seconds per micro-batch to fetch and release every partitioned parameter.

ZeRO-3 (Rajbhandari et al. 2020, arXiv 1910.02054 §5.3, stage P_os+g+p) keeps each parameter tensor partitioned and
gathers it around every use: DeepSpeed registers a pre- and post-forward and a pre- and post-backward hook on every
module with parameters (``deepspeed/runtime/zero/parameter_offload.py``, ``DeepSpeedZeRoOffload.setup_zero_stage3_hooks``),
and each hook runs its ``PartitionedParameterCoordinator`` (``partitioned_param_coordinator.py``: ``fetch_sub_module``
checks the trace, launches the prefetches and the tensor's all-gather and waits for it; ``release_sub_module`` frees
it again) in Python, per tensor, at every pass over the module. Tensors of at most
``stage3_param_persistence_threshold`` elements are never partitioned and skip the gather (``partition_parameters.py``;
the export's threshold, buckets.py). DeepSpeed's own ``stage3_module_granularity_threshold`` (PR #6649, 2024:
"reducing host overhead (reduce many hooks)") exists because this cost grows with the number of modules, not bytes.

Host seconds per micro-batch (timing.py adds them to the engine's host work, which the p-norm blend then hides behind
the device's where the device is slower):

    hooks_s = fetched tensors × passes × :data:`ZERO3_FETCH_HOST_S`

passes = forward + backward, plus the recomputed forwards (a checkpointed block's recompute calls its modules'
forwards, and their hooks fetch again; under partial checkpointing only the checkpointed blocks' share).

The constant is what the only measured ZeRO-3 run fixes: the Llama-3 1B layout (146 tensors, 113 of them above the
threshold) at micro-batch 2 with full checkpointing on one H200 (``benchmarks/results/2026-11-26-H200-visit2``,
DeepSpeed at world size 1) measured 342 ms per step, against 220.5 ms for the same run under ZeRO-1: 121.5 ms more
for 3 passes x 113 fetches, 0.36 ms per fetch; the profiled step (``2026-11-28-H200-visit4/c2b/trace.json``) had its
kernels busy 97.5 of 515.6 ms, the host running the hooks' Python the rest. An independent and older measurement
agrees in kind and exceeds it in size: DeepSpeedExamples' autotuning of GPT-2 xl on 16 V100s (2021, DeepSpeed 0.5;
``training/autotuning/hf/gpt2-xl/README.md`` at 83757d9) measured 1.244 s per step under ZeRO-3 against 0.484 s
under ZeRO-2 at micro-batch 1: 0.76 s for 2 passes x 194 fetched tensors, 2.0 ms per fetch. The newer and smaller
figure is the one used; a multi-GPU step adds each fetch's all-gather latency, which it does not count. Seconds.
"""

from __future__ import annotations

from optplan.estimators.buckets import deepspeed_buckets
from optplan.estimators.partial_checkpointing import recompute_fraction
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy

ZERO3_FETCH_HOST_S = 0.36e-3
"""Host seconds DeepSpeed ZeRO-3 spends per partitioned tensor and pass (fetch and release hooks): 121.5 ms over
3 x 113 fetches of the Llama-3 1B layout on an H200 (module docstring)."""


def fetched_tensors(profile: ModelProfile) -> int:
    """Trainable parameter tensors ZeRO-3 partitions (more elements than the export's persistence threshold), or 0
    where the profile does not list its tensors."""
    threshold = deepspeed_buckets(profile).stage3_param_persistence_threshold
    return sum(1 for n in profile.param_numels if n > threshold)


def recompute_passes(strategy: Strategy, blocks: int | None) -> float:
    """Forward passes per block run again in backward: the checkpointed share of the ``blocks`` under full (or
    partial) checkpointing (partial_checkpointing.py ``recompute_fraction``), 1 under op-level selective
    checkpointing (torch.utils.checkpoint re-runs the whole block's forward, every module's hooks with it), else 0."""
    if strategy.checkpointing == "selective":
        return 1.0
    return recompute_fraction(strategy, blocks)


def zero3_hooks_host_s(profile: ModelProfile, strategy: Strategy) -> float:
    """Host seconds per micro-batch of DeepSpeed ZeRO-3's fetch and release hooks (module docstring); 0 for any other
    engine or stage."""
    if strategy.engine != "deepspeed" or strategy.zero != 3:
        return 0.0
    passes = 2.0 + recompute_passes(strategy, profile.repeated_block.count if profile.repeated_block else None)
    return fetched_tensors(profile) * passes * ZERO3_FETCH_HOST_S


__all__ = ["ZERO3_FETCH_HOST_S", "fetched_tensors", "recompute_passes", "zero3_hooks_host_s"]
