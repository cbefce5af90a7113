"""Achieved-efficiency constants of the time model, per GPU generation and per engine (data/efficiency.yaml).

Two kinds of constants, kept apart because they come from different measurements:

- :class:`GpuEfficiency`, per GPU: what the hardware and its kernels reach (large-GEMM fraction of peak,
  wave and alignment effects, HBM fraction, flash-attention forward and backward fractions, NVLink bus
  bandwidth and latency) plus the host overheads of the stack that was measured on it. Fitted per GPU by
  ``benchmarks/fit_time.py`` on measured runs (A100: vTrain's Megatron-DeepSpeed runs for GEMMs, memory,
  host and links, llm-foundry's FSDP runs for flash attention; H100: llm-foundry's FSDP runs), each with
  its ``source`` naming the data and the fit. GPUs without measurements *derive* from a measured one
  (``derived:`` in the file: H200 is H100's die with faster HBM; B200 a newer part) and say why.
- :class:`EngineEfficiency`, per engine family (torch, deepspeed, megatron): what the training framework
  adds on any GPU: eager elementwise kernels (torch and DeepSpeed run the model's unfused norms, activations and
  residual adds, priced by their measured bytes, estimators/eager_traffic.py, times a fitted multiplier; under
  torch.compile Inductor's measured bytes for a reference block, times ``compile_multiplier``; in Megatron the
  fused count),
  and how much overlapped communication still slows compute (NCCL kernels occupy SMs and HBM bandwidth
  while a GEMM runs: the "overlap interference"). torch's eager multiplier is identified on torchtitan's
  measured eager-vs-compiled pairs (torch 2.6, H100: the same run with only torch.compile changed isolates the
  eager elementwise time) and its overlap interference on llm-foundry's FSDP runs (A100 and H100); DeepSpeed
  takes torch's figures (the same eager model; its ZeRO-3 prefetch overlaps the same way; no measured set:
  stated) and Megatron-DeepSpeed's fused kernels keep the vTrain count (its data-parallel reduction is not
  overlapped, so interference does not arise). An engine's ``host_multiplier`` scales the GPU's eager host times
  (1 for torch and Megatron; DeepSpeed's fitted by ``benchmarks/fit_engine_host.py`` on its runs measured on an
  H200: its engine issues about twice torch's host operators, plus per-step synchronisations).
- ``stacks``: an engine family's constants as an older software stack ran them, for the measured rows that ran
  it and nothing else (no supported torch is that old): ``llm-foundry-2023`` is llm-foundry's MPT on Composer as its
  2023 benchmark tables ran it (images mosaicml/pytorch 1.13.1 for the A100 tables, 2.1.0 for the H100 ones; eager
  MPT blocks with low-precision LayerNorm and Triton flash attention), whose elementwise multiplier the llm-foundry
  fit determines together with the GPUs' GEMM and flash fractions.

Units: fractions are dimensionless; names ending ``_s`` are seconds; wave outputs are GEMM output
elements. Pure data and lookups; no torch.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import yaml
from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.eager_host import CHECKPOINT_BLOCK_HOST_S, HOST_KERNEL_S
from optplan.estimators.gemm_measured import (
    catalogue_alignment,
    catalogue_fp8_fraction,
    catalogue_fp32_fraction,
)
from optplan.estimators.gemm_published import ceiling_ratio
from optplan.estimators.hardware import GPUSpec

LINK_EFFICIENCY = 0.75
"""Achieved bus bandwidth / datasheet link bandwidth (stated default: nccl-tests all-reduce busbw on
H100 NVLink4 reaches ~340-370 of 450 GB/s; A100 NVLink3 ~230 of 300 GB/s)."""
INTRA_NODE_ALPHA_S = 5e-6
"""Latency per ring step inside a node (stated default), seconds."""


class GpuEfficiency(BaseModel):
    """Achieved fractions and host overheads of one GPU system (dimensionless unless a unit is named)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gemm_peak_fraction: float = Field(gt=0, le=1, description="large aligned 16-bit GEMM: achieved / peak")
    gemm_wave_outputs: float = Field(gt=0, description="GEMM output elements per full wave of tiles "
                                                       "(SMs × tile area, effective); efficiency x/(x + ½)")
    alignment_exponent: float = Field(ge=0, description="γ in (alignment bytes / 16)^γ")
    hbm_fraction: float = Field(gt=0, le=1, description="achieved / datasheet HBM bandwidth")
    elementwise_factor: float = Field(ge=0, description="elementwise bytes moved / the kernel-by-kernel count")
    logits_bytes_per_element: float = Field(ge=0, description="cross-entropy bytes moved per logit, fwd+bwd")
    flash_attention_fraction: float = Field(gt=0, le=1, description="flash attention forward: achieved / peak")
    flash_backward_fraction: float = Field(default=0.0, ge=0, le=1,
                                           description="flash attention backward: achieved / peak (0: as forward)")
    fp32_gemm_fraction: float | None = Field(default=None, gt=0, le=1,
                                             description="an fp32 (SIMT) GEMM's achieved / fp32 peak, measured "
                                                         "(gemm_measured.py); None: compute.py's stated ratio")
    fp8_gemm_fraction: float | None = Field(default=None, gt=0, le=1,
                                            description="an fp8 tensor-core GEMM's achieved / fp8 peak, measured "
                                                        "(gemm_measured.py); None: compute.py's stated ratio")
    host_layer_pass_s: float = Field(ge=0, description="host time to issue one layer's forward (s)")
    host_microbatch_s: float = Field(ge=0, description="host time per micro-batch per stage (s)")
    host_step_s: float = Field(ge=0, description="host time per optimizer step (s)")
    host_kernel_s: float = Field(default=HOST_KERNEL_S, ge=0,
                                 description="host time to issue one eager kernel (s; estimators/eager_host.py)")
    host_checkpoint_block_s: float = Field(default=CHECKPOINT_BLOCK_HOST_S, ge=0,
                                           description="host time full checkpointing adds per block and micro-batch "
                                                       "beyond its replayed kernels (s; estimators/eager_host.py)")
    host_collective_step_s: float = Field(ge=0, description="host-side wait per ring step of a blocking "
                                                            "tensor-parallel collective (s)")
    overlap_exponent: float = Field(ge=1, description="p of the host/device p-norm blend")
    intra_node_link_fraction: float = Field(gt=0, le=1, description="achieved bus bandwidth / datasheet link")
    intra_node_alpha_s: float = Field(ge=0, description="latency per ring step on the intra-node link (s)")
    source: str = ""

    @property
    def flash_backward(self) -> float:
        """The backward fraction in use: ``flash_backward_fraction``, or the forward's when 0."""
        return self.flash_backward_fraction or self.flash_attention_fraction


class EngineEfficiency(BaseModel):
    """What an engine family adds on any GPU (dimensionless)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    elementwise_multiplier: float = Field(gt=0, description="elementwise bytes ÷ the count in use (the measured "
                                                            "eager count when ``eager``, else the fused Megatron "
                                                            "count)")
    eager: bool = Field(default=False, description="runs the model's own eager kernels: elementwise bytes are the "
                                                   "measured per-operator count (eager_traffic.py) unless the plan "
                                                   "compiles the blocks (Inductor's measured count, ``compile_multiplier``)")
    compile_multiplier: float = Field(default=1.0, gt=0, description="achieved ÷ modelled time of Inductor's "
                                                                     "measured bytes under torch.compile")
    overlap_interference: float = Field(ge=0, le=1, description="share of overlapped communication time that "
                                                                "still delays compute (SMs/HBM taken by NCCL)")
    host_multiplier: float = Field(default=1.0, gt=0, description="the engine's host time per layer pass, micro-batch "
                                                                  "and optimizer step ÷ the GPU's fitted eager torch "
                                                                  "host times (DeepSpeed's engine issues more)")
    source: str = ""


class Derivation(BaseModel):
    """A GPU without its own fit: whose constants it takes, which it changes, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    from_gpu: str
    update: dict[str, float] = Field(default_factory=dict)
    gemm_ceiling: bool = Field(default=False, description="scale the GEMM fraction by the two GPUs' published matmul "
                               "shares of peak (gemm_published.py)")
    reason: str


class EfficiencyTable(BaseModel):
    """``data/efficiency.yaml``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpus: dict[str, GpuEfficiency]
    derived: dict[str, Derivation] = Field(default_factory=dict)
    default_gpu: str = Field(description="the fit GPUs without a fit or a derivation take (compute fractions)")
    engines: dict[str, EngineEfficiency]
    stacks: dict[str, EngineEfficiency] = Field(default_factory=dict, description="an engine family as an older "
                                                "software stack ran it: only the measured rows that ran it use it")


@cache
def efficiency_table() -> EfficiencyTable:
    """The packaged table (read once; immutable)."""
    text = resources.files("optplan.estimators").joinpath("data/efficiency.yaml").read_text(encoding="utf-8")
    return EfficiencyTable(**yaml.safe_load(text))


@cache
def _resolved() -> dict[str, GpuEfficiency]:
    return resolve(efficiency_table())


def resolve(table: EfficiencyTable) -> dict[str, GpuEfficiency]:
    """Every GPU of ``table`` with constants: its fit, or its derivation applied (``update``, then the published
    matmul-ceiling ratio where ``gemm_ceiling``, gemm_published.py); a source saying which."""
    out = dict(table.gpus)
    for name, d in table.derived.items():
        base = table.gpus[d.from_gpu]
        update: dict[str, object] = {**d.update, "source": f"derived from {d.from_gpu}: {d.reason}"}
        if d.gemm_ceiling:
            ratio = ceiling_ratio(name, d.from_gpu)
            if ratio is None:
                raise ValueError(f"efficiency.yaml: {name} derives its GEMM fraction from published matmul ceilings, "
                                 f"but data/gemm_published.yaml has no row for {name} or {d.from_gpu}")
            fraction = update.get("gemm_peak_fraction", base.gemm_peak_fraction)
            update["gemm_peak_fraction"] = float(fraction) * ratio  # type: ignore[arg-type]
            update["source"] = (f"{update['source']}; GEMM fraction x{ratio:.3f}, its published matmul share of peak "
                                f"over the {d.from_gpu}'s (data/gemm_published.yaml)")
        out[name] = base.model_copy(update=update)
    return out


def fitted_gpus() -> tuple[str, ...]:
    """Catalogue names with constants of their own (fitted on measured runs)."""
    return tuple(efficiency_table().gpus)


@cache
def default_efficiency() -> GpuEfficiency:
    """Constants for a GPU without a fit or derivation: the default GPU's dimensionless compute fractions and
    host overheads against the GPU's own datasheet peaks, and the generic link figures (stated)."""
    table = efficiency_table()
    base = table.gpus[table.default_gpu]
    return base.model_copy(update={
        "intra_node_link_fraction": LINK_EFFICIENCY, "intra_node_alpha_s": INTRA_NODE_ALPHA_S,
        "source": f"no fit for this GPU: the {table.default_gpu} fit's GEMM, HBM and elementwise fractions and "
                  "host overheads; the default link efficiency and latency (stated defaults)"})


def efficiency_for(gpu: GPUSpec) -> GpuEfficiency:
    """The constants for ``gpu``: its fit, else its derivation, else :func:`default_efficiency`; a GEMM alignment
    exponent measured on the machine (``GPUSpec.gemm_alignment_exponent``, estimators/ceilings.py) replaces the
    fitted one, else one measured on a GPU of the same kind (gemm_measured.py, data/gemm_measured.yaml)."""
    eff = _catalogue_efficiency(gpu.name)
    if gpu.gemm_alignment_exponent is not None:
        return eff.model_copy(update={"alignment_exponent": gpu.gemm_alignment_exponent})
    return eff


@cache
def _catalogue_efficiency(name: str) -> GpuEfficiency:
    """A catalogue GPU's constants: its fit, else its derivation, else the default; the GEMM alignment exponent
    measured on a GPU of its kind where one was (gemm_measured.py). One object per name (cached)."""
    found = _resolved().get(name)
    eff = found if found is not None else default_efficiency()
    catalogue = catalogue_alignment(name)
    if catalogue is not None:
        eff = eff.model_copy(update={"alignment_exponent": catalogue[0], "source": f"{eff.source}; {catalogue[1]}"})
    fp32 = catalogue_fp32_fraction(name)
    if fp32 is not None:
        eff = eff.model_copy(update={"fp32_gemm_fraction": fp32,
                                     "source": f"{eff.source}; fp32 GEMM fraction {fp32:.2f} measured"})
    fp8 = catalogue_fp8_fraction(name)
    if fp8 is not None:
        eff = eff.model_copy(update={"fp8_gemm_fraction": fp8,
                                     "source": f"{eff.source}; fp8 GEMM fraction {fp8:.2f} measured"})
    return eff


def derivation_for(gpu_name: str) -> Derivation | None:
    """How ``gpu_name``'s constants were derived, or None (fitted, or no derivation)."""
    return efficiency_table().derived.get(gpu_name)


def engine_efficiency(engine: str) -> EngineEfficiency:
    """The engine family's constants (torch, deepspeed or megatron)."""
    return efficiency_table().engines[engine]


def stack_efficiency(stack: str) -> EngineEfficiency:
    """An older software stack's engine constants (``stacks`` in the data file), for the measured rows that ran it."""
    stacks = efficiency_table().stacks
    if stack not in stacks:
        raise KeyError(f"unknown software stack {stack!r}: known are {', '.join(sorted(stacks)) or 'none'}")
    return stacks[stack]


__all__ = ["Derivation", "EfficiencyTable", "EngineEfficiency", "GpuEfficiency", "INTRA_NODE_ALPHA_S",
           "LINK_EFFICIENCY", "default_efficiency", "derivation_for", "efficiency_for", "efficiency_table",
           "engine_efficiency", "fitted_gpus", "resolve", "stack_efficiency"]
