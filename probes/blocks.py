"""The repeated block of a model (a transformer layer, a ResNet bottleneck...) and the depth-cut copies the profile
measures (probes/static.py: depth reduction).

The repeated block is the module class with the most instances among the direct children of ``nn.ModuleList`` /
``nn.Sequential`` / ``nn.ModuleDict`` containers (an MoE layer's list of experts excluded, probes/moe_layers.py),
less the classes that are parts of another candidate's instances (:func:`_parts`: the ``nn.Linear`` of a layer's
``nn.Sequential`` MLP outnumber the layers, yet the layer is the block); a container that holds
only such blocks, at least :data:`MIN_BLOCKS_FOR_REDUCTION` of one size after a leading run of other sizes (an MoE
model's dense first layers), can be cut to fewer blocks and measured at two depths. Units: parameter counts.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass

import torch.nn as nn

from optplan.estimators.profile import RepeatedBlock
from optplan.probes.moe_layers import expert_lists
from optplan.probes.trainloop import find_blocks

MIN_BLOCKS_FOR_REDUCTION = 3


@dataclass
class BlockInfo:
    """The repeated block and, when depth reduction applies, the container that holds all of them."""

    cls: type
    blocks: list[nn.Module]
    params_per_block: int
    path: str | None
    reducible: bool
    head: int = 0
    """leading blocks of another size than the rest (an MoE model's dense first layers): depth reduction keeps
    them and varies the rest"""
    containers: tuple[tuple[str, int], ...] = ()
    """(path, blocks held) of each container holding the blocks, when there are several (T5's encoder and decoder
    stacks of one ``T5Block`` class)"""
    other_stacks: tuple[tuple[str, int, int], ...] = ()
    """(class name, count, parameters) of other repeated block classes held apart from these blocks (BART's
    ``BartEncoderLayer`` beside the ``BartDecoderLayer`` blocks): not checkpointed nor wrapped as blocks"""

    def summary(self) -> RepeatedBlock:
        return RepeatedBlock(class_name=self.cls.__name__, count=len(self.blocks),
                             params_per_block=self.params_per_block, path=self.path)


def _own_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


PART_SHARE = 0.8
"""A candidate class is a part of another when at least this share of its instances lie inside the other's
(:func:`_parts`): torchvision's MobileNet and EfficientNet have a stem and a head convolution outside their blocks."""


def _holds_blocks(mod: nn.Module) -> bool:
    """A container whose children may be blocks: a ModuleList or Sequential, or a ModuleDict of several modules of
    one class (DenseNet's layers; not nanoGPT's ``transformer`` dict of named parts, nor peft's one-adapter
    ``lora_A``/``lora_B`` dicts)."""
    if isinstance(mod, (nn.ModuleList, nn.Sequential)):
        return True
    return isinstance(mod, nn.ModuleDict) and len(mod) > 1 and len({type(m) for m in mod.values()}) == 1


def _parts(candidates: dict[type, dict[int, tuple[str, nn.Module]]]) -> set[type]:
    """The candidate classes that are parts of another candidate's instances, not blocks of their own: most of
    their instances (:data:`PART_SHARE`) lie inside the other class's, held there in containers with other modules
    beside them (the Linears of a layer's ``nn.Sequential(Linear, GELU, Linear)`` MLP, the conv-norm-activation
    units of an inverted residual), where they outnumber the layers. Blocks inside a hierarchy's stages are held in
    containers of their own class only (Swin's and ConvNeXt's ``stage.blocks``) and stay candidates, the unit timm
    and torchvision checkpoint."""
    held_with_others: set[int] = set()  # ids of modules held in a container beside a module of another class
    owners: dict[type, set[int]] = {}  # class -> ids of every module inside its instances
    for cls, insts in candidates.items():
        inside: set[int] = set()
        for _, block in insts.values():
            for mod in block.modules():
                if mod is block:
                    continue
                inside.add(id(mod))
                if isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
                    kids = list(mod.children())
                    if len({type(k) for k in kids}) > 1:
                        held_with_others.update(id(k) for k in kids)
        owners[cls] = inside
    parts: set[type] = set()
    for cls, insts in candidates.items():
        for outer, inside in owners.items():
            if outer is cls:
                continue
            within = [i for i in insts if i in inside]
            if len(within) >= PART_SHARE * len(insts) and all(i in held_with_others for i in within):
                parts.add(cls)
                break
    return parts


def find_repeated_block(model: nn.Module) -> BlockInfo | None:
    """The module class with the most instances among direct children of ModuleLists/Sequentials/ModuleDicts,
    less the parts of other candidates (:func:`_parts`).

    Only classes with parameters count; at least 2 instances. Ties go to the class with more
    parameters. ``params_per_block`` is the mean over the instances (they are equal in transformers).
    An MoE layer's list of experts is not looked into (probes/moe_layers.py ``expert_lists``).
    """
    exclude = expert_lists(model)
    found: dict[type, dict[int, tuple[str, nn.Module]]] = {}
    for path, mod in model.named_modules():
        if _holds_blocks(mod) and id(mod) not in exclude:
            for _, child in mod.named_children():
                found.setdefault(type(child), {}).setdefault(id(child), (path, child))
    candidates = {cls: insts for cls, insts in found.items()
                  if len(insts) >= 2 and sum(_own_params(m) for _, m in insts.values()) > 0}
    parts = _parts(candidates)
    best: tuple[int, int, type] | None = None
    for cls, insts in candidates.items():
        if cls in parts:
            continue
        total = sum(_own_params(m) for _, m in insts.values())
        key = (len(insts), total)
        if best is None or key > best[:2]:
            best = (key[0], key[1], cls)
    if best is None:
        return None
    count, total, cls = best
    if _is_leaf(cls, found[cls].values()):
        composite = _composite_block(model, [m for _, m in found[cls].values()])
        if composite is not None:
            return composite
    entries = list(found[cls].values())
    blocks = [m for _, m in entries]
    held = {p: sum(1 for q, _ in entries if q == p) for p in dict.fromkeys(p for p, _ in entries)}
    paths = set(held)
    path = paths.pop() if len(paths) == 1 else None
    others = _other_stacks(candidates, parts, cls, total)
    reducible, head = False, 0
    if path is not None:
        container = model.get_submodule(path) if path else model
        children = list(container.children())
        sizes = [_own_params(b) for b in blocks]
        head = next(i for i in range(len(sizes)) if all(s == sizes[-1] for s in sizes[i:]))
        reducible = (len(children) == len(blocks) and len(blocks) - head >= MIN_BLOCKS_FOR_REDUCTION
                     and all(type(c) is cls for c in children))
    return BlockInfo(cls=cls, blocks=blocks, params_per_block=round(total / count), path=path,
                     reducible=reducible, head=head if reducible else 0,
                     containers=tuple(held.items()) if len(held) > 1 else (), other_stacks=others)


def _is_leaf(cls: type, entries: object) -> bool:
    """Whether ``cls``'s instances hold no modules (an ``nn.Conv2d``, an ``nn.Linear``): one operator, which a
    checkpoint cannot spare anything of (its own input is what it saves)."""
    return all(next(m.children(), None) is None for _, m in entries)  # type: ignore[attr-defined]


CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def outermost(model: nn.Module, cls: type) -> list[nn.Module]:
    """The instances of ``cls`` in ``model`` not inside another one: what train.py wraps (trainloop.find_blocks, which
    finds them by class name)."""
    return find_blocks(model, cls.__name__)


def _composite_block(model: nn.Module, leaves: list[nn.Module]) -> BlockInfo | None:
    """When the most repeated class in containers is a single layer (a UNet's ``nn.Conv2d`` inside its
    double-convolution units' ``nn.Sequential``), the module class with parameters, at least 2 outermost instances
    anywhere in the model (attributes too) and :data:`PART_SHARE` of those layers inside them: the unit a checkpoint
    spares the intermediates of (the UNet's ``DoubleConv``); the most instances win, then the most parameters.
    None when no class holds them (the layers stay the block)."""
    leaf_ids = {id(m) for m in leaves}
    best: tuple[int, int, type, list[nn.Module]] | None = None
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        if cls is type(model) or issubclass(cls, CONTAINERS):
            continue
        instances = outermost(model, cls)
        if len(instances) < 2 or any(next(m.children(), None) is None for m in instances):
            continue
        inside = {id(sub) for m in instances for sub in m.modules()}
        if sum(1 for i in leaf_ids if i in inside) < PART_SHARE * len(leaf_ids):
            continue
        total = sum(_own_params(m) for m in instances)
        if total > 0 and (best is None or (len(instances), total) > best[:2]):
            best = (len(instances), total, cls, instances)
    if best is None:
        return None
    count, total, cls, instances = best
    return BlockInfo(cls=cls, blocks=instances, params_per_block=round(total / count), path=None, reducible=False)


OTHER_STACK_SHARE = 0.1
"""Another repeated class counts as a second stack (:func:`_other_stacks`) when its instances hold at least this
share of the blocks' parameters."""


def _other_stacks(candidates: dict[type, dict[int, tuple[str, nn.Module]]], parts: set[type], cls: type,
                  total: int) -> tuple[tuple[str, int, int], ...]:
    """Repeated classes besides ``cls`` that are neither parts (:func:`_parts`) nor inside or around its instances,
    with at least :data:`OTHER_STACK_SHARE` of its ``total`` parameters: an encoder-decoder's other stack."""
    mine = candidates[cls]
    inside_mine = {id(m) for _, b in mine.values() for m in b.modules()}
    out = []
    for other, insts in candidates.items():
        if other is cls or other in parts:
            continue
        modules = [m for _, m in insts.values()]
        if any(id(m) in inside_mine for m in modules):
            continue
        around = {id(sub) for m in modules for sub in m.modules()}
        if any(key in around for key in mine):
            continue
        params = sum(_own_params(m) for m in modules)
        if params >= OTHER_STACK_SHARE * total:
            out.append((other.__name__, len(insts), params))
    return tuple(sorted(out, key=lambda o: -o[2]))


def _cut(container: nn.Module, keep: int) -> nn.Module:
    short = copy.copy(container)  # same class and attributes, own child table
    short._modules = OrderedDict(list(container._modules.items())[:keep])  # type: ignore[assignment]
    return short


def truncated_copy(model: nn.Module, path: str, keep: int) -> nn.Module:
    """A deep copy of ``model`` whose container at ``path`` keeps only its first ``keep`` children
    (``path`` "" is the model itself)."""
    container = model.get_submodule(path)
    if not path:
        return copy.deepcopy(_cut(container, keep))
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    parent._modules[attr] = _cut(container, keep)
    try:
        return copy.deepcopy(model)
    finally:
        parent._modules[attr] = container



def stack_notes(block: BlockInfo) -> list[str]:
    """Notes for a model whose blocks are not one stack: the same class in several containers (T5's encoder and
    decoder, a ResNet's stages: profiled at full depth, as depth reduction cuts one container), or another repeated
    class beside them (not checkpointed nor
    wrapped: the plans' checkpointing and FSDP units are the blocks' class only)."""
    name = block.cls.__name__
    notes = []
    if block.containers:
        where = ", ".join(f"{path or 'the model'} {n}" for path, n in block.containers)
        notes.append(f"the {len(block.blocks)} {name} blocks sit in {len(block.containers)} containers ({where}); "
                     "depth reduction cuts a single container, so they were profiled at full depth")
    for other, count, params in block.other_stacks:
        notes.append(f"a second stack of {count} x {other} ({params / 1e6:,.1f} M parameters) sits beside the "
                     f"{len(block.blocks)} x {name} blocks: checkpointing, FSDP units and exported train.py's "
                     f"block_class cover {name} only, so {other}'s activations are priced as kept (not "
                     "recomputed) and its parameters sit in the root unit")
    return notes
