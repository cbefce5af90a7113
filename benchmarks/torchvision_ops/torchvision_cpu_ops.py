"""Lets torchvision's Python parts import where its compiled operators cannot load (a CPU-only torch).

Why: the torchvision wheel that matches torch 2.13 on PyPI is built for CUDA; its ``_C`` extension links
``libtorch_cuda.so``, which the CPU build of torch lacks. ``torchvision.extension`` then skips the extension, and
``torchvision._meta_registrations`` fails on ``register_fake("torchvision::nms")`` (the operator was never defined),
so ``import torchvision`` raises, and with it ``import timm`` and every transformers model (transformers imports
torchvision whenever it is installed). timm's models call no torchvision operator; they import
``torchvision.ops.misc.FrozenBatchNorm2d`` and the transforms.

What: importing this module puts a finder at the front of ``sys.meta_path`` that waits for the first
``import torchvision``; then it loads torchvision's ``_C`` extension if it can (a machine where it works: nothing else
happens) and otherwise defines the two operator schemas torchvision registers fakes for (from
torchvision/csrc/ops/nms.cpp) with no kernel, so the import succeeds and a call of those operators still fails.
Nothing is imported before that (no start-up cost). ``python benchmarks/torchvision_ops/install.py`` writes the
``.pth`` file that imports this module in every interpreter of an environment (.ci/run does it).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path
from typing import Any

_DEFINED: list[Any] = []
"""The torch.library.Library holding the fallback definitions (they last as long as it does)."""


def define_missing_torchvision_ops() -> None:
    """Load torchvision's operators, or define the schemas its import needs where they cannot load."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import torch

    library = next(Path(next(iter(spec.submodule_search_locations))).glob("_C*.so"), None)
    if library is not None:
        try:
            torch.ops.load_library(str(library))
            return
        except OSError:
            pass
    if _DEFINED or hasattr(torch.ops.torchvision, "nms"):
        return
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _DEFINED.append(lib)


class _FirstTorchvisionImport(importlib.abc.MetaPathFinder):
    """Runs :func:`define_missing_torchvision_ops` once, just before torchvision is first imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            define_missing_torchvision_ops()
        return None  # the usual finders import it


if "torchvision" not in sys.modules and not any(isinstance(f, _FirstTorchvisionImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _FirstTorchvisionImport())
