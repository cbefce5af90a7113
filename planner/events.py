"""Progress events the planner emits through callbacks; faces (CLI, dashboard) render them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Stage = Literal["profile", "search", "probe", "export", "validate"]


class ProgressEvent(BaseModel):
    """One step of progress: ``done`` of ``total`` units in ``stage``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: Stage
    done: int
    total: int
    message: str = ""
