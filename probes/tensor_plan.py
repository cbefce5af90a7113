"""Read a model's own tensor-parallel plan (a Hugging Face ``tp_plan``) and count what it splits.

transformers' ``PreTrainedModel.tp_plan`` merges ``config.base_model_tp_plan`` (prefixed with the base model's
attribute, e.g. ``model.``) with the head's class ``_tp_plan``: module-name patterns where ``*`` stands for a
layer index, mapped to a parallel style (estimators/tensor_plan.py). A module matches the longest
pattern that matches its full name (transformers' ``_get_parameter_tp_plan`` matches a parameter's module
name against the ``*``-generalised plan keys). Works on the meta device: only names and shapes are read.
"""

from __future__ import annotations

import re

from torch import nn

from optplan.estimators.tensor_plan import (
    EMBEDDING_STYLES,
    GATHERED_OUTPUT_STYLES,
    ROW_STYLES,
    SHARDING_STYLES,
    TensorPlan,
)


def model_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The plan the model reports (``model.tp_plan``, else ``model._tp_plan``), or None when it has none."""
    for attr in ("tp_plan", "_tp_plan"):
        try:
            plan = getattr(model, attr, None)
        except Exception:  # noqa: BLE001 - a property of a foreign model may raise anything
            plan = None
        if isinstance(plan, dict) and plan and all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in plan.items()):
            return dict(plan)
    return None


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")


def read_tensor_plan(model: nn.Module) -> TensorPlan | None:
    """The model's TensorPlan: its rules and the parameters they split (tied weights once); None when the model
    has no plan or the plan matches none of its modules (a plan written for another head or version)."""
    plan = model_tp_plan(model)
    if plan is None:
        return None
    rules = sorted(((key, style, _pattern(key)) for key, style in plan.items()), key=lambda r: -len(r[0]))
    seen: set[int] = set()
    sharded = replicated_grad = 0
    matched = False
    gathers = False
    for name, module in model.named_modules():
        rule = next(((key, style) for key, style, rx in rules if rx.match(name)), None)
        if rule is None:
            continue
        matched = True
        style = rule[1]
        gathers = gathers or (style in GATHERED_OUTPUT_STYLES and name == _output_head_name(model))
        if style not in SHARDING_STYLES:
            continue
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen or (pname == "bias" and style in ROW_STYLES):
                continue
            seen.add(id(param))
            sharded += param.numel()
            if style in EMBEDDING_STYLES and param.requires_grad:
                replicated_grad += param.numel()
    if not matched:
        return None
    return TensorPlan(styles=plan, sharded_params=sharded, gathers_logits=gathers, replicated_grad_params=replicated_grad,
                      source=f"transformers {type(model).__name__}.tp_plan")


def _output_head_name(model: nn.Module) -> str | None:
    """The qualified name of the model's output embeddings (``get_output_embeddings``), e.g. ``lm_head``."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, nn.Module):
        return None
    return next((name for name, module in model.named_modules() if module is head), None)
