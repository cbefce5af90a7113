"""Host time of an eager step from the kernels it launches (any model the torch or DeepSpeed engine runs eagerly).

An eager PyTorch step is a Python program that issues one CUDA kernel per ATen operator (the dispatcher's unit;
views launch none). The host's cost per kernel (the module call, autograd's bookkeeping, the dispatcher, cuDNN's
or cuBLAS's launch) does not shrink with the tensors, so a model of many small operators (a convolutional net at
a small micro-batch, a 36 MB MLP) is paced by the host, not the GPU: the step takes about kernels x per-kernel
host time however fast the device is (the "overhead-bound" regime: H. He, "Making Deep Learning Go Brrrr From First
Principles", 2022; PyTorch's performance tuning guide, "CPU-bound" training). Per micro-batch (seconds):

    host = (forward + backward + replay) x host_kernel_s + blocks x checkpoint_block_s   (full checkpointing)

``forward`` and ``backward`` are the kernels the profile counted on its own step in the strategy's precision class
(``ModelProfile.eager_step``: fp32, bf16 autocast with its casts, bf16 weights; probes/traffic.py), and
``replay`` the repeated blocks' forward kernels once more under full checkpointing (blocks x
``block_forward_kernels``);
op-level selective checkpointing's extra host work is estimators/selective_host.py's. A pipeline stage issues its
share (÷ pp). ``host_kernel_s`` is the GPU system's (efficiency.py ``GpuEfficiency.host_kernel_s``: the host CPU
and driver that launch, fitted by benchmarks/fit_eager_host.py on the GPU visits' step times).

A transformer's step spreads it over its layers (timing.py: each layer its share, the head's included) and
DeepSpeed multiplies it by its engine's host multiplier (benchmarks/fit_engine_host.py). Not used for Megatron
(its own fused step, not the model file's) nor for a profile without counts (an ``--arch`` shape, an older profile):
those keep the fitted per-layer-pass and per-micro-batch constants. Under ``torch.compile`` (fused kernels, fewer
launches) the constants apply too, bounded by the eager count (:func:`layer_host_s`).
"""

from __future__ import annotations

from optplan.estimators.eager_traffic import class_figure
from optplan.estimators.partial_checkpointing import recompute_fraction
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import EagerStep, ModelProfile
from optplan.estimators.strategy import Strategy

CHECKPOINT_BLOCK_HOST_S = 0.50e-3
"""Host seconds per repeated block and micro-batch that full activation checkpointing adds beyond its replayed
kernels (torch.utils.checkpoint: the saved-tensor hooks, the RNG state stashed and restored, the re-entry into
autograd): fitted with ``HOST_KERNEL_S`` by benchmarks/fit_eager_host.py on the fully checkpointed torch runs among
the H200 visits' (GPT-2 small at micro-batch 4 measured 47.0 ms checkpointed against 23.6 ms not, its device work
about 4 ms more). Weakly identified: 0.50-1.50 ms with one model left out in turn (the sixth visit's re-measured
ResNet-50 and ViT runs, faster than the earlier visits', moved it from 0.90 ms)."""

HOST_KERNEL_S = 25.0e-6
"""Host seconds per eager kernel on the GPU visits' machine (one H200, its host CPU, torch 2.11 eager): fitted by
benchmarks/fit_eager_host.py, with ``CHECKPOINT_BLOCK_HOST_S``, on the 52 eager torch-engine runs under
benchmarks/results/2026-11-2*-H200* (GPT-2 small with its vocabulary as is and padded, the Llama-3 1B layout, the
MLP example, torchvision's and timm's ResNet-50 in both layouts, timm's ViT-B/16: 98-3,069 kernels a micro-batch,
3-1,837 ms a step; a run measured on several visits counts as its last), with their device work priced from the
bytes and FLOPs their profiles counted (Hopper's channels-first convolution passes, conv_layout.py, and its measured
fp32 GEMM fraction, gemm_measured.py, included): step time median |error| 20.3 % with the fixed constants (per
layer pass and micro-batch for transformers, Megatron's fit) -> 7.8 %; fitted with each model left out, 23.0-25.0 µs
and 8.7 %. The visits' traces agree on the host side: ~5-9 µs of host time per
profiled ATen operator, several of which (nested calls, views) make one kernel here.

Not settled, and said so: the kernels differ in host cost (the Llama layout's many small element-wise kernels, RMS
norm and rotary embedding written out, cost less each: its micro-batch-2 bf16 step is priced 13 % slow, GPT-2's
amp-bf16 micro-batch 4 26 % slow); timm's ViT with full or selective checkpointing stays 31-38 % fast."""


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
    if strategy.checkpointing == "full" and profile.repeated_block is not None:  # the checkpointed blocks' share
        count = profile.repeated_block.count
        replay = count * recompute_fraction(strategy, count) * kernels.block_forward_kernels
    return (kernels.forward_kernels + kernels.backward_kernels + replay) / strategy.pp


def _counted_host_s(profile: ModelProfile, strategy: Strategy, host_kernel_s: float,
                    checkpoint_block_s: float) -> float | None:
    """:func:`eager_microbatch_host_s` of the same step run eagerly, whether or not ``strategy`` compiles (the bound
    a compiled step's host time keeps under)."""
    kernels = microbatch_kernels(profile, strategy)
    if kernels is None:
        return None
    count = profile.repeated_block.count if profile.repeated_block is not None else None
    blocks = count / strategy.pp * recompute_fraction(strategy, count) if count is not None else 0.0
    return kernels * host_kernel_s + blocks * checkpoint_block_s


def eager_microbatch_host_s(profile: ModelProfile, strategy: Strategy, host_kernel_s: float,
                            checkpoint_block_s: float = 0.0) -> float | None:
    """Host seconds to issue one micro-batch's kernels on one stage (module docstring), plus ``checkpoint_block_s``
    per repeated block under full checkpointing (torch.utils.checkpoint's own host work per block: module docstring);
    None when the profile counted no kernels or the strategy compiles (the caller then keeps its constants)."""
    return None if strategy.compile else _counted_host_s(profile, strategy, host_kernel_s, checkpoint_block_s)


def microbatch_host_s(profile: ModelProfile, strategy: Strategy, *, host_kernel_s: float, checkpoint_block_s: float,
                      microbatch_s: float) -> float:
    """Host seconds to issue one micro-batch of a model without a transformer shape (timing.py's FLOPs-only path):
    the kernels the profile counted (:func:`eager_microbatch_host_s`), else the fitted constant ``microbatch_s``;
    compiled, that constant bounded by the eager count (:func:`layer_host_s`)."""
    counted = eager_microbatch_host_s(profile, strategy, host_kernel_s, checkpoint_block_s)
    if counted is not None:
        return counted
    if strategy.compile and (eager := _counted_host_s(profile, strategy, host_kernel_s, checkpoint_block_s)) is not None:
        return min(microbatch_s, eager)
    return microbatch_s


def layer_host_s(profile: ModelProfile, strategy: Strategy, *, host_kernel_s: float, checkpoint_block_s: float,
                 microbatch_s: float, constant_layer_s: float, host_multiplier: float, layers_per_stage: float,
                 eager_engine: bool) -> tuple[float, float]:
    """(host seconds per layer of one micro-batch on one stage, host seconds per micro-batch outside the layers) of a
    transformer step; ``host_multiplier`` is the engine's (timing.py), the other constants the GPU's
    (efficiency.py ``GpuEfficiency``: ``host_kernel_s``, ``host_checkpoint_block_s``, ``host_microbatch_s``, and
    ``constant_layer_s`` = multiplier x ``host_layer_pass_s`` x the layer's passes).

    - An eager engine issues the kernels the profile counted (:func:`eager_microbatch_host_s`), each layer its share
      of the micro-batch's (the head's included): (multiplier x counted / layers, 0).
    - Without counts (an ``--arch`` shape, Megatron's own fused step): the fitted constants, ``constant_layer_s``
      per layer and multiplier x ``microbatch_s`` per micro-batch.
    - Compiled by torch.compile (TorchInductor, no CUDA graphs): the constants, but never more than the eager count
      of the same step. Inductor fuses the element-wise kernels and launches what is left from its generated Python
      wrapper, which costs no more per launch than eager's dispatcher, so the eager step's host time bounds the
      compiled one's (TorchInductor's design: Ansel et al., "PyTorch 2", ASPLOS 2024, §4-5). The sixth H200 visit's
      GPT-2 small at micro-batch 8 in bf16 measured 36.6 ms compiled against 36.9 ms eager; the constants priced
      its host at 18.1 ms against the eager count's 5.3 ms."""
    counted = eager_microbatch_host_s(profile, strategy, host_kernel_s, checkpoint_block_s) if eager_engine else None
    if counted is not None:
        return host_multiplier * counted / layers_per_stage, 0.0
    layer_s, head_s = constant_layer_s, host_multiplier * microbatch_s
    if eager_engine and strategy.compile:
        eager = _counted_host_s(profile, strategy, host_kernel_s, checkpoint_block_s)
        if eager is not None and host_multiplier * eager < layer_s * layers_per_stage + head_s:
            return host_multiplier * eager / layers_per_stage, 0.0
    return layer_s, head_s


__all__ = ["CHECKPOINT_BLOCK_HOST_S", "HOST_KERNEL_S", "eager_microbatch_host_s", "layer_host_s", "microbatch_host_s",
           "microbatch_kernels", "step_kernels"]
