"""The MoE part of a model file's profile: its MoE layers (probes/moe_layers.py) as the ``TransformerShape.moe``
the estimators price (expert parallelism, all-to-all, grouped GEMMs: estimators/moe.py, expert_parallel.py).

Which layers are sparse is read from the repeated block each MoE layer sits in and written as estimators/moe.py's
(``first_dense``, ``moe_every``) rule; a pattern that rule cannot state is priced as the same number of sparse layers
at the end, with a note. The shape's ``ffn`` becomes the per-layer mean width a token computes through
(estimators/moe.py ``mean_active_ffn``), as ``--arch`` and ``--hf`` profiles have it, so the same estimators apply.
Units: counts and widths (elements).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from optplan.estimators.moe import MoeShape, mean_active_ffn, moe_note
from optplan.estimators.profile import TransformerShape
from optplan.probes.model_errors import ModelFileError
from optplan.probes.model_shape import config_sources
from optplan.probes.moe_dispatch import describe, install_balanced_dispatch
from optplan.probes.moe_layers import MoeLayer, find_moe_layers, layer_pattern


def block_index(blocks: Sequence[nn.Module], module: nn.Module) -> int | None:
    """Index of the block that contains ``module`` (None: outside every block)."""
    for i, block in enumerate(blocks):
        if any(m is module for m in block.modules()):
            return i
    return None


def moe_shape(model: nn.Module, shape: TransformerShape | None, blocks: Sequence[nn.Module],
              layers: list[MoeLayer], display: str) -> tuple[TransformerShape | None, list[str]]:
    """(the shape with its MoE layers, notes). Without a readable transformer shape the MoE layers are profiled
    (balanced dispatch) but not described, and a note says expert parallelism cannot be planned."""
    if not layers:
        return shape, []
    first = layers[0]
    key = (first.experts, first.topk, first.moe_ffn, first.gated, first.shared_ffn)
    odd = next((m for m in layers if (m.experts, m.topk, m.moe_ffn, m.gated, m.shared_ffn) != key), None)
    if odd is not None:
        raise ModelFileError(display, f"the Mixture-of-Experts layers differ ({first.path}: {first.experts} experts, "
                             f"top-{first.topk}, width {first.moe_ffn}; {odd.path}: {odd.experts} experts, "
                             f"top-{odd.topk}, width {odd.moe_ffn}) and optplan prices one expert shape per model",
                             "give every MoE layer the same experts, or plan the model with --arch")
    if shape is None or not blocks:
        return shape, [f"{len(layers)} Mixture-of-Experts layers (top-{first.topk} of {first.experts}) profiled with a "
                       "balanced dispatch, but the model's transformer shape is not readable (hidden size, heads, "
                       "layers on model.config), so expert parallelism is not planned"]
    notes: list[str] = []
    indices = []
    for m in layers:
        index = block_index(blocks, model.get_submodule(m.path))
        if index is None:
            raise ModelFileError(display, f"the Mixture-of-Experts layer {m.path} is outside the repeated blocks, "
                                 "which is not a layout optplan knows", "put the MoE layers inside the "
                                 "transformer blocks, or plan the model with --arch")
        indices.append(index)
    count = len(set(indices))
    pattern = layer_pattern(indices, len(blocks))
    if pattern is None:
        pattern = (len(blocks) - count, 1)
        notes.append(f"the MoE layers are blocks {sorted(set(indices))}, a pattern first_dense/moe_every cannot state: "
                     f"priced as the last {count} of {len(blocks)} blocks")
    first_dense, every = pattern
    shared = first.shared_ffn / first.moe_ffn
    if shared != int(shared):
        notes.append(f"the shared experts' width {first.shared_ffn} is {shared:.2f} expert widths: priced as "
                     f"{round(shared)}")
    dense = first_dense > 0 or every > 1
    dense_ffn = (shape.ffn or 4 * shape.hidden) if dense else None
    moe = MoeShape(experts=first.experts, topk=first.topk, moe_ffn=first.moe_ffn, shared_experts=round(shared),
                   moe_every=every, first_dense=first_dense, dense_ffn=dense_ffn)
    ffn = round(mean_active_ffn(moe, dense_ffn or first.moe_ffn, shape.layers))
    return shape.model_copy(update={"moe": moe, "ffn": ffn, "gated": first.gated}), notes


def with_balanced_moe(model: nn.Module, display: str) -> list[MoeLayer]:
    """Install the balanced dispatch on ``model``'s MoE layers (probes/moe_dispatch.py); returns them."""
    layers = find_moe_layers(model, config_sources(model), display)
    install_balanced_dispatch(model, layers, display)
    return layers


def balanced_note(layers: list[MoeLayer], shape: TransformerShape | None) -> str:
    """The profile note that says the MoE layers ran the balanced dispatch (and the shape, when read)."""
    first = layers[0]
    stated = moe_note(shape.moe, shape.layers) + "; " if shape is not None and shape.moe is not None else ""
    return (f"{stated}the {len(layers)} MoE layers ({describe(first)}, ...) were profiled with a balanced "
            f"dispatch in place of the model's routing (every expert gets tokens x {first.topk} / {first.experts} "
            "token copies, batched matmuls: probes/moe_dispatch.py)")
