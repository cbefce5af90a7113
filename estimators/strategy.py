"""Strategy: one point of the search space (how to train), with the flag names the CLI uses."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from optplan.estimators.profile import CheckpointMode

PrecisionName = Literal["fp32", "amp-bf16", "amp-fp16", "bf16", "fp16", "bf16-pure"]
OptimizerName = Literal["adamw", "adamw-8bit", "sgd"]
OffloadTarget = Literal["none", "cpu", "nvme"]
EngineName = Literal["deepspeed"]


class Strategy(BaseModel):
    """How to train: precision, optimizer, batch split, checkpointing, ZeRO sharding, offload.

    Field names are the ``optplan estimate`` flag names (``--zero``, ``--mbs``, ``--grad-accum``...)
    and the keys of ``plan`` in every ``--json`` document; they are a stable interface.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    precision: PrecisionName = "bf16"
    optimizer: OptimizerName = "adamw"
    zero: int = Field(default=0, ge=0, le=3, description="ZeRO stage 0-3 (0 = plain data parallel)")
    mbs: int = Field(default=1, ge=1, description="micro-batch per GPU (samples)")
    grad_accum: int = Field(default=1, ge=1, description="gradient-accumulation steps")
    checkpointing: CheckpointMode = "none"
    dp: int = Field(default=1, ge=1, description="data-parallel degree (GPUs)")
    offload_optimizer: OffloadTarget = "none"
    offload_params: OffloadTarget = "none"
    engine: EngineName = "deepspeed"

    @model_validator(mode="after")
    def _check(self) -> Strategy:
        if self.offload_params != "none" and self.zero != 3:
            raise ValueError("parameter offload needs ZeRO stage 3 (--zero 3)")
        if self.offload_optimizer != "none" and self.zero == 0:
            raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3 (--zero 1..3)")
        return self

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: mbs x grad_accum x dp."""
        return self.mbs * self.grad_accum * self.dp

    def label(self) -> str:
        """Short human label, e.g. 'bf16 ZeRO-2 mbs8x4 ckpt'."""
        parts = [self.precision, f"ZeRO-{self.zero}", f"mbs{self.mbs}x{self.grad_accum}"]
        if self.checkpointing != "none":
            parts.append("ckpt")
        if self.offload_optimizer != "none":
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_params != "none":
            parts.append(f"params->{self.offload_params}")
        return " ".join(parts)
