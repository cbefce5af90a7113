"""A balanced, data-independent dispatch for the MoE layers of a model being profiled.

Why: an MoE layer routes each token by its values (``nonzero``/``where`` over the router's choice, or
``torch._grouped_mm`` with offsets from a histogram, which also takes 16-bit inputs only), and the fake-tensor
profile has shapes, not values. For the profile each MoE layer (probes/moe_layers.py) runs instead what a dropless
grouped-GEMM dispatcher (Megatron-Core ``TEGroupedMLP`` with ``--moe-grouped-gemm``; transformers'
``grouped_mm_experts_forward``) computes under a **balanced router**: every expert receives
n = ceil(tokens · topk / experts) token copies (the load-balancing loss's target, Fedus et al. 2022,
arXiv 2101.03961 §2.2; estimators/moe.py ``DEFAULT_IMBALANCE`` = 1, stated, not measured). Per layer:

1. dispatch: the topk copies of each token (``repeat_interleave``, [T·k, h], what the permutation materialises),
   padded to E·n rows;
2. the experts: for 3-D expert weights one batched matmul per projection over [E, n, h] (``torch.bmm``: the
   FLOPs of a grouped GEMM over balanced groups, 2·T·k·h·F per matrix); for a list of expert modules each module
   on its n rows;
3. combine: each copy times its router weight, summed per token (transformers' deterministic combine).

Transformers 5 experts modules (``forward(hidden_states, top_k_index, top_k_weights)``) are replaced alone, so the
layer's own router (with its group-limited top-k, DeepSeek-V3) and shared experts run as written; other layers are
replaced whole: router logits (``F.linear`` on the router weight, softmax in fp32, top-k, renormalised weights),
the balanced experts, plus the shared experts (times the sigmoid of their gate when there is one, Qwen2-MoE). A
replaced layer takes one tensor [..., h] and returns one tensor of its shape.

FLOPs and activation bytes are therefore those of the tokens routed, never of every expert. Units: elements.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from optplan.probes.model_errors import ModelFileError
from optplan.probes.moe_layers import MoeLayer, join_path


def _dispatch(x: torch.Tensor, topk: int, experts: int) -> tuple[torch.Tensor, int]:
    """The topk copies of each row of ``x`` [T, h], padded to experts · n rows: ([experts · n, h], n)."""
    copies = x.repeat_interleave(topk, dim=0)
    rows = copies.shape[0]
    per_expert = -(-rows // experts)
    if per_expert * experts > rows:
        copies = torch.cat([copies, copies.new_zeros(per_expert * experts - rows, x.shape[1])])
    return copies, per_expert


def _combine(y: torch.Tensor, weights: torch.Tensor, tokens: int, topk: int, dtype: torch.dtype) -> torch.Tensor:
    rows = tokens * topk
    out = y[:rows] * weights.reshape(rows, 1).to(y.dtype)
    return out.view(tokens, topk, -1).sum(dim=1).to(dtype)


def _project(x: torch.Tensor, weight: torch.Tensor, hidden_in: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [E, n, in] times a 3-D expert weight stored [E, out, in] or [E, in, out]."""
    y = torch.bmm(x, weight.transpose(1, 2) if weight.shape[2] == hidden_in else weight)
    return y if bias is None else y + bias.unsqueeze(1)


def _fused_experts(mod: nn.Module, layer: MoeLayer, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The experts of 3-D weights on the balanced dispatch of ``x`` [T, h]; [T, h]."""
    tokens, h = x.shape
    copies, n = _dispatch(x, layer.topk, layer.experts)
    xs = copies.view(layer.experts, n, h)
    params = dict(mod.named_parameters(recurse=False))
    bias = {k[: -len("_bias")]: v for k, v in params.items() if k.endswith("_bias") and v.dim() == 2}
    mats = {k: v for k, v in params.items() if v.dim() == 3}
    down_name = next((k for k in mats if k in ("down_proj", "w2", "fc2")), list(mats)[-1])
    ups = [k for k in mats if k != down_name]
    act = getattr(mod, "act_fn", None) or (F.silu if layer.gated else F.gelu)
    if len(ups) == 1:
        up = _project(xs, mats[ups[0]], h, bias.get(ups[0]))
        if layer.gated:
            apply_gate = getattr(mod, "_apply_gate", None)
            if apply_gate is not None:
                mid = apply_gate(up)
            else:
                gate, lin = up.chunk(2, dim=-1)
                mid = act(gate) * lin
        else:
            mid = act(up)
    else:
        gate_name = next((k for k in ups if "gate" in k or k == "w1"), ups[0])
        lin_name = next(k for k in ups if k != gate_name)
        mid = act(_project(xs, mats[gate_name], h, bias.get(gate_name))) * \
            _project(xs, mats[lin_name], h, bias.get(lin_name))
    y = _project(mid, mats[down_name], mid.shape[-1], bias.get(down_name))
    return _combine(y.reshape(layer.experts * n, h), weights, tokens, layer.topk, x.dtype)


def _listed_experts(mods: nn.ModuleList, layer: MoeLayer, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A list of expert modules, each on its n rows of the balanced dispatch of ``x`` [T, h]; [T, h]."""
    tokens = x.shape[0]
    copies, n = _dispatch(x, layer.topk, layer.experts)
    outs = [expert(copies[e * n:(e + 1) * n]) for e, expert in enumerate(mods)]
    return _combine(torch.cat(outs), weights, tokens, layer.topk, x.dtype)


def _hf_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, *, layer: MoeLayer) -> torch.Tensor:
    return _fused_experts(self, layer, hidden_states, top_k_weights)


def _layer_forward(self: nn.Module, x: Any, *args: Any, layer: MoeLayer, display: str, **kwargs: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.shape[-1] != layer.hidden:
        raise ModelFileError(display, f"the Mixture-of-Experts layer {layer.path} was called with "
                             f"{type(x).__name__ if not isinstance(x, torch.Tensor) else tuple(x.shape)}; optplan "
                             f"profiles it with a balanced dispatch that takes one tensor [..., {layer.hidden}]",
                             "make the layer take the hidden states as its first argument, or plan with --arch")
    shape = x.shape
    x2 = x.reshape(-1, layer.hidden)
    router = self.get_parameter(layer.router_weight)
    prefix = layer.router_weight.rpartition(".")[0]
    bias = getattr(self.get_submodule(prefix) if prefix else self, "bias", None)
    logits = F.linear(x2, router, bias if isinstance(bias, torch.Tensor) and bias.shape == (layer.experts,) else None)
    probs = torch.softmax(logits.float(), dim=-1)
    top, _ = torch.topk(probs, layer.topk, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    experts = getattr(self, layer.experts_name)
    if layer.fused:
        out = _fused_experts(experts, layer, x2, top)
    else:
        out = _listed_experts(experts, layer, x2, top)
    for name in layer.shared_names:
        shared = getattr(self, name)(x2)
        if layer.shared_gate_weight is not None:
            shared = torch.sigmoid(F.linear(x2, self.get_parameter(layer.shared_gate_weight))) * shared
        out = out + shared
    return out.view(shape)


def install_balanced_dispatch(model: nn.Module, layers: list[MoeLayer], display: str) -> int:
    """Replace the forward of every MoE layer in ``layers`` that ``model`` still holds (a depth-cut copy holds
    fewer) by the balanced dispatch, on the instances; returns how many were replaced."""
    done = 0
    for layer in layers:
        try:
            owner = model.get_submodule(layer.path)
        except AttributeError:
            continue
        if layer.hf_interface:
            experts = owner.get_submodule(layer.experts_name)
            experts.forward = partial(_hf_experts_forward, experts, layer=layer)  # type: ignore[method-assign]
        else:
            owner.forward = partial(_layer_forward, owner, layer=layer, display=display)  # type: ignore[method-assign]
        done += 1
    return done


def describe(layer: MoeLayer) -> str:
    """Where the layer's parts are, for a note."""
    return f"{join_path(layer.path, layer.experts_name)} ({'3-D weights' if layer.fused else 'a module list'})"
