"""GPU and cluster descriptions, and the packaged GPU catalogue (``data/gpus.yaml``).

Catalogue figures are datasheet values: dense (no sparsity) peak FLOP/s per dtype, HBM capacity in
bytes and bandwidth in bytes/s, and the intra-node link's per-GPU bandwidth in bytes/s (one
direction). Each entry cites its datasheet in ``source``.
"""

from __future__ import annotations

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

    @property
    def nodes(self) -> int:
        """Number of nodes (ceil)."""
        return -(-self.gpus // self.gpus_per_node)


def _catalogue_text() -> str:
    return resources.files("optplan.estimators").joinpath("data/gpus.yaml").read_text(encoding="utf-8")


@cache
def gpu_catalogue() -> dict[str, GPUSpec]:
    """The packaged catalogue as ``name -> GPUSpec`` (read once; the result is immutable data)."""
    raw = yaml.safe_load(_catalogue_text())
    return {entry["name"]: GPUSpec(**entry) for entry in raw["gpus"]}


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def find_gpu(name: str) -> GPUSpec:
    """Look a GPU up by catalogue name or alias, ignoring case and punctuation.

    Raises OptplanError naming the known GPUs when nothing matches.
    """
    catalogue = gpu_catalogue()
    wanted = _norm(name)
    for spec in catalogue.values():
        if wanted == _norm(spec.name) or wanted in {_norm(a) for a in spec.aliases}:
            return spec
    known = ", ".join(catalogue)
    raise OptplanError(f"unknown GPU '{name}': use --gpu with one of {known}")


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
