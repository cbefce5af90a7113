"""Host time of the training loop's op-level selective checkpointing in eager mode (torch and DeepSpeed engines).

torch's selective activation checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``, torch
>= 2.4; probes/trainloop.py ``selective_context``, torchtitan's per-op policy) runs each checkpointed block's forward
under a Python ``TorchDispatchMode`` (``_CachingTorchDispatchMode``) that calls the policy for every ATen operator
and stores the outputs it must keep, and in backward replays the *whole* forward under a second one
(``_CachedTorchDispatchMode``) that serves the kept outputs from that store and re-runs the rest. So, beside the
recomputed kernels (priced on the device: estimators/selective.py), every operator of the block crosses Python twice
more than in a plain step, and the host issues the block's forward once more (Megatron-LM's selective
recomputation replays the attention core alone: compute.py ``SELECTIVE_HOST_PASSES``). Where the host already paces
an eager step (small micro-batches, element-wise-heavy layers), that time is the step's. Under ``torch.compile`` the
policy is applied while tracing and none of it runs per step.

Per layer and micro-batch (seconds):

    host = (1 − SELECTIVE_HOST_PASSES) × host_layer_pass_s + 2 × ops × SAC_OP_HOST_S

with ``ops`` the ATen operators one block's forward dispatches in the step's precision (the profile's count,
``ModelProfile.eager_layer_ops``; views included, since each crosses the dispatch mode).

Measured (benchmarks/results/2026-11-28-H200-visit3, one H200, torch 2.11): op-level selective checkpointing made
eager steps 1.3-2.3x slower than no checkpointing and slower than full checkpointing (Llama-3 1B layout bf16 mbs 2:
84.0 ms none, 194.4 ms selective; compiled, 69.4 and 76.1 ms; GPT-2 amp-bf16 mbs 16: 73.3 none, 81.1 full, 95.2
selective; a timm ViT-B/16 amp-bf16 mbs 64: 65.2 full, 99.5 selective). On this project's 2-core CPU the same
policy costs 10-25 µs of host time per operator and crossing beyond full checkpointing on tiny tensors (GPT-2 and
Llama blocks, fp32; the experiment and its figures are in that visit's README).
"""

from __future__ import annotations

from optplan.estimators.compute import SELECTIVE_HOST_PASSES
from optplan.estimators.eager_traffic import class_figure
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.selective import runs_op_policy
from optplan.estimators.strategy import Strategy

SAC_OP_HOST_S = 34e-6
"""Host seconds per ATen operator and dispatch-mode crossing of eager op-level selective checkpointing (the policy
call, the output store or lookup, the re-dispatch) on the H200 machine's host CPU: the least-squares log error of
the H200 visit's two eager selective runs that take the transformer time model (GPT-2 amp-bf16 mbs 16: +8.2 %, the
Llama-3 1B layout bf16 mbs 2: -8.1 %; 30 µs gives +4.2 / -13.3 %, 40 µs +14.4 / -0.2 %). In-sample: no other eager
selective run was measured. Out of the fit, the ViT's (timm, priced by the FLOPs-only model, whose repeated blocks
pay the same cost: timing.py) went from -81 % to -57 %: the policy is part of what that host-paced step pays."""

DEFAULT_LAYER_OPS = 100.0
"""Operators per block forward when the profile has no count (an ``--arch`` shape or an older profile): above both
blocks probes/traffic.py counted (GPT-2 32-42, Llama-3 76-90 by precision), the slow side for a block not seen
(stated default)."""


def layer_ops(profile: ModelProfile, strategy: Strategy) -> float:
    """ATen operators one repeated block's forward dispatches in ``strategy``'s precision class (a count): the
    profile's own figure, else the nearest class it measured, else ``DEFAULT_LAYER_OPS``."""
    recipe = get_recipe(strategy.precision)
    ops = class_figure(profile.eager_layer_ops or {}, recipe.weight_bytes, recipe.activation_bytes)
    return DEFAULT_LAYER_OPS if ops is None else ops


def selective_host_layer_s(profile: ModelProfile, strategy: Strategy, host_layer_pass_s: float) -> float:
    """Host seconds per layer and micro-batch that eager op-level selective checkpointing adds beyond
    ``SELECTIVE_HOST_PASSES`` forward passes (module docstring); 0 when the strategy does not run the policy in
    eager mode (another checkpointing, Megatron's selective recomputation, ``compile``)."""
    if not runs_op_policy(strategy) or strategy.compile:
        return 0.0
    replay = (1.0 - SELECTIVE_HOST_PASSES) * host_layer_pass_s
    return replay + 2.0 * layer_ops(profile, strategy) * SAC_OP_HOST_S
