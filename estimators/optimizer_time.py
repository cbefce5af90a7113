"""The optimizer step's time on one rank: on the GPU, the bytes its implementation moves over the achieved HBM
bandwidth; under optimizer offload (ZeRO-Offload, Ren et al. 2021, arXiv 2101.06840 §4) the host's Adam, the PCIe
transfers of gradients and updated weights and, on NVMe (ZeRO-Infinity, Rajbhandari et al. 2021, arXiv
2104.07857), the states read and written once a step. Units: seconds, bytes, bytes/s.
"""

from __future__ import annotations

from optplan.estimators.hardware import GPUSpec
from optplan.estimators.optimizer_traffic import optimizer_step_bytes_per_param
from optplan.estimators.optimizers import optimizer_state_bytes_per_param
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.temporaries import AdamImpl, engine_adam_impl

HOST_OPTIMIZER_BYTES_PER_S = 50e9
"""CPU Adam memory throughput of one node under ZeRO-Offload, shared by its ranks (stated default for
a 2-socket server)."""
PCIE_BYTES_PER_S = 25e9
"""Host<->GPU transfer, PCIe Gen4 x16 achieved (stated default)."""
NVME_BYTES_PER_S = 12e9
"""A node's NVMe array, read or write, shared by its ranks (stated default, not measured here: four PCIe Gen4 drives
at ~3 GB/s each). ZeRO-Infinity (Rajbhandari et al. 2021, arXiv 2104.07857) swaps offloaded optimizer states and
parameters through it; what the host's Adam touches comes in and goes out once per step."""


def on_host_optimizer(strategy: Strategy) -> bool:
    """Whether the optimizer step runs on the host CPU: DeepSpeed's optimizer offload (ZeRO-Offload), and torch
    FSDP's ``CPUOffload(offload_params=True)``, whose parameters and gradients live on the CPU, so that the
    optimizer and its states do too (torch.distributed.fsdp docs, ``CPUOffload``)."""
    return strategy.offload_optimizer != "none" or (strategy.engine == "torch" and strategy.offload_params != "none")


def optimizer_step_s(params_local: float, strategy: Strategy, gpu: GPUSpec, profile: ModelProfile, *,
                     shard_ranks: int, ranks_per_node: int = 1, hbm_fraction: float = 1.0,
                     adam_impl: AdamImpl | None = None) -> float:
    """Optimizer step on this rank's shard (seconds): the bytes the engine's optimizer implementation moves
    per parameter (optimizer_traffic.py: 80 for torch's foreach AdamW, 28 for a fused kernel, plus the
    master-weight copies) over the achieved HBM bandwidth (datasheet × ``hbm_fraction``); under optimizer
    offload the host's Adam (shared by ``ranks_per_node`` ranks) plus the PCIe transfers of gradients (every
    micro-step) and updated weights (ZeRO-Offload, Ren et al. 2021 §4), and on NVMe the states read and written
    once a step at ``NVME_BYTES_PER_S``; torch FSDP's parameter offload runs its optimizer on the host the same
    way (:func:`on_host_optimizer`). ``adam_impl`` overrides the engine's own AdamW (temporaries.engine_adam_impl)."""
    recipe = get_recipe(strategy.precision)
    state = optimizer_state_bytes_per_param(strategy.optimizer, recipe, profile)
    trainable = profile.trainable_params / profile.params if profile.params else 1.0
    shard = params_local * trainable / max(1, shard_ranks)
    if on_host_optimizer(strategy):
        k = recipe.master_bytes + state
        touched = shard * (2 * k + recipe.grad_bytes + recipe.weight_bytes)
        host_s = touched * ranks_per_node / HOST_OPTIMIZER_BYTES_PER_S
        pcie_s = shard * (strategy.grad_accum * recipe.grad_bytes + recipe.weight_bytes) / PCIE_BYTES_PER_S
        # on NVMe, the states the host's Adam updates are read in and written back once a step (ZeRO-Infinity)
        nvme_s = 2 * shard * k * ranks_per_node / NVME_BYTES_PER_S if strategy.offload_optimizer == "nvme" else 0.0
        return host_s + pcie_s + nvme_s
    impl = adam_impl or engine_adam_impl(strategy.engine)
    per_param = optimizer_step_bytes_per_param(strategy.optimizer, recipe, state, impl)
    return shard * per_param / (gpu.memory_bandwidth_bytes_per_s * hbm_fraction)


__all__ = ["HOST_OPTIMIZER_BYTES_PER_S", "NVME_BYTES_PER_S", "PCIE_BYTES_PER_S", "on_host_optimizer",
           "optimizer_step_s"]
