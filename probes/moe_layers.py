"""Mixture-of-Experts layers of a model file, found by their structure on the meta model.

An MoE layer (Shazeer et al. 2017, arXiv 1701.06538; Mixtral, Jiang et al. 2024, arXiv 2401.04088 §2.1;
DeepSeekMoE, Dai et al. 2024, arXiv 2401.06066 §3) is, in every implementation this reads, a module that holds

* the **experts**, either an ``nn.ModuleList`` of E >= 2 equal MLP modules (two or three weight matrices each) whose
  attribute name contains ``expert`` (the Mixtral reference code, torchtitan's loop, most hand-written MoEs; the
  name keeps a stack of dense MLP blocks from being taken for experts) or one module whose weights are 3-D tensors
  with the E experts as their leading dimension (transformers 5's ``@use_experts_implementation`` classes:
  ``gate_up_proj`` [E, 2F, h], ``down_proj`` [E, h, F]; Megatron-Core's grouped MLP);
* a **router**: a weight of shape [E, h] beside the experts (an ``nn.Linear(h, E)`` or a raw parameter, at any
  depth inside the layer but outside the experts);
* optionally **shared experts** (DeepSeekMoE, Qwen2-MoE): a child whose name contains ``shared`` with MLP weights,
  its width a multiple of the expert width, and a shared-expert gate ([1, h]).

Read from it: experts E, the expert width F (the narrowest non-h side of an expert's matrices), gated or not
(m = expert elements / (h·F): 3 for SwiGLU, 2 for a GeLU MLP), the shared width, and top-k (an attribute of the
layer, its router or experts — :data:`TOPK_NAMES` — else the model config's :data:`CONFIG_TOPK_NAMES`). Which
layers are sparse comes from the repeated block each MoE layer sits in (:func:`layer_pattern`).

Units: counts and widths (elements).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from optplan.probes.adapters import LORA_MARK
from optplan.probes.model_errors import ModelFileError
from optplan.probes.model_shape import read_int

TOPK_NAMES = ("top_k", "topk", "num_experts_per_tok", "n_activated_experts", "moe_topk", "router_topk",
              "num_selected_experts", "k")
"""Attributes of an MoE layer (or its router / experts module) that hold top-k, in the order read."""
CONFIG_TOPK_NAMES = ("num_experts_per_tok", "moe_topk", "moe_router_topk", "router_topk", "n_activated_experts",
                     "top_k")
"""Model config keys that hold top-k (transformers, Megatron, DeepSeek's reference code)."""
HF_EXPERTS_ARGS = ("hidden_states", "top_k_index", "top_k_weights")
"""The forward arguments of transformers 5's experts modules: those are replaced alone, the layer's own router and
shared experts run as written."""
UP_NAMES = ("gate_up_proj", "up_proj", "gate_proj", "w1", "w3", "w13", "fc1")
DOWN_NAMES = ("down_proj", "w2", "fc2")


@dataclass(frozen=True)
class MoeLayer:
    """One MoE layer of a model: where its parts are and their sizes."""

    path: str
    """the module holding experts and router ("" for the model itself)"""
    experts_name: str
    """the experts' attribute on that module"""
    router_weight: str
    """the router weight's name relative to the layer (``gate.weight``)"""
    experts: int
    topk: int
    hidden: int
    moe_ffn: int
    gated: bool
    fused: bool
    """experts as 3-D tensors (one module) rather than a list of modules"""
    hf_interface: bool
    """the experts module takes (hidden_states, top_k_index, top_k_weights)"""
    shared_names: tuple[str, ...] = ()
    shared_ffn: int = 0
    shared_gate_weight: str | None = None


def join_path(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _matrices(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """The module's weight matrices, LoRA adapters (probes/adapters.py, ``lora_``) left out."""
    return [(n, tuple(p.shape)) for n, p in module.named_parameters() if p.dim() >= 2 and LORA_MARK not in n]


def _is_mlp(module: nn.Module) -> bool:
    """Two or three weight matrices and no module list inside: an expert MLP, not a transformer block."""
    mats = _matrices(module)
    return 2 <= len(mats) <= 3 and all(len(s) == 2 for _, s in mats) and not any(
        isinstance(m, nn.ModuleList) for n, m in module.named_modules() if LORA_MARK not in n)


def _expert_list(module: nn.Module) -> bool:
    kids = list(module.children())
    if not isinstance(module, nn.ModuleList) or len(kids) < 2 or len({type(k) for k in kids}) != 1:
        return False
    return len({sum(p.numel() for p in k.parameters()) for k in kids}) == 1 and _is_mlp(kids[0])


def _fused_experts(module: nn.Module) -> int | None:
    """E when the module's own weights are all 3-D with one leading dimension E >= 2 (two or more of them)."""
    mats = [p for p in module.parameters(recurse=False) if p.dim() >= 2]
    leading = {p.shape[0] for p in mats}
    if len(mats) >= 2 and all(p.dim() == 3 for p in mats) and len(leading) == 1 and min(leading) >= 2:
        return int(leading.pop())
    return None


def _width(mats: Iterable[tuple[int, ...]], hidden: int) -> tuple[int, bool] | None:
    """(expert width F, gated) from one expert's matrices, each with one side h: F is the narrowest other side and
    m = elements / (h·F) is 3 (gated) or 2."""
    sides = []
    total = 0
    for shape in mats:
        if hidden not in shape:
            return None
        rest = list(shape)
        rest.remove(hidden)
        sides.append(rest[0])
        total += shape[0] * shape[1]
    if not sides:
        return None
    width = min(sides)
    m = total / (hidden * width)
    if abs(m - round(m)) > 1e-9 or round(m) not in (2, 3):
        return None
    return width, round(m) == 3


def _takes_hf_args(module: nn.Module) -> bool:
    try:
        params = list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return tuple(params[:3]) == HF_EXPERTS_ARGS


def find_moe_layers(model: nn.Module, config_sources: list[Any], display: str) -> list[MoeLayer]:
    """Every MoE layer of ``model`` (a meta model), in module order; ModelFileError naming the layer when experts
    are found without a router or a top-k, or the experts' matrices are not an MLP's."""
    found: list[MoeLayer] = []
    for path, module in model.named_modules():
        for name, child in module.named_children():
            fused = _fused_experts(child)
            if fused is None and not ("expert" in name.lower() and _expert_list(child)):  # as expert_lists
                continue
            found.append(_describe(path, module, name, child, fused, config_sources, display))
    return found


def _describe(path: str, layer: nn.Module, name: str, experts: nn.Module, fused: int | None,
              config_sources: list[Any], display: str) -> MoeLayer:
    """The MoE layer whose experts are ``layer.<name>``."""
    where = join_path(path, name) or "the model"
    count = fused if fused is not None else len(experts)
    shared = [(n, c) for n, c in layer.named_children() if "shared" in n.lower() and n != name]
    skip = {name, *(n for n, _ in shared)}
    router = next(((join_path(cn, pn), p.shape[1]) for cn, c in [("", layer)] + list(layer.named_children())
                   if cn not in skip
                   for pn, p in c.named_parameters(recurse=bool(cn))
                   if p.dim() == 2 and p.shape[0] == count), None)
    if router is None:
        raise ModelFileError(
            display, f"the Mixture-of-Experts layer {path or 'at the top'} holds {count} experts ({where}) but no "
            f"router: optplan looks beside the experts for a weight of shape [{count}, hidden] (an nn.Linear(hidden, "
            f"{count}) or a parameter) to know which tokens reach them",
            "give the layer its router as a submodule or parameter of the module that holds the experts, or plan "
            "the model from its shape with --arch ...,experts=E,topk=K,moe_ffn=F")
    router_weight, hidden = router
    if fused is not None:
        shapes = [tuple(p.shape[1:]) for p in experts.parameters(recurse=False) if p.dim() == 3]
    else:
        shapes = [s for _, s in _matrices(next(iter(experts.children())))]
    width = _width(shapes, hidden)
    if width is None:
        raise ModelFileError(
            display, f"the experts of {where} hold matrices {shapes}, which are not a two- or three-matrix MLP on "
            f"the router's width {hidden}, so optplan cannot tell the expert width",
            "write each expert as an MLP (hidden -> F -> hidden, optionally gated), or plan the model with --arch "
            "...,experts=E,topk=K,moe_ffn=F")
    ffn, gated = width
    parts = router_weight.split(".")[:-1]
    router_modules = [layer.get_submodule(".".join(parts[:i])) for i in range(len(parts), 0, -1)]
    topk = read_int([layer, *router_modules, experts], TOPK_NAMES) or read_int(config_sources, CONFIG_TOPK_NAMES)
    if topk is None:
        raise ModelFileError(
            display, f"the Mixture-of-Experts layer {path or 'at the top'} ({count} experts) does not say how many "
            f"experts each token goes to (no {', '.join(TOPK_NAMES[:3])} attribute on it or its router, no "
            f"{CONFIG_TOPK_NAMES[0]} in the config)", "set self.top_k = K on the layer, or pass --arch")
    if topk > count:
        raise ModelFileError(display, f"the Mixture-of-Experts layer {path or 'at the top'} routes each token to "
                             f"{topk} experts but holds {count}", "set top-k to at most the number of experts")
    shared_ffn, shared_names, shared_gate = 0, [], None
    for sname, sub in shared:
        mats = [s for _, s in _matrices(sub)]
        if len(mats) == 1 and mats[0] == (1, hidden):
            shared_gate = join_path(sname, next(n for n, p in sub.named_parameters() if p.dim() == 2))
            continue
        sw = _width(mats, hidden)
        if sw is None or sw[1] != gated:
            raise ModelFileError(display, f"the shared expert {join_path(path, sname)} holds matrices {mats}, which "
                                 "optplan cannot read as an MLP like the routed experts",
                                 "write it as the routed experts' MLP at a multiple of their width, or use --arch")
        shared_ffn += sw[0]
        shared_names.append(sname)
    return MoeLayer(path=path, experts_name=name, router_weight=router_weight, experts=count, topk=topk,
                    hidden=hidden, moe_ffn=ffn, gated=gated, fused=fused is not None,
                    hf_interface=fused is not None and _takes_hf_args(experts), shared_names=tuple(shared_names),
                    shared_ffn=shared_ffn, shared_gate_weight=shared_gate if shared_names else None)


def expert_lists(model: nn.Module) -> frozenset[int]:
    """ids of the module lists that hold experts (they must not be taken for the repeated block: 8 experts in each of
    32 layers outnumber the layers)."""
    return frozenset(id(child) for module in model.modules() for name, child in module.named_children()
                     if "expert" in name.lower() and _expert_list(child))


def layer_pattern(indices: list[int], layers: int) -> tuple[int, int] | None:
    """(first_dense, moe_every) whose sparse layers — index i >= first_dense with (i - first_dense + 1) a multiple
    of moe_every, estimators/moe.py's rule — are exactly ``indices`` (0-based, of ``layers``), or None."""
    want = sorted(set(indices))
    if not want:
        return None
    for every in range(1, layers + 1):
        first = want[0] - every + 1
        if first < 0:
            break
        if [i for i in range(layers) if i >= first and (i - first + 1) % every == 0] == want:
            return first, every
    return None
