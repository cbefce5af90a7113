"""Where a model's parameters sit, and how many one rank of a pipeline stage holds (parameter counts).

Narayanan et al. 2021 (arXiv 2104.04473 §2.2-2.3; Shoeybi et al. 2019 Megatron-LM): tensor parallelism splits
every block's matrices and the vocabulary-parallel embedding and head by t (norms and learned positions stay
replicated; counted as split, < 0.1 % of a block); pipeline parallelism gives each rank ceil(L/p) blocks
(estimators/pipeline_layout.py), the embedding to the first stage and the head to the last (a tied embedding is
copied to the last stage, as Megatron does). Expert parallelism divides the routed experts of the stage's MoE
layers (estimators/expert_parallel.py); a model's own tensor-parallel plan splits what it names
(estimators/tensor_plan.py).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from optplan.estimators.expert_parallel import expert_params_not_held
from optplan.estimators.parallel import layers_per_stage
from optplan.estimators.pipeline import dualpipe_stages
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.tensor_plan import params_per_tp_rank, uses_model_tp_plan


class ParamSplit(BaseModel):
    """Where a model's parameters sit: repeated blocks, input embedding, output head, the rest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: int
    per_block: int
    embed: int
    head: int
    tied: bool
    other: int


def param_split(profile: ModelProfile) -> ParamSplit:
    """Split the parameters into blocks, embedding (V·h), head (V·h when untied) and the rest.

    Without a transformer shape every non-block parameter is "other" (placed on the first stage).
    """
    block = profile.repeated_block
    layers, per_block = (block.count, block.params_per_block) if block else (0, 0)
    rest = max(0, profile.params - layers * per_block)
    shape = profile.transformer
    if shape is None or not shape.vocab:
        return ParamSplit(layers=layers, per_block=per_block, embed=0, head=0, tied=False, other=rest)
    table = shape.vocab * shape.hidden
    embed = min(table, rest)
    head = table if rest - embed >= table else 0
    return ParamSplit(layers=layers, per_block=per_block, embed=embed, head=head, tied=head == 0,
                      other=rest - embed - head)


def stage_params(profile: ModelProfile, strategy: Strategy, stage: int = 0) -> float:
    """Parameters held by one rank of pipeline ``stage`` after tensor and expert parallelism (count, before
    ZeRO): with ep > 1 the routed experts of the stage's MoE layers are 1/ep of them (estimators/expert_parallel.py).
    Under DualPipe the rank also holds the mirrored stage p − 1 − ``stage`` (estimators/pipeline.py)."""
    return sum(one_stage_params(profile, strategy, st) for st in rank_stages(strategy, stage))


def rank_stages(strategy: Strategy, stage: int) -> tuple[int, ...]:
    """The pipeline stages the rank of ``stage`` holds: its own, and under DualPipe the mirrored one too."""
    if strategy.dualpipe:
        return dualpipe_stages(strategy.pp, stage)
    return (stage,)


def one_stage_params(profile: ModelProfile, strategy: Strategy, stage: int = 0) -> float:
    """Parameters of one pipeline stage on one rank after tensor and expert parallelism (count, before ZeRO):
    :func:`stage_params` without DualPipe's second stage."""
    held = _one_stage_all_experts(profile, strategy, stage)
    if strategy.ep == 1 and strategy.expert_tp == strategy.tp:
        return held
    block = profile.repeated_block
    share = layers_per_stage(block.count, strategy.pp) / block.count if block and strategy.pp > 1 else 1.0
    return held - expert_params_not_held(profile, strategy, share)


def stage_params_all_experts(profile: ModelProfile, strategy: Strategy, stage: int = 0) -> float:
    """Parameters of the rank of ``stage`` with every routed expert counted (what data-parallel sharding divides;
    count): its stages' (:func:`rank_stages`)."""
    return sum(_one_stage_all_experts(profile, strategy, st) for st in rank_stages(strategy, stage))


def _one_stage_all_experts(profile: ModelProfile, strategy: Strategy, stage: int = 0) -> float:
    split = param_split(profile)
    t, p = strategy.tp, strategy.pp
    if uses_model_tp_plan(profile, strategy) and p == 1:
        return params_per_tp_rank(profile.params, profile.tensor_plan, t)  # type: ignore[arg-type]
    if p == 1:
        return (split.layers * split.per_block + split.embed + split.head) / t + split.other
    n = layers_per_stage(split.layers, p) * split.per_block / t
    if stage == 0:
        n += split.embed / t + split.other
    if stage == p - 1:
        n += (split.head or (split.embed if split.tied else 0)) / t
    return n
