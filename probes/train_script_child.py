"""A generated train.py run by the probe child (``python -m optplan.probes.runtime_child --train-script PATH``):
the user's own training loop, with every CPU step from the second on under optplan's live-tensor tracker, so that
its ``measurements.json`` carries a memory figure ``optplan calibrate`` can take (CPU memory has no allocator
counters). On a GPU the hooks do nothing: ``max_memory_allocated`` is the figure.

Imports: the standard library, torch and :mod:`optplan.probes.probe_tracker` (a bare training environment).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import torch

from optplan.probes.dropout import gpu_dropout
from optplan.probes.probe_tracker import tracked_call

EXIT_FAILED = 3
"""The exit code when the script cannot be imported (as the probe child's for a failure)."""


class ScriptHooks:
    """Hooks for a generated train.py run by the probe (``--train-script``): on CPU every step from the second
    on runs under the live-tensor tracker, and the largest peak goes into its measurements.json as
    ``peak_allocated_bytes`` (what a GPU's ``max_memory_allocated`` says of the whole run): the maximum over
    steps and ranks. Each collective settles before the step goes on (:class:`ProbeTracker`), so a buffer gloo's
    worker thread holds is freed in program order, not by chance."""

    TRACKED_STEP = 1
    """The first step index tracked (DDP rebuilds its gradient buckets in the second step)."""

    def __init__(self, cap_bytes: int | None) -> None:
        self.cap_bytes = cap_bytes
        self.peak: int | None = None
        self.by_category: dict[str, int] = {}
        self.tracked_steps = 0

    def run_step(self, trainer: Any, index: int, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        if trainer.device_type != "cpu" or index < self.TRACKED_STEP:
            return step()
        trainer.track_ddp_buckets = True
        loss, tracker = tracked_call(trainer, step, self.cap_bytes, [])
        peak, = trainer.reduce_max([float(tracker.peak_bytes)])
        self.tracked_steps += 1
        if self.peak is None or int(peak) > self.peak:
            self.peak = int(peak)
            self.by_category = {k: int(v) for k, v in tracker.peak_by_category.items() if v > 0}
        return loss

    def measured(self) -> dict[str, Any]:
        if self.peak is None:
            return {}
        return {"peak_allocated_bytes": self.peak, "peak_by_category_bytes": self.by_category,
                "memory_source": f"optplan's live-tensor tracker (CPU): peak live tensor bytes of steps 2 to "
                                 f"{self.tracked_steps + 1}, max over steps and ranks"}


def run_train_script(path: str, cap_bytes: int | None, argv: list[str]) -> int:
    """Import a generated train.py and run its ``main`` with :class:`ScriptHooks` (its exit code)."""
    spec = importlib.util.spec_from_file_location("optplan_train_script", path)
    if spec is None or spec.loader is None:
        print(f"error: {path} cannot be imported as a Python module", file=sys.stderr)
        return EXIT_FAILED
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    with gpu_dropout():  # CUDA's 1-byte dropout masks, as the profile prices them (probes/dropout.py)
        return int(module.main(argv, ScriptHooks(cap_bytes)))


def train_script_args(argv: list[str]) -> tuple[str, int | None, list[str]] | None:
    """``--train-script PATH [--memory-cap-bytes N] [-- train.py's arguments]``, or None for a probe spec."""
    if not argv or argv[0] != "--train-script":
        return None
    parser = argparse.ArgumentParser(prog="python -m optplan.probes.runtime_child --train-script",
                                     description="Run a generated train.py with the CPU live-tensor tracker.")
    parser.add_argument("--train-script", required=True, help="the generated train.py")
    parser.add_argument("--memory-cap-bytes", type=int, default=None, help="live tensor bytes that count as oom")
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    mine = argv[:argv.index("--")] if "--" in argv else argv
    args = parser.parse_args(mine)
    return args.train_script, args.memory_cap_bytes, rest


__all__ = ["ScriptHooks", "run_train_script", "train_script_args"]
