"""GPU and cluster descriptions, and the packaged GPU catalogue (``data/gpus.yaml``).

Catalogue figures are datasheet values: dense (no sparsity) peak FLOP/s per dtype, HBM capacity in
bytes and bandwidth in bytes/s, and the intra-node link's per-GPU bandwidth in bytes/s (one
direction). Each entry cites its datasheet in ``source``.
"""

from __future__ import annotations

import difflib
import re
from functools import cache
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.errors import OptplanError

Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]


class GPUSpec(BaseModel):
    """One GPU model's datasheet figures."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    aliases: tuple[str, ...] = ()
    memory_bytes: int = Field(gt=0, description="HBM/GDDR capacity, bytes")
    memory_bandwidth_bytes_per_s: float = Field(gt=0)
    peak_flops: dict[Dtype, float] = Field(description="dense peak FLOP/s per dtype")
    intra_node_bandwidth_bytes_per_s: float = Field(gt=0, description="NVLink/PCIe per GPU, one way")
    intra_node_link: str = "PCIe"
    tdp_watts: float = Field(gt=0)
    source: str
    mfu_reference_flops: float | None = Field(
        default=None, gt=0, description="the datasheet dense 16-bit peak MFU is quoted against (FLOP/s), kept "
                                        "when measured ceilings replace peak_flops; None: read peak_flops")
    gemm_alignment_exponent: float | None = Field(
        default=None, ge=0, description="γ of the GEMM alignment factor (alignment bytes / 16)^γ measured on this "
                                        "machine (estimators/ceilings.py, from the microbenchmark's unaligned GEMMs); "
                                        "None: the GPU's fitted constant (efficiency.py)")

    def peak_flops_for(self, dtype: Dtype) -> float:
        """Dense peak FLOP/s for ``dtype``; 0.0 when the GPU has no such math (e.g. fp8 on A100)."""
        return float(self.peak_flops.get(dtype, 0.0))

    @property
    def supports_bf16(self) -> bool:
        return self.peak_flops_for("bf16") > 0

    @property
    def supports_fp8(self) -> bool:
        return self.peak_flops_for("fp8") > 0


class Cluster(BaseModel):
    """The GPUs a plan targets: ``gpus`` of one kind, ``gpus_per_node`` per node."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: GPUSpec
    gpus: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    inter_node_bandwidth_bytes_per_s: float = Field(
        default=50e9, gt=0, description="per GPU, one way (default: 400 Gb/s InfiniBand NDR per GPU)"
    )
    detected: bool = Field(default=False, description="True when read from NVML, False when --gpu")
    price_per_gpu_hour: float | None = Field(
        default=None, ge=0, description="USD per GPU-hour, or None when unknown"
    )
    gpu_power_w: float | None = Field(
        default=None, gt=0, description="watts drawn per GPU; None means the datasheet TDP"
    )

    @property
    def nodes(self) -> int:
        """Number of nodes (ceil)."""
        return -(-self.gpus // self.gpus_per_node)

    @property
    def power_w_per_gpu(self) -> float:
        """Watts per GPU for energy figures: ``gpu_power_w`` when given, else the GPU's datasheet TDP."""
        return self.gpu_power_w if self.gpu_power_w is not None else self.gpu.tdp_watts


def _catalogue_text() -> str:
    return resources.files("optplan.estimators").joinpath("data/gpus.yaml").read_text(encoding="utf-8")


@cache
def gpu_catalogue() -> dict[str, GPUSpec]:
    """The packaged catalogue as ``name -> GPUSpec`` (read once; the result is immutable data)."""
    raw = yaml.safe_load(_catalogue_text())
    return {entry["name"]: GPUSpec(**entry) for entry in raw["gpus"]}


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def find_gpu(name: str, *, fix: str = "use --gpu with one of") -> GPUSpec:
    """Look a GPU up by catalogue name or alias, ignoring case and punctuation.

    A name as the driver reports it (``nvidia-smi``, NVML: 'NVIDIA H100 80GB HBM3', 'NVIDIA A100-SXM4-40GB') is
    matched as :func:`match_device_name` matches a detected GPU, its memory size picking between variants.

    Raises OptplanError when nothing matches, on one line: the close catalogue names first (when
    any), then ``fix`` followed by every known name, e.g.
    ``unknown GPU 'H10': did you mean H100-SXM, H100-PCIe? (use --gpu with one of A100-40GB, ...)``.
    """
    catalogue = gpu_catalogue()
    wanted = _norm(name)
    for spec in catalogue.values():
        if wanted == _norm(spec.name) or wanted in {_norm(a) for a in spec.aliases}:
            return spec
    if _DRIVER_VENDOR.search(name):  # a name as nvidia-smi / NVML print it: 'NVIDIA H100 80GB HBM3'
        size = _DRIVER_MEMORY.search(name)
        spec = match_device_name(name, int(size.group(1)) * 10**9 if size else None)
        if spec is not None:
            return spec
    raise OptplanError(unknown_gpu_message(name, fix=fix))


_DRIVER_VENDOR = re.compile(r"\b(nvidia|tesla|geforce|quadro)\b", re.IGNORECASE)
_DRIVER_MEMORY = re.compile(r"(\d+)\s*GB", re.IGNORECASE)


def catalogue_variants(given: str, chosen: str) -> list[str]:
    """The other catalogue names of the family ``given`` names when it is not ``chosen``'s own name (``A100`` ->
    ``["A100-40GB"]`` beside the A100-80GB it means), compared normalised like :func:`find_gpu`; [] otherwise."""
    wanted = _norm(given)
    if not wanted or wanted == _norm(chosen):
        return []
    return [name for name in gpu_catalogue() if name != chosen and _norm(name).startswith(wanted)]


def unknown_gpu_message(name: str, *, fix: str = "use --gpu with one of") -> str:
    """The one-line error for a GPU name the catalogue lacks, naming the close names first."""
    known = ", ".join(gpu_catalogue())
    close = close_gpu_names(name)
    if not close:
        return f"unknown GPU '{name}': {fix} {known}"
    return f"unknown GPU '{name}': did you mean {', '.join(close)}? ({fix} {known})"


CLOSE_RATIO = 0.7
"""How similar (difflib ratio) a typed GPU name must be to a catalogue key to be suggested: 0.6 offered RTX-3090 for
'mi300x' (a shared "300"); typos of real names ('rtx 3080', 'a10o') stay above it."""


def close_gpu_names(name: str, limit: int = 3) -> list[str]:
    """Catalogue names close to ``name``, best first (at most ``limit``).

    Names and aliases are compared normalised like the lookup (case and punctuation ignored): an
    entry is close when one of its keys is similar (difflib ratio >= :data:`CLOSE_RATIO`) or, for inputs of three or
    more characters, contains the input or is contained in it (``H10`` -> H100-SXM, H100-PCIe).
    """
    wanted = _norm(name)
    if not wanted:
        return []
    scored = [(score, spec.name) for spec in gpu_catalogue().values()
              if (score := _closeness(wanted, spec)) is not None]
    scored.sort(key=lambda item: -item[0])  # stable: ties keep catalogue order
    return [entry for _, entry in scored[:limit]]


def _closeness(wanted: str, spec: GPUSpec) -> float | None:
    """Best difflib ratio of ``wanted`` against the entry's normalised keys, or None when not close."""
    keys = {_norm(spec.name), *(_norm(a) for a in spec.aliases)} - {""}
    best = max(difflib.SequenceMatcher(None, wanted, key).ratio() for key in keys)
    contained = len(wanted) >= 3 and any(wanted in key or (len(key) >= 3 and key in wanted) for key in keys)
    return best if best >= CLOSE_RATIO or contained else None


def match_device_name(device_name: str, memory_bytes: int | None = None) -> GPUSpec | None:
    """Map a driver-reported name (e.g. 'NVIDIA H100 80GB HBM3') to a catalogue entry, or None.

    Matches the longest alias contained in the normalised device name; when several entries share
    the alias (A100 40/80GB) the one whose memory is closest to ``memory_bytes`` wins.
    """
    dev = _norm(device_name)
    hits: list[tuple[int, GPUSpec]] = []
    for spec in gpu_catalogue().values():
        keys = {_norm(spec.name), *(_norm(a) for a in spec.aliases)}
        best = max((len(k) for k in keys if k and k in dev), default=0)
        if best:
            hits.append((best, spec))
    if not hits:
        return None
    top = max(length for length, _ in hits)
    tied = [spec for length, spec in hits if length == top]
    if memory_bytes is not None and len(tied) > 1:
        return min(tied, key=lambda s: abs(s.memory_bytes - memory_bytes))
    return tied[0]
