"""Estimate: memory, time, throughput and efficiency of one Strategy on one Cluster.

Sources: memory.py (per-GPU memory, worst rank) and timing.py (step time, MFU/HFU) for the parts;
validity.py for the checks that the strategy can run the model on the cluster at all.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.allocator_overhead import MARGIN_NOTE_MARK, fits_at_high_margin, margin_note
from optplan.estimators.batch_size import large_batch_note
from optplan.estimators.calibration import CALIBRATION_DETAIL, Calibration, calibrate_memory, calibrate_time
from optplan.estimators.compiled_activations import compiled_activations_note
from optplan.estimators.cost import CostEstimate
from optplan.estimators.efficiency import derivation_for, fitted_gpus
from optplan.estimators.finetune import finetune_note
from optplan.estimators.hardware import Cluster
from optplan.estimators.memory import MemoryBreakdown, memory_breakdown, usable_capacity_bytes
from optplan.estimators.optimizer_traffic import unfused_step_note
from optplan.estimators.optimizers import (
    optimizer_sees_flat_params,
    optimizer_state_bytes_per_param,
    optimizer_state_note,
)
from optplan.estimators.parallel import placement_notes
from optplan.estimators.pipeline_layout import uneven_split_note
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.ring_attention import ring_attention_note
from optplan.estimators.strategy import PAGED_OPTIMIZERS, Strategy
from optplan.estimators.temporaries import AdamImpl, engine_adam_impl
from optplan.estimators.timing import TimeBreakdown, comm_time_s, mfu_peak_flops, step_time, with_paging
from optplan.estimators.uncertainty import TimeBand, time_band
from optplan.estimators.units import gib, gib_apart, margin_text
from optplan.estimators.validity import check_strategy
from optplan.estimators.vocab_padding import vocab_padding_notes

__all__ = ["Estimate", "StatesEstimate", "TimeBreakdown", "comm_time_s", "estimate", "estimate_reason", "estimate_states",
           "mfu_peak_flops"]


class Estimate(BaseModel):
    """Everything optplan predicts for one strategy: the ``estimate`` object of every --json."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Strategy
    gpu: str
    gpus: int
    memory: MemoryBreakdown
    time: TimeBreakdown
    global_batch: int
    samples_per_s: float
    tokens_per_s: float | None
    model_tflops_per_gpu: float
    mfu: float
    hfu: float
    fits: bool
    reason: str
    fits_at_high_margin: bool | None = Field(
        default=None, description="fits also at the 90th percentile of the allocator margins and contexts measured "
                                  "(allocator_overhead.py), not only at their median; with a margin a probe measured "
                                  "(calibration), the same as fits. None: not known (a file of an older optplan)")
    cost: CostEstimate | None = Field(default=None, description="when a token budget is given")
    notes: tuple[str, ...] = Field(default=(), description="caveats of this estimate's models")


class StatesEstimate(BaseModel):
    """``optplan estimate --params N``: per-GPU memory of model states, buffers and overhead; no time."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Strategy
    gpu: str
    gpus: int
    memory: MemoryBreakdown
    time: None = None
    global_batch: int
    fits: bool
    reason: str
    notes: tuple[str, ...] = ()


def estimate_states(profile: ModelProfile, cluster: Cluster, strategy: Strategy) -> StatesEstimate:
    """Model states (ZeRO §5 per recipe and sharding), buffers and overhead of ``strategy``; no activations."""
    check_strategy(profile, cluster, strategy)
    memory = memory_breakdown(profile, strategy, usable_capacity_bytes(cluster.gpu.memory_bytes),
                              gpus_per_node=cluster.gpus_per_node, gpu=cluster.gpu.name)
    return StatesEstimate(strategy=strategy, gpu=cluster.gpu.name, gpus=strategy.world_size, memory=memory,
                          global_batch=strategy.global_batch, fits=memory.fits, reason=estimate_reason(memory),
                          notes=profile.notes)


def estimate_reason(memory: MemoryBreakdown) -> str:
    """One line: fits with how much free, or does not fit and the largest category."""
    need, cap = gib_apart(memory.total_bytes, memory.capacity_bytes)
    if memory.fits:
        return f"fits: {need} GiB of {cap} GiB per GPU ({margin_text(memory.headroom_bytes)} free)"
    parts = {
        "weights": memory.params_bytes, "gradients": memory.grads_bytes,
        "optimizer states": memory.optimizer_bytes, "activations": memory.activations_bytes,
        "buffers": memory.buffers_bytes,
    }
    largest = max(parts, key=parts.__getitem__)
    return (f"does not fit: needs {need} GiB > {cap} GiB per GPU ({margin_text(memory.headroom_bytes)} over); "
            f"largest part: {largest} {gib(parts[largest]):.1f} GiB")


def estimate_notes(profile: ModelProfile, strategy: Strategy, cluster: Cluster) -> tuple[str, ...]:
    """Caveats that apply to this estimate: an uncalibrated GPU, flags a measured profile cannot honour,
    an optimizer whose state size rests on a fallback or loses its factoring under ZeRO."""
    notes = []
    optimizer = optimizer_state_note(strategy.optimizer, profile, flat_params=optimizer_sees_flat_params(strategy))
    if optimizer:
        notes.append(optimizer)
    if cluster.gpu.name not in fitted_gpus() and derivation_for(cluster.gpu.name) is None:
        notes.append(f"time: {cluster.gpu.name} has no fitted efficiencies; the A100 fit's GEMM, memory and host "
                     "fractions are applied to its datasheet peaks, so throughput and MFU may be optimistic "
                     "until probe runs calibrate them")
    if profile.adapter is not None:
        notes.append(finetune_note(profile.adapter, strategy))
    block = profile.repeated_block
    uneven = uneven_split_note(block.count, strategy.pp, strategy.vpp, strategy.engine) if block is not None else None
    if uneven:
        notes.append(uneven)
    if get_recipe(strategy.precision).compute_dtype == "fp8" and strategy.engine == "torch":
        notes.append("fp8 on the torch engine: the exported train.py runs torchao's Float8Linear (weights cast to fp8 "
                     "in each matmul, bf16 inputs saved for backward), and its memory is priced so (no cached fp8 "
                     "weight copies: estimators/fp8_backend.py, checked on torchtitan's float8 runs); the fp8 GEMM "
                     "speed is Transformer Engine's measured rate, torchao's per-matmul casts are not priced; "
                     "accelerate.yaml's fp8 runs Transformer Engine, which holds 2 more bytes per parameter")
    shape = profile.transformer
    if strategy.cp > 1 and strategy.engine == "torch" and shape is not None:
        notes.append(ring_attention_note(shape.heads, shape.kv_heads or shape.heads, profile.attention_key_heads,
                                         strategy.cp))
    compiled = compiled_activations_note(profile, strategy)
    if compiled:
        notes.append(compiled)
    if not strategy.flash and profile.activation_source == "measured":
        notes.append("--no-flash changes the time only: a model file's activations are measured with its own "
                     "attention code")
    return tuple(notes)


def _optimizer_step_notes(profile: ModelProfile, strategy: Strategy, time: TimeBreakdown,
                          adam_impl: AdamImpl | None) -> tuple[str, ...]:
    """The unfused-AdamW note (optimizer_traffic.py) for an on-GPU optimizer step."""
    if strategy.offload_optimizer != "none":
        return ()
    recipe = get_recipe(strategy.precision)
    note = unfused_step_note(strategy.optimizer, recipe, optimizer_state_bytes_per_param(strategy.optimizer, recipe,
                                                                                          profile),
                             adam_impl or engine_adam_impl(strategy.engine), time.optimizer_s, time.step_s)
    return (note,) if note else ()


def paging_notes(memory: MemoryBreakdown, strategy: Strategy) -> tuple[str, ...]:
    """One note for a paged optimizer (optimizers.py): where its state sits at the forward/backward peak."""
    if strategy.optimizer not in PAGED_OPTIMIZERS:
        return ()
    out = memory.detail_bytes.get("paged_optimizer_state_off_gpu", 0)
    if not out:
        return (f"{strategy.optimizer}: its state stays on the GPU (it fits beside the forward/backward peak); "
                "unified memory pages it out only when the GPU runs short",)
    return (f"{strategy.optimizer}: {out / 2**30:.2f} GiB of optimizer state pages out to host memory at the "
            "forward/backward peak and back for the optimizer step (CUDA unified memory); the page traffic is "
            "priced in optimizer_s at PCIe speed",)


def with_band(time: TimeBreakdown, band: TimeBand) -> TimeBreakdown:
    """``time`` with its band (uncertainty.py): ``step_s_low``/``step_s_high`` in seconds, basis and reasons, and the
    throughput at the band's ends (samples/s and tokens/s: the step's global batch over the slow and fast step)."""
    tokens = time.tokens_per_s
    return time.model_copy(update={
        "step_s_low": time.step_s * band.low, "step_s_high": time.step_s * band.high,
        "samples_per_s_low": time.samples_per_s / band.high, "samples_per_s_high": time.samples_per_s / band.low,
        "tokens_per_s_low": None if tokens is None else tokens / band.high,
        "tokens_per_s_high": None if tokens is None else tokens / band.low,
        "band_basis": band.basis, "outside_measured": band.outside})


def band_notes(band: TimeBand) -> tuple[str, ...]:
    """One note when the estimate lies outside every measured run, naming what and the band's width."""
    if not band.outside:
        return ()
    return (f"time: outside the measured domain ({'; '.join(band.outside)}): the step time may be "
            f"{band.low:.2f}-{band.high:.2f}x the estimate",)


def calibrate_estimate(estimate: Estimate, cal: Calibration | None) -> Estimate:
    """An ``Estimate`` with ``cal`` applied to its memory and time, its fit and reason re-derived, and a note
    saying what was calibrated. ``cal`` None returns ``estimate`` unchanged."""
    if cal is None or not (cal.calibrates_memory or cal.calibrates_time):
        return estimate
    memory = calibrate_memory(estimate.memory, cal)
    time = calibrate_time(estimate.time, cal)
    said = []
    if cal.calibrates_memory:
        said.append(f"memory × {cal.allocated_scale:.3f} from {cal.memory_probes} probe(s)")
    if cal.calibrates_time and time.hfu > 1.0:  # faster than the GPU's peak FLOP/s: the scale is not this plan's
        said.append(f"not the time: compute × {cal.compute_scale:.3f} from {cal.time_probes} probe(s) would run this "
                    f"plan at {time.hfu:.0%} of the GPU's peak FLOP/s")
        time = estimate.time
    elif cal.calibrates_time:
        said.append(f"compute time × {cal.compute_scale:.3f}, communication × {cal.comm_scale:.3f} "
                    f"from {cal.time_probes} probe(s)")
    note = f"calibrated on {cal.gpu} (torch {cal.torch_version or '?'}): " + "; ".join(said)
    kept = estimate.notes
    robust = estimate.fits_at_high_margin
    if cal.calibrates_memory:  # the allocated bytes moved: the margin note is redone on them, or gone if measured
        kept = tuple(n for n in kept if MARGIN_NOTE_MARK not in n)
        robust = memory.fits
        if cal.fragmentation_fraction is None:
            allocated = memory.total_bytes - memory.overhead_bytes + memory.detail_bytes.get(CALIBRATION_DETAIL, 0)
            margin = margin_note(allocated, memory.capacity_bytes, estimate.strategy, cal.context_bytes)
            kept += (margin,) if margin else ()
            robust = fits_at_high_margin(allocated, memory.capacity_bytes, estimate.strategy, cal.context_bytes)
    return estimate.model_copy(update={
        "memory": memory, "time": time, "fits": memory.fits, "reason": estimate_reason(memory),
        "fits_at_high_margin": robust,
        "samples_per_s": time.samples_per_s, "tokens_per_s": time.tokens_per_s,
        "model_tflops_per_gpu": time.model_tflops_per_gpu, "mfu": time.mfu, "hfu": time.hfu,
        "notes": (*kept, note)})


def estimate(profile: ModelProfile, cluster: Cluster, strategy: Strategy, *,
             calibration: Calibration | None = None, adam_impl: AdamImpl | None = None,
             attention_kernel: str | None = None) -> Estimate:
    """Predict memory per GPU (worst rank), step time, throughput, MFU/HFU and feasibility of ``strategy``.

    ``calibration`` (from probe runs, see calibration.py) corrects memory and time when given. ``adam_impl``
    overrides the engine's own AdamW implementation (temporaries.py) in memory and time, ``attention_kernel`` the
    attention kernel the engine runs on the GPU (attention_kernels.py) in time."""
    check_strategy(profile, cluster, strategy)
    memory = memory_breakdown(profile, strategy, usable_capacity_bytes(cluster.gpu.memory_bytes),
                              gpus_per_node=cluster.gpus_per_node, gpu=cluster.gpu.name, adam_impl=adam_impl)
    time = with_paging(step_time(profile, strategy, cluster, adam_impl=adam_impl, attention_kernel=attention_kernel),
                       memory.detail_bytes.get("paged_optimizer_state_off_gpu", 0))
    band = time_band(profile, strategy, cluster, mfu=time.mfu)
    time = with_band(time, band)
    allocated = memory.total_bytes - memory.overhead_bytes
    margin = margin_note(allocated, memory.capacity_bytes, strategy)
    notes = (estimate_notes(profile, strategy, cluster) + placement_notes(strategy, cluster) + band_notes(band)
             + paging_notes(memory, strategy) + _optimizer_step_notes(profile, strategy, time, adam_impl)
             + vocab_padding_notes(profile, strategy, cluster, time.step_s) + ((margin,) if margin else ()))
    if (batch := large_batch_note(strategy.global_batch, profile.tokens_per_sample)) is not None:
        notes = (*notes, batch)
    result = Estimate(notes=notes,
        strategy=strategy, gpu=cluster.gpu.name, gpus=strategy.world_size, memory=memory, time=time,
        global_batch=strategy.global_batch, samples_per_s=time.samples_per_s, tokens_per_s=time.tokens_per_s,
        model_tflops_per_gpu=time.model_tflops_per_gpu, mfu=time.mfu, hfu=time.hfu, fits=memory.fits,
        reason=estimate_reason(memory),
        fits_at_high_margin=fits_at_high_margin(allocated, memory.capacity_bytes, strategy),
    )
    return calibrate_estimate(result, calibration)
