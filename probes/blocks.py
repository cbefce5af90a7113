"""The repeated block of a model (a transformer layer, a ResNet bottleneck...) and the depth-cut copies the profile
measures (probes/static.py: depth reduction).

The repeated block is the module class with the most instances among the direct children of ``nn.ModuleList`` /
``nn.Sequential`` containers (an MoE layer's list of experts excluded, probes/moe_layers.py); a container that holds
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

    def summary(self) -> RepeatedBlock:
        return RepeatedBlock(class_name=self.cls.__name__, count=len(self.blocks),
                             params_per_block=self.params_per_block, path=self.path)


def _own_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_repeated_block(model: nn.Module) -> BlockInfo | None:
    """The module class with the most instances among direct children of ModuleLists/Sequentials.

    Only classes with parameters count; at least 2 instances. Ties go to the class with more
    parameters. ``params_per_block`` is the mean over the instances (they are equal in transformers).
    An MoE layer's list of experts is not looked into (probes/moe_layers.py ``expert_lists``).
    """
    exclude = expert_lists(model)
    found: dict[type, dict[int, tuple[str, nn.Module]]] = {}
    for path, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and id(mod) not in exclude:
            for _, child in mod.named_children():
                found.setdefault(type(child), {}).setdefault(id(child), (path, child))
    best: tuple[int, int, type] | None = None
    for cls, insts in found.items():
        if len(insts) < 2:
            continue
        total = sum(_own_params(m) for _, m in insts.values())
        if total == 0:
            continue
        key = (len(insts), total)
        if best is None or key > best[:2]:
            best = (key[0], key[1], cls)
    if best is None:
        return None
    count, total, cls = best
    entries = list(found[cls].values())
    blocks = [m for _, m in entries]
    paths = {p for p, _ in entries}
    path = paths.pop() if len(paths) == 1 else None
    reducible, head = False, 0
    if path is not None:
        container = model.get_submodule(path) if path else model
        children = list(container.children())
        sizes = [_own_params(b) for b in blocks]
        head = next(i for i in range(len(sizes)) if all(s == sizes[-1] for s in sizes[i:]))
        reducible = (len(children) == len(blocks) and len(blocks) - head >= MIN_BLOCKS_FOR_REDUCTION
                     and all(type(c) is cls for c in children))
    return BlockInfo(cls=cls, blocks=blocks, params_per_block=round(total / count), path=path,
                     reducible=reducible, head=head if reducible else 0)


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
