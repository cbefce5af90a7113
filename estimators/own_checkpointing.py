"""The recompute of a model that checkpoints itself (``torch.utils.checkpoint`` in its own forward).

The profile counts the forward FLOPs such a model's backward re-runs (``ModelProfile.self_recompute_flops_per_sample``,
probes/self_recompute.py). They are hardware FLOPs, not model FLOPs (Chowdhery et al. 2022, PaLM, Appendix B:
MFU leaves rematerialisation out; Korthikanti et al. 2022 §6 call the re-run forward "hardware FLOPs"), so they are
priced as recompute time in every plan that runs the model file, on top of whatever checkpointing the plan itself
adds: the training loop's checkpoint of a block that checkpoints its insides re-runs the block, whose inner
checkpoint then re-runs its part once more (nested non-reentrant checkpoints, torch.utils.checkpoint). Megatron
plans build Megatron's own model from the shape, so the model file's checkpointing does not run there.

Units: FLOPs per sample; shares are dimensionless.
"""

from __future__ import annotations

from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy


def own_recompute_flops_per_sample(profile: ModelProfile, strategy: Strategy) -> float:
    """Forward FLOPs per sample the model's own checkpointing re-runs under ``strategy`` (FLOPs): the profile's count
    for engines that run the model file (torch, DeepSpeed), 0 for Megatron (module docstring)."""
    if strategy.engine == "megatron":
        return 0.0
    return profile.self_recompute_flops_per_sample


def own_recompute_layer_share(profile: ModelProfile, strategy: Strategy, *, layers: int,
                              layer_fwd_flops: float) -> float:
    """The share of one transformer layer's forward that the model's own checkpointing re-runs, per micro-batch on
    one GPU (dimensionless, at most 1): its FLOPs per sample × micro-batch spread over ``layers`` layers and the
    tensor × context ranks, over the layer's forward FLOPs on one GPU (``layer_fwd_flops``, compute.py
    ``LayerTime.fwd_flops``)."""
    own = own_recompute_flops_per_sample(profile, strategy)
    if own <= 0 or layers <= 0 or layer_fwd_flops <= 0:
        return 0.0
    per_layer = own * strategy.mbs / (layers * strategy.tp * strategy.cp)
    return min(1.0, per_layer / layer_fwd_flops)


def own_checkpointing_note(share: float) -> str:
    """The profile's line saying the model checkpoints itself, its backward re-running ``share`` of its forward's
    FLOPs (dimensionless), and how that is priced."""
    return (f"the model checkpoints itself (torch.utils.checkpoint in its forward): its backward re-runs "
            f"{share:.0%} of its forward's FLOPs, priced as recompute in every plan that runs the model file (not "
            "Megatron's) and left out of MFU; where a plan checkpoints too, both re-run (nested checkpoints)")


__all__ = ["own_checkpointing_note", "own_recompute_flops_per_sample", "own_recompute_layer_share"]
