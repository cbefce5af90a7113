"""DeepSpeed ZeRO bucket and stage-3 sizes, chosen from the model, in elements (not bytes).

One function decides them so the memory estimate and the exported ds_config.json agree. Rule: the
Hugging Face DeepSpeed integration's "auto" values (transformers.integrations.deepspeed:
reduce_bucket_size = h², stage3_prefetch_bucket_size = 0.9·h², stage3_param_persistence_threshold =
10·h) when the hidden size h is known; otherwise one repeated block's parameters (or a tenth of the
model), clamped to [1e6, 5e8] elements (5e8 is DeepSpeed's default reduce_bucket_size). Max live
parameters and max reuse distance keep DeepSpeed's defaults of 1e9 elements.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.profile import ModelProfile

DEEPSPEED_DEFAULT_BUCKET_ELEMENTS = 500_000_000
DEEPSPEED_DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000
DEEPSPEED_DEFAULT_PERSISTENCE_THRESHOLD = 100_000
DEEPSPEED_DEFAULT_MAX_REUSE_DISTANCE = 1_000_000_000
MIN_BUCKET_ELEMENTS = 1_000_000


class DeepSpeedBuckets(BaseModel):
    """Bucket sizes in elements, as the ds_config keys of the same names take them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reduce_bucket_size: int = Field(ge=1)
    allgather_bucket_size: int = Field(ge=1)
    stage3_prefetch_bucket_size: int = Field(ge=0)
    stage3_param_persistence_threshold: int = Field(ge=0)
    stage3_max_live_parameters: int = Field(ge=1)
    stage3_max_reuse_distance: int = Field(
        default=DEEPSPEED_DEFAULT_MAX_REUSE_DISTANCE, ge=0,
        description="DeepSpeed's default (not written to ds_config.json): a gathered parameter used again "
                    "within this many fetched elements is not released")


def deepspeed_buckets(profile: ModelProfile) -> DeepSpeedBuckets:
    """Bucket sizes for ``profile`` (elements)."""
    if profile.transformer is not None:
        h = profile.transformer.hidden
        base = h * h
        persistence = 10 * h
    else:
        block = profile.repeated_block.params_per_block if profile.repeated_block else 0
        base = block or profile.params // 10
        persistence = DEEPSPEED_DEFAULT_PERSISTENCE_THRESHOLD
    bucket = int(min(DEEPSPEED_DEFAULT_BUCKET_ELEMENTS, max(MIN_BUCKET_ELEMENTS, base)))
    return DeepSpeedBuckets(
        reduce_bucket_size=bucket,
        allgather_bucket_size=bucket,
        stage3_prefetch_bucket_size=int(0.9 * bucket),
        stage3_param_persistence_threshold=int(persistence),
        stage3_max_live_parameters=DEEPSPEED_DEFAULT_MAX_LIVE_PARAMETERS,
    )
