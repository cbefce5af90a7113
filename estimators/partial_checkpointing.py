"""Partial activation checkpointing: full recomputation of the first N repeated blocks of each pipeline stage, the
other blocks keeping their activations (dimensionless fractions and bytes).

Sources:
- Megatron-LM ``--recompute-granularity full --recompute-method block --recompute-num-layers N``
  (``megatron/training/arguments.py``; Megatron-Core ``TransformerConfig.recompute_method="block"`` and
  ``recompute_num_layers``: "recompute the input activations of only a set number of individual Transformer layers
  per pipeline stage and do the rest without any recomputing", ``TransformerBlock._checkpointed_forward``): the first
  N layers of each stage (of each virtual stage under interleaving).
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198) §5:
  a layer either keeps its activations (Table 2's s·b·h·(34 + 5·a·s/h) bytes) or only its input (2·s·b·h) and re-runs
  its forward in backward; checkpointing some of the layers moves memory and time between the two linearly.

A plan sets ``Strategy.checkpoint_layers = N`` with ``checkpointing="full"`` (``None``: every block, plain full
checkpointing). With f = min(N, blocks per stage) / blocks per stage:

- **time**: everything full recomputation adds (the blocks' forward once more: GEMMs, elementwise kernels, the
  tensor- and context-parallel collectives of that pass, the host's replayed kernels and its per-block checkpoint
  work) is added f times: the blocks are equal, and each is either re-run or not;
- **memory**: the activation bytes of every moment of the step are interpolated between the profile's fit without
  checkpointing and its fit with every block checkpointed, ``none − f·(none − full)`` (:func:`blend_bytes`). The
  first blocks' activations are the longest lived (their backward runs last), so checkpointing them lowers every
  moment from the end of the forward on by their saved bytes less their inputs; a recomputed block's working set is
  materialised only once the later blocks' activations are freed. Exact at N = 0 and N = all; in between the
  interpolation spreads the difference of the two fits' non-layer parts (the loss, the recomputation's working set)
  over the blocks, an error of at most one block's activations (measured on CPU: tests/probes, the MLP and GPT-2
  blocks of examples/).
- under model parallelism (Korthikanti's formula, estimators/activations.py) the N checkpointed layers keep their
  input and the others their whole Table 2 bytes.

Pure functions, no torch.
"""

from __future__ import annotations

from optplan.estimators.parallel import layers_per_stage
from optplan.estimators.strategy import Strategy


def checkpointed_blocks(strategy: Strategy, blocks_per_stage: float) -> float:
    """Blocks of one pipeline stage whose forward full checkpointing re-runs (count): all of them under plain full
    checkpointing, ``checkpoint_layers`` (at most the stage's) under partial, none otherwise."""
    if strategy.checkpointing != "full":
        return 0.0
    if strategy.checkpoint_layers is None:
        return blocks_per_stage
    return min(float(strategy.checkpoint_layers), blocks_per_stage)


def recompute_fraction(strategy: Strategy, blocks: int | None) -> float:
    """The share of a stage's blocks that full checkpointing re-runs (0-1): 1 under plain full checkpointing (or a
    model without a block count), ``checkpoint_layers`` ÷ the blocks of the busiest stage under partial, 0 without
    full checkpointing (module docstring)."""
    if strategy.checkpointing != "full":
        return 0.0
    if strategy.checkpoint_layers is None or not blocks:
        return 1.0
    on_stage = layers_per_stage(blocks, strategy.pp)
    return checkpointed_blocks(strategy, float(on_stage)) / on_stage


def is_partial(strategy: Strategy, blocks: int | None) -> bool:
    """Whether ``strategy`` checkpoints only some of a stage's blocks (0 < fraction < 1)."""
    return 0.0 < recompute_fraction(strategy, blocks) < 1.0


def blend_bytes(none_bytes: float, full_bytes: float, fraction: float) -> int:
    """Activation bytes of one moment with ``fraction`` of the blocks checkpointed: ``none − f·(none − full)``
    (bytes; module docstring), at least 0."""
    return max(0, round(none_bytes - fraction * (none_bytes - full_bytes)))
