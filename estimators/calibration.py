"""Calibration: corrections learnt from real probe runs, applied to an analytic Estimate.

The analytic models (memory.py, timing.py) are exact accounting plus defaults: the allocator's margin and
the memory outside it, measured on other GPU runs (allocator_overhead.py), and efficiency fractions fitted on
A100 Megatron runs (compute.py). A short real run of the model on the target GPU shows what the defaults
miss: allocator rounding and caching, workspaces, kernel efficiency of this model on this GPU, exposed
communication. ``optplan.planner.calibrate`` fits a :class:`Calibration` from probe results (measured /
predicted ratios) and ``estimate.calibrate_estimate`` applies it:

* memory: the bytes the allocator hands out (model states + activations + buffers) are multiplied by
  ``allocated_scale`` (measured ``torch.cuda.max_memory_allocated`` ÷ predicted); the overhead becomes the
  measured CUDA context/NCCL bytes outside the allocator (``context_bytes``) plus the measured caching-
  allocator margin (``fragmentation_fraction`` × allocated, from ``max_memory_reserved`` ÷
  ``max_memory_allocated`` − 1). Both fall back to the estimate's own (allocator_overhead.py) when not measured.
* time: the on-device parts (compute, recompute, memory-bound kernels, optimizer step, host overhead and
  the pipeline bubble, which is made of the same kernels) are multiplied by ``compute_scale`` (measured
  step ÷ predicted step of a probe without communication); the exposed communication by ``comm_scale``
  (the residual of multi-GPU probes ÷ predicted exposed communication). Throughput, MFU and HFU follow
  the new step time (PaLM's MFU definition is unchanged: model FLOPs ÷ step time ÷ peak).

Units: bytes for memory, seconds for time; scales and fractions are dimensionless. Pure functions, no
torch: this module belongs to the estimators.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.memory import MemoryBreakdown
from optplan.estimators.timing import TimeBreakdown

__all__ = ["Calibration", "calibrate_memory", "calibrate_time", "calibration_key", "torch_release"]

CALIBRATION_DETAIL = "calibration_correction"
"""``detail_bytes`` key of the calibrated correction of allocated bytes (may be negative)."""

_ON_DEVICE = ("compute_s", "recompute_s", "memory_bound_s", "optimizer_s", "host_overhead_s", "bubble_s")
_COMM = ("comm_s", "exposed_comm_s", "tp_comm_s", "cp_comm_s", "pp_comm_s", "dp_comm_s", "exposed_dp_comm_s")


def torch_release(torch_version: str) -> str:
    """A torch version without its PEP 440 local label (``2.11.0+cu130`` -> ``2.11.0``): the release a calibration
    is kept for. ``torch.__version__`` carries the build's label where the package metadata that the planner reads
    may not (the fourth H200 visit's image: ``2.11.0+cu130`` against ``2.11.0``), and a train.py's measurements.json
    records the former: keyed on the whole string, its calibration was stored where no plan looked it up."""
    return torch_version.split("+", 1)[0]


def calibration_key(gpu: str, model_hash: str, torch_version: str) -> str:
    """The cache key of one calibration: GPU name, model hash and torch release (:func:`torch_release`), joined by
    ``|``."""
    return f"{gpu}|{model_hash}|{torch_release(torch_version)}"


class Calibration(BaseModel):
    """Measured ÷ predicted corrections for one (GPU, model, torch version); 1.0 / None = not measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str = Field(description="catalogue name of the GPU the probes ran on ('cpu' for CPU probes)")
    model_hash: str = Field(description="hash of the model profile the probes ran")
    torch_version: str = ""
    compute_scale: float = Field(default=1.0, gt=0, description="measured ÷ predicted on-device step time")
    comm_scale: float = Field(default=1.0, gt=0, description="measured ÷ predicted exposed communication")
    allocated_scale: float = Field(default=1.0, gt=0, description="measured ÷ predicted allocated bytes")
    fragmentation_fraction: float | None = Field(
        default=None, ge=0, description="reserved ÷ allocated − 1 at the peak (caching allocator margin)")
    context_bytes: int | None = Field(default=None, ge=0,
                                      description="device bytes outside torch's allocator (CUDA context, NCCL)")
    time_probes: int = Field(default=0, ge=0, description="probes the time scales rest on")
    memory_probes: int = Field(default=0, ge=0, description="probes the memory corrections rest on")
    source: str = ""

    @property
    def key(self) -> str:
        return calibration_key(self.gpu, self.model_hash, self.torch_version)

    @property
    def calibrates_time(self) -> bool:
        return self.time_probes > 0

    @property
    def calibrates_memory(self) -> bool:
        return self.memory_probes > 0


def calibrate_memory(memory: MemoryBreakdown, cal: Calibration) -> MemoryBreakdown:
    """``memory`` with the allocated bytes scaled and the overhead replaced by the measured one (bytes).

    The correction of the allocated bytes, ``(allocated_scale − 1) × allocated``, is booked under
    ``detail_bytes["calibration_correction"]`` and added to ``overhead_bytes`` (so the categories stay the
    analytic ones and the total is the calibrated one); the overhead is clamped at 0.
    """
    if not cal.calibrates_memory:
        return memory
    allocated = (memory.params_bytes + memory.grads_bytes + memory.optimizer_bytes + memory.activations_bytes
                 + memory.buffers_bytes)
    scaled = allocated * cal.allocated_scale
    correction = round(scaled - allocated)
    # the estimate's own margin, over the bytes it was taken on (a calibrated breakdown: the scaled ones)
    taken_on = allocated + memory.detail_bytes.get(CALIBRATION_DETAIL, 0)
    default_fraction = memory.detail_bytes.get("fragmentation_margin", 0) / taken_on if taken_on else 0.0
    frag_fraction = default_fraction if cal.fragmentation_fraction is None else cal.fragmentation_fraction
    fragmentation = round(frag_fraction * scaled)
    context = memory.detail_bytes.get("cuda_context", 0) if cal.context_bytes is None else cal.context_bytes
    detail = {k: v for k, v in memory.detail_bytes.items() if k not in ("cuda_context", "fragmentation_margin")}
    detail.update({"cuda_context": context, "fragmentation_margin": fragmentation, CALIBRATION_DETAIL: correction})
    overhead = max(0, context + fragmentation + correction)
    return memory.model_copy(update={"overhead_bytes": overhead, "detail_bytes": detail})


def calibrate_time(time: TimeBreakdown, cal: Calibration) -> TimeBreakdown:
    """``time`` with on-device parts × ``compute_scale`` and communication × ``comm_scale`` (seconds);
    throughput (and its band's ends), TFLOP/s, MFU, HFU and efficiency scale with the inverse of the new step time."""
    if not cal.calibrates_time:
        return time
    update: dict[str, float] = {k: getattr(time, k) * cal.compute_scale for k in _ON_DEVICE}
    update.update({k: getattr(time, k) * cal.comm_scale for k in _COMM})
    step_s = sum(update[k] for k in _ON_DEVICE) + update["exposed_comm_s"]
    ratio = time.step_s / step_s  # new throughput ÷ old
    update.update({
        "step_s": step_s, "step_s_low": time.step_s_low / ratio, "step_s_high": time.step_s_high / ratio,
        "samples_per_s": time.samples_per_s * ratio,
        "model_tflops_per_gpu": time.model_tflops_per_gpu * ratio,
        "hardware_tflops_per_gpu": time.hardware_tflops_per_gpu * ratio,
        "mfu": time.mfu * ratio, "hfu": time.hfu * ratio, "efficiency": time.efficiency * ratio,
    })
    for key in ("tokens_per_s", "samples_per_s_low", "samples_per_s_high", "tokens_per_s_low", "tokens_per_s_high"):
        if (value := getattr(time, key)) is not None:
            update[key] = value * ratio
    return time.model_copy(update=update)
