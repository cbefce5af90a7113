"""The search space: every legal Strategy for a model on a cluster (single node, data parallel)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import Cluster
from optplan.estimators.precision import require_precision
from optplan.estimators.profile import CheckpointMode, ModelProfile
from optplan.estimators.strategy import Strategy

MAX_MICRO_BATCH = 1024
SEARCHED_PRECISIONS_BF16 = ("bf16", "amp-bf16", "fp32")
SEARCHED_PRECISIONS_NO_BF16 = ("fp16", "amp-fp16", "fp32")


class SearchSpace(BaseModel):
    """The axes of the search; ``global_batch`` None means free (grad_accum = 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: int = Field(ge=1)
    precisions: tuple[str, ...]
    optimizer: str = "adamw"
    zero_stages: tuple[int, ...]
    micro_batches: tuple[int, ...]
    checkpointing: tuple[CheckpointMode, ...]
    global_batch: int | None = None

    @property
    def size(self) -> int:
        """Number of candidate strategies (grad_accum is implied by the global batch)."""
        return len(self.precisions) * len(self.zero_stages) * len(self.micro_batches) * len(self.checkpointing)


def _powers_of_two_upto(limit: int) -> tuple[int, ...]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return tuple(out)


def check_global_batch(global_batch: int | None, gpus: int) -> None:
    """A fixed global batch must be positive and divisible by the data-parallel GPUs."""
    if global_batch is None:
        return
    if global_batch < 1:
        raise OptplanError(f"--global-batch must be >= 1 (got {global_batch})")
    if global_batch % gpus:
        raise OptplanError(f"global batch {global_batch} is not divisible by {gpus} GPUs: "
                           f"use a multiple of {gpus} for --global-batch or change --gpus")


def check_precisions(cluster: Cluster, precisions: Sequence[str]) -> None:
    """Every named precision must exist and have math on the cluster's GPU."""
    for name in precisions:
        require_precision(cluster.gpu, name)


def build_space(profile: ModelProfile, cluster: Cluster, *, global_batch: int | None = None,
                precisions: Sequence[str] | None = None, optimizer: str | None = None) -> SearchSpace:
    """The space for ``profile`` on ``cluster``: dp = all GPUs, powers-of-two micro-batches.

    With a global batch, micro-batches are the divisors b of global_batch/dp (so grad_accum is an
    integer); a global batch not divisible by the GPU count is an error naming both numbers.
    """
    dp = cluster.gpus
    check_global_batch(global_batch, dp)
    if global_batch is not None:
        per_gpu = global_batch // dp
        micro = tuple(b for b in range(1, min(per_gpu, MAX_MICRO_BATCH) + 1) if per_gpu % b == 0)
    else:
        micro = _powers_of_two_upto(MAX_MICRO_BATCH)
    if precisions is None:
        usable = SEARCHED_PRECISIONS_BF16 if cluster.gpu.supports_bf16 else SEARCHED_PRECISIONS_NO_BF16
    else:
        check_precisions(cluster, precisions)
        usable = tuple(dict.fromkeys(precisions))
    ckpt: tuple[CheckpointMode, ...] = ("none", "full") if profile.supports_checkpointing else ("none",)
    return SearchSpace(
        dp=dp, precisions=usable, optimizer=optimizer or profile.defaults.optimizer or "adamw",
        zero_stages=(0, 1, 2, 3) if dp > 1 else (0,), micro_batches=micro, checkpointing=ckpt,
        global_batch=global_batch,
    )


def strategy_for(space: SearchSpace, *, precision: str, zero: int, mbs: int,
                 checkpointing: CheckpointMode, **extra: object) -> Strategy:
    """The Strategy at one point of ``space`` (grad_accum derived from the global batch)."""
    accum = space.global_batch // (mbs * space.dp) if space.global_batch else 1
    return Strategy(precision=precision, optimizer=space.optimizer, zero=zero, mbs=mbs,  # type: ignore[arg-type]
                    grad_accum=accum, checkpointing=checkpointing, dp=space.dp, **extra)  # type: ignore[arg-type]


def enumerate_space(space: SearchSpace) -> Iterator[Strategy]:
    """Every strategy of ``space`` in a fixed order (deterministic)."""
    for precision in space.precisions:
        for zero in space.zero_stages:
            for ckpt in space.checkpointing:
                for mbs in space.micro_batches:
                    yield strategy_for(space, precision=precision, zero=zero, mbs=mbs, checkpointing=ckpt)
