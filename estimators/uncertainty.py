"""How sure a step time is: a band from measured residuals, widened outside what was ever measured.

Every time estimate carries ``step_s_low``/``step_s_high`` (seconds). The band comes from the runs the
time model was checked against (``data/time_domain.yaml``, written by
``benchmarks/fidelity_published.py --write-domain``, from the published tables and the GPU runs committed under
``benchmarks/results``): for each measured set (one GPU, one engine family, one kind of model: transformer
shapes, or the models the FLOPs-only path prices) the 5th and 95th percentiles of measured ÷ predicted step
time over its runs. A GPU's own sets and those of the GPU its figures derive from are both candidates; the
band rests on the one whose domain covers the strategy best (the least widening below; one GPU and engine may
hold several sets, e.g. torchtitan's H100 runs beside llm-foundry's, and its context-parallel runs apart). A
strategy is *inside* the set's domain when its model size, GPU count, sequence length, micro-batch tokens, parallel degrees,
precision and checkpointing lie within what the set measured (partial checkpointing, ``checkpoint_layers``: both no and
full checkpointing, between which it lies); outside it the band widens:

- by ``WIDEN_PER_OCTAVE`` of the log step time per doubling beyond a measured range (parameters, GPUs,
  sequence, tokens per micro-batch, tensor/pipeline/context degrees);
- by ``WIDEN_UNMEASURED`` for each thing the set never measured (an engine or a GPU without a set: the
  nearest set stands in; offload; a precision or checkpointing mode not in the set; MoE layers on a GPU without
  a measured MoE set, twice with expert parallelism; the published MoE runs, benchmarks/fidelity_moe.py, are
  the MoE sets: kind ``moe``);
- by ``WIDEN_UNMEASURED`` when the set holds fewer than ``MIN_SET_RUNS`` runs;
- on a GPU with no measured set of its own or of a GPU it derives from: the same plan's band on ``REFERENCE_GPU``
  (all of the above), widened by ``UNMEASURED_GPU_BAND``;
- and when the predicted MFU is above the best MFU ever measured on that GPU and precision (the
  envelope), the slow end is at least the time at the envelope: step × predicted MFU ÷ envelope MFU.

Every reason for widening is returned as text, and ``estimate.py`` turns them into a note. Stated
defaults (not fitted): the two widening rates. Units: seconds, ratios dimensionless. Pure functions.
"""

from __future__ import annotations

import math
from functools import cache
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.hardware import Cluster
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy

WIDEN_PER_OCTAVE = 0.05
"""Extra half-width of the log band per doubling outside a measured range (stated default: the
measured sets' error grows by a few percent per doubling of model size or sequence at their edges)."""
WIDEN_UNMEASURED = 0.10
"""Extra half-width of the log band for each categorical thing never measured (stated default)."""
MIN_SET_RUNS = 5
"""A measured set of fewer runs than this gives its band widened by ``WIDEN_UNMEASURED`` (stated: two or three
runs' 5th-95th percentile says little about the next plan)."""
UNMEASURED_GPU_BAND = 0.35
"""Extra half-width of the log band for a GPU with neither a measured set nor a derived one (stated), on top of the
band this plan gets on :data:`REFERENCE_GPU`."""
REFERENCE_GPU = "H100-SXM"
"""The GPU whose measured sets cover the most (engines, models, scales): a never-measured GPU's band is this GPU's
band for the same plan (so everything the plan does that no one measured still widens it), widened by
:data:`UNMEASURED_GPU_BAND`."""


class MeasuredSet(BaseModel):
    """What one measured set covered and how far the time model was off on it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    gpu: str = Field(description="catalogue name")
    engine: str = Field(description="optplan engine family: torch, deepspeed or megatron")
    source: str
    runs: int = Field(ge=1)
    mape: float = Field(ge=0, description="mean absolute percentage error of the step time, fraction")
    ratio_low: float = Field(gt=0, description="5th percentile of measured ÷ predicted step time")
    ratio_high: float = Field(gt=0, description="95th percentile of measured ÷ predicted step time")
    params: tuple[float, float]
    gpus: tuple[int, int]
    seq: tuple[int, int]
    tokens_per_microbatch: tuple[float, float]
    tp: tuple[int, int] = (1, 1)
    pp: tuple[int, int] = (1, 1)
    cp: tuple[int, int] = (1, 1)
    precisions: tuple[str, ...]
    checkpointing: tuple[str, ...]
    comm_overlap: tuple[bool, ...] = Field(default=(False,), description="whether its runs overlapped Megatron's "
                                                                        "tensor/data-parallel communication "
                                                                        "(Strategy.comm_overlap)")
    max_mfu: dict[str, float] = Field(description="best measured MFU (PaLM definition) by precision class")
    kind: Literal["transformer", "flops_only", "moe"] = Field(
        default="transformer", description="which time path priced its runs: transformer shapes, MoE transformer "
                                           "shapes (experts, their all-to-all), or the FLOPs-only path of models "
                                           "without a shape (timing.py)")


class Derivation(BaseModel):
    """A GPU without a measured set of its own: the set it borrows and why (stated)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str
    from_gpu: str
    widen: float = Field(ge=0, description="extra half-width of the log band")
    reason: str


class TimeDomain(BaseModel):
    """``data/time_domain.yaml``: the measured sets and the derived GPUs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sets: tuple[MeasuredSet, ...]
    derived: tuple[Derivation, ...] = ()


class TimeBand(BaseModel):
    """Multipliers of the predicted step time and why the band is as wide as it is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    low: float = Field(gt=0, description="step_s_low ÷ step_s")
    high: float = Field(gt=0, description="step_s_high ÷ step_s")
    basis: str = Field(description="the measured set the band rests on")
    outside: tuple[str, ...] = Field(default=(), description="what lies outside the measured domain")


@cache
def time_domain() -> TimeDomain:
    """The packaged measured domain (read once; immutable)."""
    text = resources.files("optplan.estimators").joinpath("data/time_domain.yaml").read_text(encoding="utf-8")
    return TimeDomain(**yaml.safe_load(text))


def precision_class(precision: str) -> str:
    """The class MFU envelopes are kept by: the compute dtype (bf16 and fp16 are one class, '16-bit')."""
    dtype = get_recipe(precision).compute_dtype
    return "16-bit" if dtype in ("bf16", "fp16") else dtype


def mfu_envelope(gpu: str, precision: str, domain: TimeDomain | None = None) -> float | None:
    """The best MFU ever measured on ``gpu`` or the GPU its figures derive from, in ``precision``'s class, over
    every measured set of transformer runs; None when nothing was measured there."""
    dom = domain or time_domain()
    cls = precision_class(precision)
    found = [s.max_mfu[cls] for sets, _ in _candidate_groups(gpu, dom) for s in sets
             if s.kind == "transformer" and cls in s.max_mfu]
    return max(found) if found else None


def derived_from(gpu: str, domain: TimeDomain | None = None) -> Derivation | None:
    """The GPU whose measured figures ``gpu``'s derive from (its efficiency constants), whether or not ``gpu`` has
    measured runs of its own; None when it derives from none."""
    dom = domain or time_domain()
    return next((d for d in dom.derived if d.gpu == gpu), None)


def _candidate_groups(gpu: str, dom: TimeDomain) -> list[tuple[list[MeasuredSet], Derivation | None]]:
    """The measured sets that stand for ``gpu``: its own (derivation None) and those of the GPU its figures
    derive from (with that derivation); empty groups are left out."""
    d = derived_from(gpu, dom)
    groups = [([s for s in dom.sets if s.gpu == gpu], None)]
    if d is not None:
        groups.append(([s for s in dom.sets if s.gpu == d.from_gpu], d))
    return [(sets, derivation) for sets, derivation in groups if sets]


def model_kind(profile: ModelProfile) -> Literal["transformer", "flops_only", "moe"]:
    """Which time path prices ``profile``, and so which measured sets judge it (:attr:`MeasuredSet.kind`)."""
    if profile.transformer is None:
        return "flops_only"
    return "moe" if profile.transformer.moe is not None else "transformer"


def _octaves(value: float, lo: float, hi: float) -> float:
    if value > hi > 0:
        return math.log2(value / hi)
    if 0 < value < lo:
        return math.log2(lo / value)
    return 0.0


def _engine_sets(sets: list[MeasuredSet], engine: str) -> tuple[list[MeasuredSet], bool]:
    """The sets of ``engine`` (True), else those of the nearest engine that has any (False)."""
    same = [s for s in sets if s.engine == engine]
    if same:
        return same, True
    # nearest engine: DeepSpeed ZeRO-3 shards like FSDP; ZeRO 0-2 reduce like Megatron-DeepSpeed
    order = {"deepspeed": ("torch", "megatron"), "torch": ("deepspeed", "megatron"),
             "megatron": ("deepspeed", "torch")}[engine]
    for other in order:
        cand = [s for s in sets if s.engine == other]
        if cand:
            return cand, False
    return list(sets), False


def time_band(profile: ModelProfile, strategy: Strategy, cluster: Cluster, *, mfu: float,
              domain: TimeDomain | None = None) -> TimeBand:
    """The band around a predicted step time of ``strategy`` (module docstring); ``mfu`` is the prediction's.

    The GPU's own measured sets and those of the GPU its figures derive from are both candidates (an H200 has
    its own single-GPU runs and borrows the H100's multi-GPU ones): the band rests on the one that covers the
    strategy best (the least widening; then the narrower band). Models without a transformer shape are judged by sets of such
    models (``kind: flops_only``), others by transformer sets."""
    dom = domain or time_domain()
    gpu = cluster.gpu.name
    groups = _candidate_groups(gpu, dom)
    if not groups:
        return _unmeasured_gpu_band(profile, strategy, gpu, dom)
    own_measured = groups[0][1] is None
    bands = [_band_from(profile, strategy, gpu, mfu, dom, sets, d, model_kind(profile), own_measured=own_measured)
             for sets, d in groups]
    # the set whose domain covers the strategy best (least widening), then the narrower band
    return min(bands, key=lambda bw: (round(bw[1], 9), math.log(bw[0].high / bw[0].low)))[0]


def _unmeasured_gpu_band(profile: ModelProfile, strategy: Strategy, gpu: str, dom: TimeDomain) -> TimeBand:
    """A GPU nobody measured: the plan's band on :data:`REFERENCE_GPU` (its widening for what the plan does outside
    every measured set: MoE, expert parallelism, offload, scale...), widened by :data:`UNMEASURED_GPU_BAND`. The
    reference's MFU envelope is not applied (another GPU's peak)."""
    first = f"no step time was ever measured on {gpu}"
    ref_groups = _candidate_groups(REFERENCE_GPU, dom)
    if not ref_groups:  # a domain without the reference (a test's): the flat band
        return TimeBand(low=math.exp(-UNMEASURED_GPU_BAND), high=math.exp(UNMEASURED_GPU_BAND),
                        basis=f"no measured runs on {gpu} or a GPU its figures derive from", outside=(first,))
    sets, derivation = ref_groups[0]
    ref, _ = _band_from(profile, strategy, REFERENCE_GPU, 0.0, dom, sets, derivation, model_kind(profile),
                        own_measured=derivation is None)
    wide = math.exp(UNMEASURED_GPU_BAND)
    reasons = tuple(f"and on {REFERENCE_GPU}, whose band stands in: {r}" for r in ref.outside)
    return TimeBand(low=min(ref.low, 1.0) / wide, high=max(ref.high, 1.0) * wide,
                    basis=f"no measured runs on {gpu} or a GPU its figures derive from: {REFERENCE_GPU}'s band for "
                          f"this plan ({ref.basis}), widened",
                    outside=(first, *reasons))


def _band_from(profile: ModelProfile, strategy: Strategy, gpu: str, mfu: float, dom: TimeDomain,
               sets: list[MeasuredSet], derived: Derivation | None, kind: str, *,
               own_measured: bool = False) -> tuple[TimeBand, float]:
    """The band that one GPU's measured sets give (``derived``: borrowed from the GPU ``gpu`` derives from) and
    its widening (the log half-width added for what lies outside the set's domain)."""
    name = sets[0].gpu
    outside: list[str] = []
    widen = 0.0
    same_kind = [s for s in sets if s.kind == kind]
    if not same_kind and kind == "moe":
        # the experts' GEMMs, and with ep their all-to-all: dense transformer sets stand in
        widen += WIDEN_UNMEASURED * (2 if strategy.ep > 1 else 1)
        outside.append(f"no MoE model was measured on {name}"
                       + (" (nor expert parallelism's all-to-all)" if strategy.ep > 1 else ""))
        same_kind = [s for s in sets if s.kind == "transformer"]
    elif not same_kind:
        widen += WIDEN_UNMEASURED
        outside.append("no model without a transformer shape was measured on " + name if kind == "flops_only"
                       else "no transformer was measured on " + name)
    engine = strategy.engine
    candidates, same_engine = _engine_sets(same_kind or sets, engine)
    # one GPU and engine may hold several sets (torchtitan's context-parallel runs apart from its others): the one
    # that covers the strategy best (the least widening), then the narrower band, then the most runs
    scored = [(_set_widening(profile, strategy, ms, dom, name, kind), ms) for ms in candidates]
    (set_widen, set_outside), ms = min(scored, key=lambda x: (round(x[0][0], 9),
                                                             math.log(x[1].ratio_high / x[1].ratio_low), -x[1].runs))
    if derived is not None:
        widen += derived.widen
        outside.append(f"{gpu}'s own measured runs cover this plan less than {name}'s, which its figures derive "
                       f"from" if own_measured else f"{gpu} was never measured: {derived.reason}")
    if not same_engine:
        widen += WIDEN_UNMEASURED
        outside.append(f"engine {engine} was never measured on {name}: the {ms.engine} set stands in")
    widen += set_widen
    outside.extend(set_outside)
    low = ms.ratio_low * math.exp(-widen)
    high = ms.ratio_high * math.exp(widen)
    envelope = mfu_envelope(gpu, strategy.precision, dom)
    if envelope is not None and mfu > envelope:
        high = max(high, mfu / envelope)
        outside.append(f"predicted MFU {mfu:.0%} is above the best measured on {name} ({envelope:.0%})")
    basis = (f"{ms.name}: {ms.runs} measured runs, {ms.mape:.1%} MAPE, measured/predicted "
             f"{ms.ratio_low:.2f}-{ms.ratio_high:.2f} (5th-95th percentile)")
    return TimeBand(low=min(low, 1.0), high=max(high, 1.0), basis=basis, outside=tuple(outside)), widen


def _set_widening(profile: ModelProfile, strategy: Strategy, ms: MeasuredSet, dom: TimeDomain, name: str,
                  kind: str) -> tuple[float, list[str]]:
    """The log half-width one measured set ``ms`` adds for what of ``strategy`` lies outside its domain, and why."""
    outside: list[str] = []
    widen = 0.0
    if ms.runs < MIN_SET_RUNS:
        widen += WIDEN_UNMEASURED
        outside.append(f"the measured set it rests on ({ms.name.split(':')[0]}) holds only {ms.runs} runs")
    s = strategy
    tokens = profile.tokens_per_sample or 1
    # a transformer fed something other than token ids (a ViT's images) has no sequence to compare with the
    # language models' (FLOPs-only sets count a sample as one "token", as its probes do)
    untokened = profile.input_kind != "tokens" and ms.kind != "flops_only"
    if untokened:
        widen += WIDEN_UNMEASURED
        outside.append(f"the inputs are not token sequences (the runs of {ms.name.split(':')[0]} are language "
                       "models)")
    sequence = () if untokened else (
        ("sequence", float(tokens), ms.seq, "{:.0f}"),
        ("tokens per micro-batch", float(s.mbs * tokens / s.cp), ms.tokens_per_microbatch, "{:.0f}"))
    numeric = (("parameters", float(profile.params), ms.params, "{:.3g}"),
               ("GPUs", float(s.world_size), ms.gpus, "{:.0f}"),
               *sequence,
               ("tensor parallel", float(s.tp), ms.tp, "{:.0f}"),
               ("pipeline parallel", float(s.pp), ms.pp, "{:.0f}"),
               ("context parallel", float(s.cp), ms.cp, "{:.0f}"))
    for label, value, (lo, hi), fmt in numeric:
        octaves = _octaves(value, float(lo), float(hi))
        if octaves > 0:
            widen += WIDEN_PER_OCTAVE * octaves
            outside.append(f"{label} {fmt.format(value)} outside the measured {fmt.format(lo)}-{fmt.format(hi)}")
    if precision_class(s.precision) not in {precision_class(p) for p in ms.precisions}:
        # bf16 and fp16 run at the same tensor-core rate (one class); fp32 and fp8 do not
        widen += WIDEN_UNMEASURED
        outside.append(f"precision {s.precision} not measured (measured: {', '.join(ms.precisions)})")
    # partial checkpointing (checkpoint_layers) lies between no and full checkpointing: both its ends must be measured
    for mode in ((s.checkpointing,) if s.checkpoint_layers is None else ("none", "full")):
        if mode not in ms.checkpointing:
            widen += WIDEN_UNMEASURED
            outside.append(f"checkpointing {mode} not measured" + ("" if s.checkpoint_layers is None else
                                                                   " (partial checkpointing lies between none and full)"))
    if s.offload_optimizer != "none" or s.offload_params != "none":
        widen += WIDEN_UNMEASURED
        outside.append("offload was never measured")
    if kind == "moe" and ms.kind == "moe" and s.ep == 1:
        widen += WIDEN_UNMEASURED  # every measured MoE run split its experts
        outside.append("MoE without expert parallelism was not measured (every measured MoE run used ep > 1)")
    if s.engine == "megatron" and s.comm_overlap not in ms.comm_overlap:
        # widened only where no Megatron set on any GPU measured it (the overlap is a mechanism of the software,
        # not of one GPU: NVIDIA's H100 runs measured it, the A100 tables predate it)
        elsewhere = [m.gpu for m in dom.sets if m.engine == "megatron" and s.comm_overlap in m.comm_overlap]
        if not elsewhere:
            widen += WIDEN_UNMEASURED
        how = f"Megatron {'with' if s.comm_overlap else 'without'} its tensor/data-parallel overlap"
        if not elsewhere:
            outside.append(f"{how} was never measured")
        else:  # measured in another set (maybe on this GPU), not in the one this estimate is judged by
            outside.append(f"{how} is not in the measured set this estimate rests on ({ms.name.split(':')[0]}); "
                           f"other sets measured it on {', '.join(sorted(set(elsewhere)))}")
    if s.compile:  # Inductor's bytes counted, their speed stated; checked, not fitted, on torchtitan's compiled runs
        widen += WIDEN_UNMEASURED
        outside.append("torch.compile of a model without a transformer shape is priced from its eager step's "
                       "counted bytes without the layout transposes (a stated default: no compiled convolution net "
                       "or MLP was ever timed on a GPU; estimators/counted_traffic.py)" if kind == "flops_only" else
                       "torch.compile's kernels are priced by Inductor's own byte count for a reference block at a "
                       "stated speed (no fitted set compiled: benchmarks/fidelity_torchtitan.py checks it on "
                       "torchtitan's 30 compiled H100/H200 runs)")
    if s.engine == "torch" and s.fsdp != "none" and s.pp == 1 and s.fsdp_grad_sync == "step" and s.grad_accum > 1:
        widen += WIDEN_UNMEASURED  # its memory was measured (CPU probe); no step time with it anywhere
        outside.append("FSDP's once-per-step gradient reduction (fsdp_grad_sync step) was never timed")
    if s.dualpipe:  # one published run (DeepSeek-V3's report, H800), a production average
        widen += WIDEN_UNMEASURED
        outside.append("DualPipe's schedule rests on one published run (DeepSeek-V3's report: 180K H800 GPU hours "
                       "per trillion tokens; benchmarks/fidelity_moe.py)")
    if s.async_tp:  # its hidden share measured on one source's forward passes (estimators/async_tp.py)
        widen += WIDEN_UNMEASURED
        outside.append("async TP's hidden share rests on one published source (PyTorch's async-TP post: Llama 3 "
                       "8B/70B forward passes, bf16, H100; estimators/async_tp.py), checked on torchtitan's async-TP "
                       "pairs (benchmarks/fidelity_torchtitan.py)")
    if s.ep_overlap:  # one published pair measured its gain (estimators/ep_overlap.py)
        widen += WIDEN_UNMEASURED
        outside.append("the all-to-all overlap's gain rests on one published pair, where it was over-predicted "
                       "(benchmarks/fidelity_moe.py)")
    if profile.adapter is not None:
        widen += WIDEN_UNMEASURED
        outside.append("no LoRA step time was measured here" + (
            " (the 4-bit dequantisation's pace rests on LitGPT's A10G runtimes, bitsandbytes 0.42)"
            if s.quant in ("nf4", "nf4-dq") else ""))
    return widen, outside


__all__ = ["MIN_SET_RUNS", "MeasuredSet", "TimeBand", "TimeDomain", "derived_from", "mfu_envelope", "model_kind",
           "precision_class", "time_band", "time_domain"]
