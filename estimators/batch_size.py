"""Whether a global batch lies beyond what large-scale training has used: a note, not a limit.

The planner prices any global batch, but time-to-train figures assume every step is as useful as the next. Past the
critical batch size more samples per step stop cutting the steps a target loss needs (McCandlish et al. 2018, "An
Empirical Model of Large-Batch Training", arXiv 1812.06162, eq. 2.11: steps ≈ S_min (1 + B_crit / B)), so a batch
far above any published run's trains less per token than the figures say. The bounds are the largest published
batches, not a model of B_crit:

- language models: DeepSeek-V3's batch ramped to 15,360 sequences of 4,096 tokens, 62.9M tokens per step
  (DeepSeek-AI 2024, arXiv 2412.19437 §4.2); Llama 3 405B used 16M (Dubey et al. 2024, arXiv 2407.21783 §3.4.1).
- image models: 64k images per step on ImageNet with LARS (Ying et al. 2018, arXiv 1811.06992; Goyal et al. 2017,
  arXiv 1706.02677, went to 8k).

Units: tokens and samples per optimizer step.
"""

from __future__ import annotations

LARGEST_TOKEN_BATCH = 64 * 2**20
"""Tokens per optimizer step above which a note is given (just above DeepSeek-V3's 62.9M)."""

LARGEST_SAMPLE_BATCH = 64 * 1024
"""Samples per optimizer step above which a model without token inputs gets the note (ImageNet's 64k)."""


def large_batch_note(global_batch: int, tokens_per_sample: int | None) -> str | None:
    """A note when ``global_batch`` samples (of ``tokens_per_sample`` tokens, None for other inputs) exceed the
    largest published batch of their kind; else None."""
    if tokens_per_sample:
        tokens = global_batch * tokens_per_sample
        if tokens <= LARGEST_TOKEN_BATCH:
            return None
        size = f"{tokens / 1e6:,.0f}M tokens per step ({global_batch:,} x {tokens_per_sample:,})"
        largest = "the largest published language-model batch, DeepSeek-V3's 63M"
    else:
        if global_batch <= LARGEST_SAMPLE_BATCH:
            return None
        size = f"{global_batch:,} samples per step"
        largest = "the largest published image-model batch, 64k on ImageNet"
    return (f"global batch of {size} is above {largest}: past the critical batch size more samples per step stop "
            "cutting the steps to a given loss (McCandlish et al. 2018), so the time to train that tokens imply is "
            "optimistic; a smaller batch on more steps may train as fast")
