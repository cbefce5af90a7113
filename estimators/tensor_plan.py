"""Tensor parallelism by a model's own plan: what a Hugging Face ``tp_plan`` splits and what it replicates.

Hugging Face models carry a tensor-parallel plan (``config.base_model_tp_plan`` plus the head's ``_tp_plan``,
merged by ``PreTrainedModel.tp_plan``): module-name patterns (``model.layers.*.self_attn.q_proj``) mapped to
a parallel style. ``from_pretrained(tp_plan="auto")`` or ``distributed_config=DistributedConfig(tp_size=...)``
(transformers 5, ``transformers/distributed/tensor_parallel.py``) applies it with DTensor: Megatron's layout
for the blocks (Shoeybi et al. 2019, arXiv 1909.08053 §3: column-parallel q/k/v and MLP-in projections,
row-parallel attention-out and MLP-out, one all-reduce after each in forward and in backward), but

- no sequence parallelism (``DistributedConfig.enable_sequence_parallel``: "Reserved ... not wired up yet"), so
  the norms' and residuals' activations stay whole on every rank (Korthikanti et al. 2022, arXiv 2205.05198,
  Table 2 "tensor parallel" row, not the "+ sequence parallel" one);
- the output head is column-parallel with its output gathered (``colwise_gather_output``/``colwise_rep``:
  ``ColwiseParallel(output_layouts=Replicate())``): every rank holds the whole logits and computes the whole
  cross-entropy, where Megatron keeps 1/tp of them (vocab-parallel cross-entropy);
- biases of row-parallel layers and every module without a rule (norms) are replicated.

The profile (``probes/tensor_plan.py``) reads the plan of the model as built and counts the parameters it
splits; this module turns that into per-rank counts. Units: parameter counts (elements).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from optplan.estimators.profile import ModelProfile
    from optplan.estimators.strategy import Strategy

SHARDING_STYLES = frozenset({
    "colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep",
    "packed_colwise", "packed_rowwise", "embedding_rowwise", "embedding_colwise",
})
"""Styles that split their module's weight over the tensor-parallel ranks (transformers 5
``ALL_PARALLEL_STYLES``; transformers 4.5x spelt the vocab-parallel embedding ``rowwise`` on an Embedding).
Every other style (``replicate``, ``sequence_parallel``, ``replicated_with_grad_allreduce``, expert styles)
and any unknown name counts as replicated: more bytes, never fewer."""
ROW_STYLES = frozenset({"rowwise", "rowwise_split_input", "rowwise_rep", "packed_rowwise"})
"""Row-parallel styles: the weight is split along its input dimension and the bias (added after the
all-reduce) stays whole on every rank (``RowwiseParallel``)."""
GATHERED_OUTPUT_STYLES = frozenset({"colwise_gather_output", "colwise_rep"})
"""Column-parallel styles whose output is gathered to every rank (``output_layouts=Replicate()``)."""
SEQUENCE_PARALLEL_STYLES = frozenset({"sequence_parallel"})


class TensorPlan(BaseModel):
    """A model's own tensor-parallel plan, as the profile found it on the model as built."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    styles: dict[str, str] = Field(description="module-name pattern -> parallel style, as the model reports it")
    sharded_params: int = Field(ge=0, description="parameters the plan splits over the tensor-parallel ranks "
                                                  "(count; tied weights once)")
    gathers_logits: bool = Field(description="the output head's result is gathered to every rank (whole logits "
                                             "and cross-entropy on each)")
    replicated_grad_params: int = Field(default=0, ge=0, description="split parameters whose gradient stays whole "
                                                                     "on every rank (vocab-parallel embeddings: "
                                                                     "DTensor gives them a Replicate() gradient)")
    source: str = Field(description="where the plan came from, e.g. 'transformers LlamaForCausalLM.tp_plan'")

    @property
    def sequence_parallel(self) -> bool:
        """True when the plan shards norms' activations along the sequence (a ``sequence_parallel`` rule)."""
        return any(style in SEQUENCE_PARALLEL_STYLES for style in self.styles.values())


def params_per_tp_rank(params: float, plan: TensorPlan, tp: int) -> float:
    """Parameters one tensor-parallel rank holds under ``plan``: the split ones over ``tp``, the rest whole
    (count). Source: the styles' placements (module docstring; ``transformers/distributed/tensor_parallel.py``)."""
    sharded = min(float(plan.sharded_params), params)
    return sharded / tp + (params - sharded)


EMBEDDING_STYLES = frozenset({"embedding_rowwise", "embedding_colwise"})
"""Vocab/hidden-parallel embeddings: their weight is split but the gradient DTensor computes for it is replicated
(measured on CPU under torchrun, benchmarks/fidelity_tp_cpu.py: a (V, h) gradient beside a (V/tp, h) weight), kept
as ``.grad`` unless FSDP reduce-scatters it."""


def replicated_grad_bytes_per_rank(profile: ModelProfile, strategy: Strategy, grad_bytes: float) -> float:
    """Gradient bytes a tensor-parallel rank holds beyond its share of the split parameters: the replicated
    gradients of vocab-parallel embeddings, (1 - 1/tp) of their whole size, when no FSDP shards them (bytes)."""
    if not uses_model_tp_plan(profile, strategy) or strategy.fsdp != "none":
        return 0.0
    plan = profile.tensor_plan
    assert plan is not None
    return plan.replicated_grad_params * (1 - 1 / strategy.tp) * grad_bytes


def uses_model_tp_plan(profile: ModelProfile, strategy: Strategy) -> bool:
    """True when ``strategy`` splits ``profile`` by the model's own plan: tensor parallelism on the torch engine
    of a model that has one (Megatron-LM and DeepSpeed use Megatron's layout, Shoeybi et al. 2019)."""
    return strategy.tp > 1 and strategy.engine == "torch" and profile.tensor_plan is not None


def gathers_logits(profile: ModelProfile, strategy: Strategy) -> bool:
    """True when every tensor-parallel rank holds the whole logits (the model's plan gathers its head output),
    instead of Megatron's 1/tp vocabulary slice."""
    return uses_model_tp_plan(profile, strategy) and profile.tensor_plan.gathers_logits  # type: ignore[union-attr]
