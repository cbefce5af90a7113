"""Partial activation checkpointing: full recomputation of the first N repeated blocks of each pipeline stage, the
other blocks keeping their activations (dimensionless fractions and bytes).

Sources:
- Megatron-LM ``--recompute-granularity full --recompute-method block --recompute-num-layers N``
  (``megatron/training/arguments.py``; Megatron-Core ``TransformerConfig.recompute_method="block"`` and
  ``recompute_num_layers``: "recompute the input activations of only a set number of individual Transformer layers
  per pipeline stage and do the rest without any recomputing", ``TransformerBlock._checkpointed_forward``): the first
  N layers of each stage (of each virtual stage under interleaving).
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198)
  Table 2: a layer either keeps its activations (s·b·h·(34 + 5·a·s/h) bytes) or, recomputed, only its input
  (2·s·b·h) and re-runs its forward in backward.
- Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (arXiv 1604.06174) §3: checkpointing a chosen
  subset of a network's segments, each re-run once in backward; memory and recomputation move between the two ends
  segment by segment, linearly in the count when the segments are equal.

A plan sets ``Strategy.checkpoint_layers = N`` with ``checkpointing="full"`` (``None``: every block, plain full
checkpointing). With f = min(N, blocks per stage) / blocks per stage:

- **time**: everything full recomputation adds (the blocks' forward once more: GEMMs, elementwise kernels, the
  tensor- and context-parallel collectives of that pass, the host's replayed kernels and its per-block checkpoint
  work) is added f times: the blocks are equal, and each is either re-run or not;
- **memory**, from the profile's fits without checkpointing and with every block checkpointed
  (:func:`partial_phase_bytes`): the first blocks' activations are the longest lived (their backward runs last), so
  checkpointing N of them lowers every moment of the step by N·δ, δ a block's saved bytes less its input, down to
  no less than the fully checkpointed step's bytes at that moment (a recomputed block's working set appears only
  once the later blocks' activations are freed). δ is read where every block's saved activations are alive and
  nothing else differs, the ``loss`` moment: δ = (loss without − loss with every block checkpointed) ÷ L, on the fits
  without autocast's weight copies. Those copies (AMP recipes) go the same way: a non-checkpointed block keeps its
  16-bit weights for backward, a checkpointed one casts them again when it is recomputed, so each moment loses N
  blocks' copies, read in ``backward`` (where only the kept blocks hold theirs), down to the full fit's copies.
  Exact at N = 0 and N = L; measured on CPU against real steps of 4-block GPT-2, Llama and MLP models, fp32 and
  amp-bf16, N = 1-3, micro-batches 2 and 4: within 0.25 % (tests/probes/test_cpu_accounting.py). Fits without
  per-moment figures are interpolated, ``none − f·(none − full)`` (:func:`blend_bytes`).
- under model parallelism (Korthikanti's formula, estimators/activations.py) the N checkpointed layers keep their
  input and the others their whole Table 2 bytes.

Pure functions, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

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


DELTA_PHASE = "loss"
"""The moment of the step at which every block's saved activations are alive, and only they differ between no and full
checkpointing (profile.STEP_PHASES: from the model's output to its gradient)."""
COPIES_PHASE = "backward"
"""The moment at which a block's autocast weight copies are held only if the block is not checkpointed: in backward
(the autocast cache, which also holds them in forward, is gone; a recomputed block casts its weights again)."""


def partial_phase_bytes(none: Mapping[str, int], full: Mapping[str, int], checkpointed: float, blocks: int,
                        none_copies: Mapping[str, int] | None = None,
                        full_copies: Mapping[str, int] | None = None) -> dict[str, int]:
    """Activation bytes at each moment of the step with the first ``checkpointed`` of ``blocks`` blocks checkpointed
    (bytes; module docstring), from the fits' per-moment bytes without autocast's weight copies, without (``none``)
    and with every block checkpointed (``full``): ``none − N·δ``, at least ``full``, δ read at :data:`DELTA_PHASE`.
    Autocast's weight copies (``*_copies``: per moment, when the recipe holds them) are added the same way, a block's
    copies read at :data:`COPIES_PHASE`. Without those moments in both fits, the interpolation :func:`blend_bytes`."""
    fraction = checkpointed / blocks
    copies = none_copies is not None and full_copies is not None
    if DELTA_PHASE not in none or DELTA_PHASE not in full or set(none) != set(full):
        out = {phase: blend_bytes(none[phase], full.get(phase, none[phase]), fraction) for phase in none}
        if copies:
            assert none_copies is not None and full_copies is not None
            out = {phase: b + blend_bytes(none_copies.get(phase, 0), full_copies.get(phase, 0), fraction)
                   for phase, b in out.items()}
        return out
    delta = (none[DELTA_PHASE] - full[DELTA_PHASE]) / blocks
    out = {phase: max(full[phase], round(none[phase] - checkpointed * delta)) for phase in none}
    if copies:
        assert none_copies is not None and full_copies is not None
        per_block = (none_copies.get(COPIES_PHASE, 0) - full_copies.get(COPIES_PHASE, 0)) / blocks
        out = {phase: b + max(full_copies.get(phase, 0), round(none_copies.get(phase, 0) - checkpointed * per_block))
               for phase, b in out.items()}
    return out
