"""Device time of an eager step of a model without a transformer shape, from the FLOPs and bytes its profile counted
on its own step (seconds).

A convolution net's training step is mostly memory-bound: batch norm, activations, residual adds and pooling read
and write every activation several times, and a 16-bit convolution on a tensor-core GPU runs far faster than the
element-wise work around it. Timing it by FLOPs alone (the FLOPs-only model's stated efficiency and three passes
over the saved activations, compute.py) put ResNet-50 in AMP at 0.46-0.62 of its measured step on V100 and A100
(NVIDIA's DeepLearningExamples) and left the layout out: timm's own benchmark on an RTX 3090 runs it 1.47x slower
in NCHW than in channels-last. Here each op class is priced on its own roofline side (Williams, Waterman &
Patterson 2009, "Roofline", CACM 52(4), eq. 1: time = work / attainable rate), per micro-batch of m samples:

    compute = FLOPs / (peak(dtype) x f)                      f = gemm_peak_fraction x dtype fraction x m/(m + 4)
    memory  = TRAFFIC_FACTOR x (bytes_per_sample x m + bytes_fixed
                                + NCHW_TRANSPOSE_PASSES x nchw_conv_bytes_per_sample x m)  / (HBM x hbm_fraction)

* FLOPs: the profile's count (convolutions' backward as probes/flop_formulas.py counts it). Under fp32 the
  convolutions run at the TF32 tensor-core peak where the GPU has one: torch's default
  (``torch.backends.cudnn.allow_tf32 = True``; matmuls stay fp32 unless ``torch.backends.cuda.matmul.allow_tf32``,
  PyTorch docs, "TensorFloat-32 (TF32) on Ampere (and later) devices"), the other FLOPs at the fp32 peak.
  ``f`` is the GPU's fitted large-GEMM fraction (efficiency.py, the transformer fits) by compute.py's dtype
  fraction and micro-batch saturation: the element-wise work is no longer folded into it.
* bytes: what the step's memory-bound kernels read and write (``EagerStep.memory_bytes_per_sample``, its fixed
  part and its forward's, counted by probes/traffic.py: every non-GEMM, non-view ATen operator's inputs and
  outputs), times ``TRAFFIC_FACTOR``: the counted bytes are a floor (batch norm reads its input twice, once for the
  statistics; its backward reads the gradient and input twice; kernels below their HBM rate), fitted.
* NCHW tensor-core convolutions: cuDNN's tensor-core convolutions want channels-last, so a channels-first
  activation is transposed around each 16-bit or TF32 convolution (``nchwToNhwcKernel`` and back);
  ``nchw_conv_bytes_per_sample`` are those convolutions' activation bytes (inputs, outputs and their gradients),
  ``NCHW_TRANSPOSE_PASSES`` the extra passes over them, fitted on the 16-bit runs; a GPU where they were measured
  takes its own by convolution math (conv_layout.py: Hopper's batch-norm and transposes cost 6-10x the 3090's).
  Not for fp32 convolutions on CUDA cores (a GPU without TF32: SIMT kernels take NCHW).
* full checkpointing moves the forward's bytes again; op-level selective recomputation re-runs matmuls only
  (compute.py prices them).

Fitted by ``benchmarks/fit_counted_traffic.py`` on timm's 38 RTX 3090 runs (19 architectures, NCHW and NHWC, AMP;
benchmarks/data/convnets_published.json) and checked, never fitted, on DeepLearningExamples' ResNet-50 on V100 and
A100 (FP32, TF32, AMP; 1 and 8 GPUs): see the constants. Not used for profiles that did not count (an ``--arch``
shape, an older profile), nor for transformer shapes (timing.py's per-layer model, with Inductor's own counts of
compiled blocks).

Under ``torch.compile`` the same counted step prices the compiled one: TorchInductor leaves convolutions and GEMMs to
cuDNN and cuBLAS (the same FLOPs at the same rate) and generates the element-wise kernels around them, which on a
convolution net move about what the eager operators move: its own count (``GraphLowering.count_bytes``, as
benchmarks/compiled_traffic.py reads it) over the eager per-operator count of ResNet-50 bottlenecks under bf16
autocast, forward and backward, read 1.14-1.17x (CPU, torch 2.13: training batch norm stays separate reduction and
pointwise kernels that re-read their input; ReLU and the residual add fuse), so :data:`COMPILED_TRAFFIC_RATIO` keeps
the eager bytes and factor (a stated default: no compiled convolution net was ever timed on a GPU, and the plan's
band says so, uncertainty.py). What compile does remove is the layout transposes: Inductor's layout optimisation runs
a graph's convolutions channels-last (``torch._inductor.config.layout_optimization``, pytorch/pytorch#99773: timm AMP
training 1.51x -> 1.65x geomean over eager from it), so no NCHW passes are priced. Published speed-ups of compiled
ResNet training agree: 1.01x for timm ResNet-50 at batch 256 in fp16 on an A100 (PaddlePaddle/benchmark#1672), 1.38x
for torchvision ResNet-152 (pytorch/pytorch#111182).
"""

from __future__ import annotations

from collections.abc import Callable

from optplan.estimators.conv_layout import nchw_passes
from optplan.estimators.eager_traffic import class_figure
from optplan.estimators.hardware import GPUSpec
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import EagerStep, ModelProfile
from optplan.estimators.strategy import Strategy

TRAFFIC_FACTOR = 1.9
"""Achieved time of the counted memory-bound bytes over their time at ``hbm_fraction`` of the datasheet HBM rate
(dimensionless), fitted by benchmarks/fit_counted_traffic.py on timm's 38 RTX 3090 AMP runs."""
NCHW_TRANSPOSE_PASSES = 0.5
"""Extra passes over a channels-first tensor-core convolution's activation bytes (layout transposes;
dimensionless), fitted with ``TRAFFIC_FACTOR`` on the same runs (timm's NCHW-NHWC pairs set it)."""
COMPILED_TRAFFIC_RATIO = 1.0
"""A compiled step's memory-bound time over the eager counted step's without its layout transposes (dimensionless;
stated default, module docstring: Inductor's own byte count of ResNet-50 bottlenecks read 1.14-1.17x the eager
per-operator count, part of what ``TRAFFIC_FACTOR`` stands for; no compiled convolution net was timed)."""


def counted_step(profile: ModelProfile, strategy: Strategy) -> EagerStep | None:
    """The profile's counted step in ``strategy``'s eager precision class (the nearest class counted), or None when
    this model prices the step otherwise: a profile without counted bytes (module docstring). A compiled plan takes
    the eager count too (:func:`memory_s` prices what compile changes)."""
    recipe = get_recipe(strategy.precision)
    step = class_figure(profile.eager_step or {}, recipe.weight_bytes, recipe.activation_bytes)
    return step if step is not None and step.memory_bytes_per_sample else None


def tf32_convolutions(strategy: Strategy, gpu: GPUSpec) -> bool:
    """Whether ``strategy``'s convolutions run at the TF32 peak on ``gpu`` (fp32 recipes on GPUs with TF32 math:
    torch's cuDNN default)."""
    return (get_recipe(strategy.precision).compute_dtype == "fp32"
            and gpu.peak_flops_for("tf32") > gpu.peak_flops_for("fp32"))


def seconds_per_flop(step: EagerStep | None, profile: ModelProfile, strategy: Strategy, gpu: GPUSpec,
                     fraction: Callable[[str], float]) -> float:
    """Mean seconds per FLOP of the step's GEMMs and convolutions: ``fraction(dtype)`` of each dtype's peak, the
    convolutions' share at TF32 where :func:`tf32_convolutions` (module docstring)."""
    dtype = get_recipe(strategy.precision).compute_dtype
    rate = 1.0 / (gpu.peak_flops_for(dtype) * fraction(dtype))
    train = profile.train_flops_per_sample
    if step is None or not tf32_convolutions(strategy, gpu) or train <= 0:
        return rate
    conv = min(1.0, step.conv_flops_per_sample / train)
    return conv / (gpu.peak_flops_for("tf32") * fraction("tf32")) + (1.0 - conv) * rate


def memory_s(step: EagerStep, strategy: Strategy, gpu: GPUSpec, hbm_fraction: float) -> float:
    """Memory-bound seconds of one micro-batch (module docstring); compiled: the eager bytes times
    :data:`COMPILED_TRAFFIC_RATIO`, convolutions channels-last (no layout transposes)."""
    m = strategy.mbs
    moved = step.memory_bytes_per_sample * m + step.memory_bytes_fixed
    if strategy.checkpointing == "full":
        moved += step.memory_forward_bytes_per_sample * m
    if strategy.compile:
        return COMPILED_TRAFFIC_RATIO * TRAFFIC_FACTOR * moved / (gpu.memory_bandwidth_bytes_per_s * hbm_fraction)
    tf32 = tf32_convolutions(strategy, gpu)
    if get_recipe(strategy.precision).activation_bytes == 2 or tf32:
        passes = nchw_passes(gpu.name, tf32=tf32, default=NCHW_TRANSPOSE_PASSES)  # Hopper's measured (conv_layout.py)
        moved += passes * step.nchw_conv_bytes_per_sample * m
    return TRAFFIC_FACTOR * moved / (gpu.memory_bandwidth_bytes_per_s * hbm_fraction)


__all__ = ["COMPILED_TRAFFIC_RATIO", "NCHW_TRANSPOSE_PASSES", "TRAFFIC_FACTOR", "counted_step", "memory_s", "seconds_per_flop",
           "tf32_convolutions"]
