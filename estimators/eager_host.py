"""Host time of an eager step from the kernels it launches (models without a transformer shape).

An eager PyTorch step is a Python program that issues one CUDA kernel per ATen operator (the dispatcher's unit;
views launch none). The host's cost per kernel (the module call, autograd's bookkeeping, the dispatcher, cuDNN's
or cuBLAS's launch) does not shrink with the tensors, so a model of many small operators (a convolutional net at
a small micro-batch, a 36 MB MLP) is paced by the host, not the GPU: the step takes about kernels x per-kernel
host time however fast the device is (the "overhead-bound" regime: H. He, "Making Deep Learning Go Brrrr From First
Principles", 2022; PyTorch's performance tuning guide, "CPU-bound" training). Per micro-batch (seconds):

    host = (forward + backward + replay) x host_kernel_s

``forward`` and ``backward`` are the kernels the profile counted on its own step in the strategy's precision class
(``ModelProfile.eager_step``: fp32, bf16 autocast with its casts, bf16 weights; probes/traffic.py), and
``replay`` the repeated blocks' forward kernels once more under full checkpointing (blocks x
``block_forward_kernels``);
op-level selective checkpointing's extra host work is estimators/selective_host.py's. A pipeline stage issues its
share (÷ pp). ``host_kernel_s`` is the GPU system's (efficiency.py ``GpuEfficiency.host_kernel_s``: the host CPU
and driver that launch, fitted by benchmarks/fit_eager_host.py on the GPU visits' step times).

Not used under ``torch.compile`` (fused kernels, fewer launches: the compiled step keeps the fitted per-micro-batch
constant) nor for transformer shapes (timing.py prices their host per layer pass, ``host_layer_pass_s``).
"""

from __future__ import annotations

from optplan.estimators.eager_traffic import class_figure
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import EagerStep, ModelProfile
from optplan.estimators.strategy import Strategy

HOST_KERNEL_S = 27.5e-6
"""Host seconds per eager kernel on the GPU visits' machine (one H200, its host CPU, torch 2.11 eager): fitted by
benchmarks/fit_eager_host.py on the 15 eager runs of models without a transformer shape under
benchmarks/results/2026-11-2*-H200* (the MLP example, torchvision's and timm's ResNet-50, timm's ViT-B/16: 98-1,049
kernels a micro-batch, 3-99 ms a step), with their device work priced from the bytes and FLOPs their profiles
counted (estimators/counted_traffic.py): step time median |error| 31.0 % with the fixed per-micro-batch constant ->
15.3 %; fitted with each model left out, 26.0-29.5 µs and 18.5 % (26.5 µs, 14.3 %, when the device work was the
FLOPs-only constants'). ResNet-50 at micro-batch 32 in bf16: -80 % -> -5 % (torchvision), -82 % -> -4 % (timm, AMP).
Left: timm's ViT with full or selective checkpointing stays 36-39 % fast (checkpointing's own saved-tensor hooks are
host work not counted here) and the MLP under DeepSpeed ZeRO-0 slow (DeepSpeed's host multiplier,
fit_engine_host.py, was fitted on per-layer host times). The visits' traces agree on the host side: ~6-9 µs of host
time per profiled ATen operator (benchmarks/results/2026-11-28-H200-visit3), several of which (nested calls, views)
make one kernel here, and an MLP step whose kernels kept the GPU busy 1.1 of 3.4 ms.

Not settled, and said so: ResNet-50's bf16 step keeps the GPU busy 15.5 of its 17.4 ms at micro-batch 32 (the
second visit's trace: 11.7 ms of kernels outside the GEMM names, batch norm over NCHW 16-bit tensors among them);
the counted bytes price 6.5 ms of device work there (counted_traffic.py, fitted on Volta and Ampere runs), so on
this H200 stack the device side may be ~2x short, which the host time per kernel, fitted on the same steps, would
then partly carry: a 16-bit convolution net at micro-batch 128 is priced 28 ms where the trace scaled with the
batch says up to ~60. The fidelity suite's GPU-only ResNet-50 AMP cases at micro-batch 64 and 128 measure it."""


def step_kernels(profile: ModelProfile, strategy: Strategy) -> EagerStep | None:
    """The profile's kernel count in ``strategy``'s eager precision class, else the nearest class it counted
    (amp, bf16, fp32); None when the profile counted none (an ``--arch`` shape, an older profile)."""
    recipe = get_recipe(strategy.precision)
    return class_figure(profile.eager_step or {}, recipe.weight_bytes, recipe.activation_bytes)


def microbatch_kernels(profile: ModelProfile, strategy: Strategy) -> float | None:
    """Kernels one pipeline stage launches per micro-batch (a count): forward, backward and, under full
    checkpointing, the repeated blocks' forward again (module docstring); None without a count."""
    kernels = step_kernels(profile, strategy)
    if kernels is None:
        return None
    replay = 0.0
    if strategy.checkpointing == "full" and profile.repeated_block is not None:
        replay = profile.repeated_block.count * kernels.block_forward_kernels
    return (kernels.forward_kernels + kernels.backward_kernels + replay) / strategy.pp


def eager_microbatch_host_s(profile: ModelProfile, strategy: Strategy, host_kernel_s: float) -> float | None:
    """Host seconds to issue one micro-batch's kernels on one stage (module docstring); None when the profile
    counted no kernels or the strategy compiles (the caller then keeps its per-micro-batch constant)."""
    if strategy.compile:
        return None
    kernels = microbatch_kernels(profile, strategy)
    return None if kernels is None else kernels * host_kernel_s


__all__ = ["HOST_KERNEL_S", "eager_microbatch_host_s", "microbatch_kernels", "step_kernels"]
