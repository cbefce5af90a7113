"""Selective checkpointing as the torch and DeepSpeed engines run it: the training loop's op-level policy
(probes/trainloop.py ``selective_context``, torchtitan's per-op selective AC: attention outputs and every other
matmul's output saved, the rest of each repeated block recomputed in backward).

The static profile measures both of its costs on the user's model: the activations it keeps (the ``selective``
activation fits, estimators/activations.py) and the forward FLOPs its backward re-runs
(``ModelProfile.selective_recompute_flops_per_sample``: FlopCounterMode's backward count with the policy less
without it; non-reentrant checkpointing stops recomputing once backward has every tensor it needs, so a block's
last matmul, whose output nothing in backward reads, is not re-run). Megatron-LM's selective recomputation is
another mechanism (the attention core only, Korthikanti et al. 2022 §5), priced from the shape.
"""

from __future__ import annotations

from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy

SELECTIVE_FIT_ENGINES = frozenset({"torch", "deepspeed"})
"""Engines whose selective recomputation is the training loop's op-level policy (the user's model run by optplan's
train.py or probes: torch alone, FSDP2, DDP, ``deepspeed.initialize``)."""


def runs_op_policy(strategy: Strategy) -> bool:
    """Whether ``strategy`` checkpoints selectively with the training loop's op-level policy."""
    return strategy.checkpointing == "selective" and strategy.engine in SELECTIVE_FIT_ENGINES


def measured_recompute_flops_per_sample(profile: ModelProfile, strategy: Strategy) -> float | None:
    """The forward FLOPs per sample (whole model, one GPU's view before any split) that the op-level policy
    re-runs in backward, as the profile measured them; None when the strategy does not run the policy or the
    profile did not measure it (then the shape's formula prices selective recomputation)."""
    if not runs_op_policy(strategy):
        return None
    return profile.selective_recompute_flops_per_sample
