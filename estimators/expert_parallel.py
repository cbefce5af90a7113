"""Expert parallelism: which parameters the expert-parallel ranks split, and what each rank keeps.

Megatron-Core (``megatron/core/transformer/moe``, "MoE parallel folding", Liu et al. 2025 arXiv 2504.14960 §3):
the routed experts of every MoE layer are divided over ``ep`` ranks carved out of the data-parallel (x context)
group, each expert further split by the expert tensor-parallel size, which defaults to ``tp`` (optplan keeps
that default); the router, shared experts, attention and the rest stay as in a dense model. The distributed
optimizer shards the dense states over the dp·cp ranks and the expert states over the expert-data-parallel
ranks dp·cp/ep, so a rank holds (dense + experts/ep) weights and gradients unsharded, and
(dense + experts)/(dp·cp) of anything sharded: expert parallelism shrinks the unsharded states only.
Units: parameter counts.
"""

from __future__ import annotations

from optplan.estimators.moe import routed_expert_params
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy


def routed_params(profile: ModelProfile) -> int:
    """The routed experts' parameters of the whole model (count; 0 without MoE layers)."""
    shape = profile.transformer
    if shape is None or shape.moe is None:
        return 0
    return routed_expert_params(shape.moe, shape.hidden, shape.gated, shape.layers)


def expert_params_not_held(profile: ModelProfile, strategy: Strategy, stage_share: float) -> float:
    """Of a rank's tensor-parallel share of the routed experts on its pipeline stage (``stage_share``: the
    stage's fraction of the layers), the part the other ep - 1 expert-parallel ranks hold (count)."""
    if strategy.ep == 1:
        return 0.0
    return routed_params(profile) * stage_share / strategy.tp * (1 - 1 / strategy.ep)
