"""LoRA adapters on a model, built with peft on the meta device, and what the estimators need to know of them.

``apply_lora`` injects peft's LoRA layers (``peft.inject_adapter_in_model``, the same ``lora.Linear`` a
``get_peft_model`` call builds) into the model as built by the model file, and freezes everything else, so
that the profile counts trainable and frozen parameters exactly and measures the activations a LoRA step
keeps (a frozen layer saves no input for a weight gradient; an adapted one saves what its adapter needs).
Default targets: the Linear (and transformers ``Conv1D``) layers inside the model's repeated blocks (the
attention and MLP projections), by their leaf names; without repeated blocks, peft's ``all-linear``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from optplan.estimators.finetune import LORA_DEFAULT_RANK, AdapterProfile, LoraRequest
from optplan.probes.model_errors import ModelFileError

__all__ = ["LORA_DEFAULT_RANK", "LoraRequest", "adapter_profile", "apply_lora", "is_linear", "resolve_targets"]

LORA_MARK = "lora_"
"""peft names every adapter parameter ``...lora_A.<adapter>.weight`` / ``lora_B``."""


def is_linear(module: nn.Module) -> bool:
    """nn.Linear or transformers' Conv1D (GPT-2's projections), which peft and bitsandbytes both handle."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _in_out(module: nn.Module) -> tuple[int, int]:
    """(in features, out features) of a linear layer (Conv1D keeps its weight as in x out; a quantised
    bitsandbytes Linear packs its weight, but keeps ``in_features``/``out_features``)."""
    if isinstance(getattr(module, "in_features", None), int) and isinstance(getattr(module, "out_features", None), int):
        return int(module.in_features), int(module.out_features)
    w = module.weight
    if isinstance(module, nn.Linear):
        return int(w.shape[1]), int(w.shape[0])
    return int(w.shape[0]), int(w.shape[1])


def linear_names(model: nn.Module) -> list[str]:
    """Dotted names of the model's linear layers (adapter layers excluded)."""
    return [n for n, m in model.named_modules() if is_linear(m) and LORA_MARK not in n]


def default_targets(model: nn.Module, blocks: list[nn.Module]) -> tuple[str, ...] | None:
    """Leaf names of the linear layers inside the repeated blocks (q_proj, k_proj, ... for a Llama), in order
    of appearance; None when there are no blocks (peft's ``all-linear`` then)."""
    names: dict[str, None] = {}
    for block in blocks:
        for name, mod in block.named_modules():
            if name and is_linear(mod):
                names.setdefault(name.rsplit(".", 1)[-1], None)
    return tuple(names) or None


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - a model's own accessor may not be implemented
        head = None
    return head if isinstance(head, nn.Module) else None


def resolve_targets(model: nn.Module, request: LoraRequest, blocks: list[nn.Module]) -> tuple[str, ...]:
    """The target names to use: the user's, else :func:`default_targets`, else every linear layer's leaf name
    but the output head's."""
    if request.targets:
        return request.targets
    found = default_targets(model, blocks)
    if found:
        return found
    head = _output_head(model)
    return tuple(dict.fromkeys(n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                               if is_linear(m) and m is not head))


def _names(name: str, target: str) -> bool:
    """Whether the dotted module ``name`` is what the target name ``target`` picks (peft's suffix match)."""
    return name == target or name.endswith("." + target)


def apply_lora(model: nn.Module, request: LoraRequest, display: str) -> nn.Module:
    """Inject LoRA adapters into ``model`` (in place) on the layers ``request.targets`` name (resolved:
    :func:`resolve_targets`) and freeze every other parameter; ModelFileError (one line with the fix) when peft
    is missing, the targets match nothing or the rank exceeds a target layer."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ModelFileError(display, "--finetune lora|qlora builds the adapters with peft, which is not installed",
                             "pip install peft") from None
    if request.rank < 1:
        raise ModelFileError(display, f"--lora-rank must be >= 1 (got {request.rank})", "pass --lora-rank 8 or 16")
    targets = request.targets
    head = _output_head(model)
    names = [n for n in linear_names(model) if model.get_submodule(n) is not head]
    chosen = [n for n in names if targets is None or any(_names(n, t) for t in targets)]
    available = sorted({n.rsplit(".", 1)[-1] for n in names})
    said = ", ".join(available[:12]) + (" ..." if len(available) > 12 else "")
    unmatched = [t for t in targets or () if not any(_names(n, t) for n in names)]
    head_name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
    on_head = [t for t in unmatched if head_name is not None and _names(head_name, t)]
    if on_head:
        raise ModelFileError(display, f"--lora-targets {','.join(on_head)} names the output head ({head_name}), which "
                             "LoRA plans leave as is (TRL refuses an adapter on it)",
                             f"leave it out; the other linear layers: {said or '(none)'}")
    if unmatched or not chosen:
        raise ModelFileError(display, f"--lora-targets {','.join(unmatched or targets or ('all-linear',))} match no "
                             "linear layer of the model", f"name some of its linear layers: {said or '(it has none)'}")
    for name in chosen:
        d_in, d_out = _in_out(model.get_submodule(name))
        if request.rank > min(d_in, d_out):
            raise ModelFileError(display, f"--lora-rank {request.rank} is larger than layer {name} ({d_in} -> {d_out} "
                                 f"features)", f"use --lora-rank {min(d_in, d_out)} or less, or leave that layer out "
                                 "of --lora-targets")
    config = LoraConfig(r=request.rank, lora_alpha=request.scale_alpha, lora_dropout=request.dropout,
                        bias="none",
                        target_modules=chosen)
    try:
        model = inject_adapter_in_model(config, model)
    except Exception as exc:  # noqa: BLE001 - peft's own message names the problem
        raise ModelFileError(display, f"peft could not add LoRA adapters ({type(exc).__name__}: {exc})",
                             "choose other --lora-targets (linear layers of the model)") from None
    for name, param in model.named_parameters():
        param.requires_grad_(LORA_MARK in name)
    return model


def adapter_profile(model: nn.Module, request: LoraRequest) -> AdapterProfile:
    """The :class:`AdapterProfile` of a model :func:`apply_lora` has adapted (counts from the whole model)."""
    adapted = [m for n, m in model.named_modules() if hasattr(m, "lora_A") and LORA_MARK not in n]
    adapter_params = sum(p.numel() for n, p in model.named_parameters() if LORA_MARK in n)
    head = _output_head(model)
    weights: list[tuple[int, int]] = []  # (elements, rows) of each quantisable weight
    for name, mod in model.named_modules():
        if is_linear(mod) and LORA_MARK not in name and mod is not head:
            d_in, d_out = _in_out(mod)
            weights.append((d_in * d_out, d_out))
    return AdapterProfile(
        rank=request.rank, alpha=request.scale_alpha, targets=tuple(request.targets or ()), adapted_modules=len(adapted),
        adapter_params=adapter_params, quantizable_params=sum(e for e, _ in weights),
        quantizable_rows=sum(r for _, r in weights), quantizable_tensors=len(weights),
        largest_quantizable_params=max((e for e, _ in weights), default=0), dropout=request.dropout)


def lora_request_from(args: Any) -> LoraRequest | None:
    """A LoraRequest from parsed child arguments (``--lora-rank``...), None without ``--lora``."""
    if not getattr(args, "lora", False):
        return None
    targets = tuple(t.strip() for t in (args.lora_targets or "").split(",") if t.strip())
    return LoraRequest(rank=args.lora_rank, alpha=args.lora_alpha, targets=targets or None,
                       dropout=getattr(args, "lora_dropout", 0.0) or 0.0)


def quantisation_missing(quant: str) -> str | None:
    """None when bitsandbytes imports here (or ``quant`` is ``none``); else a one-line note: the plan is priced
    from the formulas (estimators/finetune.py), which need no bitsandbytes, but the launch needs it."""
    if quant == "none":
        return None
    import logging

    logging.getLogger("bitsandbytes").addHandler(logging.NullHandler())
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken install raises anything, not only ImportError
        return (f"bitsandbytes cannot be imported here ({type(exc).__name__}): the {quant} base is priced from "
                "bitsandbytes' formats without it, but finetune.py loads the model with it: pip install "
                "bitsandbytes where you train")
    return None
