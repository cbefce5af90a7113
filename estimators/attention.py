"""Attention variants beyond multi-head / grouped-query attention, as plain shapes.

Multi-head latent attention (DeepSeek-V2, Liu et al. 2024, arXiv 2405.04434 §2.1): keys and values come from a
shared rank-``kv_lora`` latent of the hidden state (plus one rotary key of ``rope_dim`` shared by the heads), and
queries from h directly or through a rank-``q_lora`` bottleneck; each head has ``nope_dim`` + ``rope_dim`` query
and key dimensions and ``v_dim`` value dimensions. Parameter counts live in estimators/arch.py (checked against
transformers' DeepseekV2 models); this shape tells the exporters and the time model what the layer is.
Units: widths (elements).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MlaShape(BaseModel):
    """Multi-head latent attention's widths."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kv_lora: int = Field(ge=1, description="rank of the shared key-value latent")
    q_lora: int | None = Field(default=None, ge=1, description="rank of the query bottleneck (None: none)")
    rope_dim: int = Field(ge=0, description="rotary query/key dimensions per head (the key's shared by the heads)")
    nope_dim: int = Field(ge=1, description="non-rotary query/key dimensions per head")
    v_dim: int = Field(ge=1, description="value dimensions per head")
