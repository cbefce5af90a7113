"""Megatron-LM's ``--pipeline-model-parallel-layout`` string: written for a plan, parsed as Megatron parses it.

Grammar (Megatron-LM ``megatron/core/transformer/pipeline_parallel_layer_layout.py``,
``PipelineParallelLayerLayout.parse_str_to_list`` and ``validate_layer_layout``, MR 2795, Megatron-Core 0.13+):
virtual stages separated by ``|`` in model order; ``E`` embedding, ``t`` decoder (transformer) layer, ``m``
multi-token-prediction layer, ``L`` loss; ``x*n`` repeats a character and ``(...)*n`` a group; commas are
cosmetic. The first layer must be ``E`` and the last ``L``, each exactly once; the ``t`` count must equal
``--num-layers``; the stage count must be a multiple of ``--pipeline-model-parallel-size`` and gives the virtual
size (stages ÷ pp); the layout excludes ``--num-layers-per-virtual-pipeline-stage`` and
``--num-virtual-stages-per-pipeline-rank`` (``validate_args``).

The layout optplan writes is :func:`optplan.estimators.pipeline_layout.stage_layers` (the balanced split the
estimate priced), with runs of identical stages folded as ``(tt|)*30`` and long stages as ``t*10``, the way Megatron's own examples
are.
"""

from __future__ import annotations

import re

from optplan.estimators.pipeline_layout import stage_layers

_UNROLL = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))
"""Megatron's two unrolling patterns, applied in this order (``parse_str_to_list``)."""
LAYER_CHARS = frozenset("ELtm")


def megatron_layout(layers: int, pp: int, vpp: int = 1) -> str:
    """The ``--pipeline-model-parallel-layout`` value of the balanced split of ``layers`` over pp x vpp."""
    counts = stage_layers(layers, pp, vpp)
    last = len(counts) - 1
    stages = [("E" if k == 0 else "") + (f"t*{n}" if n > 2 else "t" * n) + ("L" if k == last else "")
              for k, n in enumerate(counts)]
    out: list[str] = []
    k = 0
    while k <= last:
        run = 1
        while k + run < last and stages[k + run] == stages[k]:
            run += 1
        if k == last:
            out.append(stages[k])
        elif run > 1:
            out.append(f"({stages[k]}|)*{run}")
        else:
            out.append(stages[k] + "|")
        k += run
    return "".join(out)


def parse_megatron_layout(text: str) -> list[str]:
    """The virtual stages of a layout string, each as its characters unrolled (``"Et|(tt|)*2tL"`` ->
    ``["Et", "tt", "tt", "tL"]``), as Megatron unrolls it. Raises ValueError naming an unknown character."""
    flat = text.replace(",", "")
    for pattern in _UNROLL:
        flat = pattern.sub(lambda m: m.group(1) * int(m.group(2)), flat)
    stages = flat.split("|")
    for stage in stages:
        bad = set(stage) - LAYER_CHARS
        if bad:
            raise ValueError(f"invalid layer character {sorted(bad)[0]!r} in the pipeline layout {text!r} "
                             "(Megatron knows E, t, m, L)")
    return stages


def layout_violation(stages: list[str], layers: int, pp: int) -> str | None:
    """The first of Megatron's layout rules that parsed ``stages`` break for ``layers`` decoder layers on ``pp``
    ranks (``validate_layer_layout``; this export writes no MTP layers), else None."""
    flat = "".join(stages)
    if len(stages) % pp:
        return (f"the pipeline layout has {len(stages)} stages, not a multiple of --pipeline-model-parallel-size "
                f"{pp}: fix --pipeline-model-parallel-layout")
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 or flat.count("L") != 1:
        return ("the pipeline layout must start with the embedding E and end with the loss L, each once: fix "
                "--pipeline-model-parallel-layout")
    if flat.count("t") != layers:
        return (f"the pipeline layout places {flat.count('t')} decoder layers, not the {layers} of --num-layers: fix "
                "--pipeline-model-parallel-layout")
    if "m" in flat:
        return "the pipeline layout places MTP layers the plan does not have: drop the m entries"
    return None
