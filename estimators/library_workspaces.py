"""Workspaces the CUDA math libraries allocate through PyTorch's caching allocator (bytes).

cuBLAS (and cuBLASLt, which shares it) gets a workspace per (handle, stream) from
``c10::cuda::CUDACachingAllocator``: PyTorch ``aten/src/ATen/cuda/CublasHandlePool.cpp``, whose default size is
CUBLAS_WORKSPACE_CONFIG ``:4096:2:16:8`` (8.125 MiB), and ``:4096:8`` (32 MiB) on compute capability 9.0
(Hopper). Handles are per thread, and a training step multiplies matrices on two threads (the forward on the
caller's, the backward and any recomputation on autograd's device thread), so it holds two workspaces from its
first matrix product on. The workspaces count in ``torch.cuda.max_memory_allocated``; a CPU step has none.

Measured (data/library_workspaces.yaml): 64.00 MiB between max_memory_allocated and optplan's prediction on every
single-process torch run of the Llama-3 1B layout on an H200 (benchmarks/results/2026-11-26-H200). The GPUs of
other architectures take the default size (not measured here). A user's CUBLAS_WORKSPACE_CONFIG changes the size;
optplan reads the default.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import yaml
from pydantic import BaseModel, ConfigDict, Field


class CublasWorkspace(BaseModel):
    """``data/library_workspaces.yaml``'s ``cublas`` entry (bytes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    default_bytes: int = Field(gt=0, description="one workspace, CUBLAS_WORKSPACE_CONFIG's default (bytes)")
    large_bytes: int = Field(gt=0, description="one workspace on compute capability 9.0 (bytes)")
    large_gpus: tuple[str, ...] = Field(description="catalogue GPUs of compute capability 9.0")
    handles_per_step: int = Field(gt=0, description="threads that multiply matrices in a training step")
    source: str


class LibraryWorkspaces(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    cublas: CublasWorkspace


@cache
def library_workspaces() -> LibraryWorkspaces:
    """The packaged table (read once; immutable)."""
    text = resources.files("optplan.estimators").joinpath("data/library_workspaces.yaml").read_text(encoding="utf-8")
    return LibraryWorkspaces(**yaml.safe_load(text))


def cublas_workspace_bytes(gpu: str | None) -> int:
    """Bytes of cuBLAS workspace a training step holds on catalogue GPU ``gpu`` (None: an unknown GPU, the
    default size): ``handles_per_step`` workspaces of the architecture's default size (module docstring)."""
    table = library_workspaces().cublas
    one = table.large_bytes if gpu is not None and gpu in table.large_gpus else table.default_bytes
    return table.handles_per_step * one


__all__ = ["CublasWorkspace", "LibraryWorkspaces", "cublas_workspace_bytes", "library_workspaces"]
