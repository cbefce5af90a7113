"""Pipeline layouts: how many decoder layers each virtual pipeline stage and each pipeline rank holds.

Megatron-LM splits L layers evenly over the pp·vpp virtual stages when they divide
(``--num-layers-per-virtual-pipeline-stage``); any other split is a custom layout
(``--pipeline-model-parallel-layout``, Megatron-Core MR 2795 "Flexible Asymmetric Virtual Pipeline Parallelism
with Custom Pipeline Layout", June 2025, ``megatron/core/transformer/pipeline_parallel_layer_layout.py``). A
layout lists the virtual stages in model order; virtual stage k runs on pipeline rank k mod pp as that rank's
chunk k div pp (``PipelineParallelLayerLayout.__init__``). This is how Megatron runs DeepSeek-V3's 61 layers on
pp 8 x vpp 4 ("Et|(tt|)*30mL", the Megatron MoE model zoo) or Qwen3-235B's 94 on pp 8 x vpp 4.

optplan's balanced layout (this module; planner/export/megatron_layout.py writes it as Megatron's string): every
virtual stage gets base = L div C decoder layers (C = pp·vpp) and the r = L mod C extra layers go to the virtual
stages 1..r, so the first (which also holds the embedding) and the last (which holds the output layer and the
loss) keep the base count while r < C − 1. With fewer layers than virtual stages (C = L + 1 or L + 2, as
Megatron's ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split`` give: Qwen3-235B's
94 layers on pp 32 x vpp 3 in the Megatron MoE model zoo) the first and the last stage hold only the embedding and
only the loss. Rank j then holds vpp·base plus ⌊r/pp⌋ or ⌈r/pp⌉ extra layers, at most
⌈L/pp⌉ in all: the busiest rank that timing and memory price (``parallel.layers_per_stage``). Counts are layers
(dimensionless).
"""

from __future__ import annotations


def is_even(layers: int, pp: int, vpp: int = 1) -> bool:
    """True when the ``layers`` split evenly over ``pp`` ranks x ``vpp`` virtual stages (Megatron's plain flags
    express it; otherwise the plan needs a custom layout)."""
    return layers % (pp * vpp) == 0


MAX_EXTRA_STAGES = 2
"""Virtual stages beyond the layer count a layout may have: one holding only the embedding, one only the loss."""


def stage_layers(layers: int, pp: int, vpp: int = 1) -> tuple[int, ...]:
    """Decoder layers of each of the pp·vpp virtual stages, in model order (the balanced layout of the module
    docstring). Raises ValueError when the stages outnumber the layers by more than :data:`MAX_EXTRA_STAGES`."""
    stages = pp * vpp
    if pp < 1 or vpp < 1 or layers < 1 or layers + MAX_EXTRA_STAGES < stages:
        raise ValueError(f"{layers} layers cannot fill pp {pp} x vpp {vpp} = {stages} virtual stages")
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if 1 <= k <= extra else 0) for k in range(stages))


def rank_layers(layers: int, pp: int, vpp: int = 1) -> tuple[int, ...]:
    """Decoder layers each pipeline rank holds over its ``vpp`` chunks (virtual stage k on rank k mod pp)."""
    counts = [0] * pp
    for k, n in enumerate(stage_layers(layers, pp, vpp)):
        counts[k % pp] += n
    return tuple(counts)


def uneven_split_note(layers: int, pp: int, vpp: int = 1, engine: str = "megatron") -> str | None:
    """A caveat for a split pp (x vpp) does not divide: what each rank holds, how it is priced and how ``engine``
    runs it; None when even."""
    if pp <= 1 or is_even(layers, pp, vpp):
        return None
    per_rank = rank_layers(layers, pp, vpp)
    stages = f"pp {pp} x vpp {vpp} = {pp * vpp} virtual stages" if vpp > 1 else f"pp {pp} stages"
    return (f"pipeline: {layers} layers do not split evenly over {stages}; ranks hold {min(per_rank)}-{max(per_rank)} "
            "layers and the step is priced at the busiest; " + (
                "torch.distributed.pipelining takes the split as stage modules (torchtitan's generate_split_points "
                "gives the extra layers to the middle stages)" if engine == "torch" else
                "Megatron-LM runs it with --pipeline-model-parallel-layout (Megatron-Core 0.13+; the Megatron export "
                "writes it)"))
