"""Fit the device memory outside the tensors (the caching allocator's margin, the CUDA context) from the GPU runs
committed under ``benchmarks/results/`` and write ``estimators/data/allocator_overhead.yaml``.

A training run's device memory is more than its live tensors (``torch.cuda.max_memory_allocated``):

* the caching allocator holds freed blocks and block remainders it cannot hand out
  (``torch.cuda.max_memory_reserved`` − ``max_memory_allocated``; PyTorch docs, "CUDA semantics: memory
  management"); the margin, as a fraction of the allocated peak, is what each run measured;
* the CUDA context, the kernels' modules and NCCL's buffers are outside the allocator: each run's ``non_torch_bytes``
  ((total − free) − ``memory_reserved``, probes/runtime_child.py).

Every ``fidelity.json`` that ``benchmarks/gpu_campaign.py`` wrote holds the runs (planner/results.py
``MeasuredCase``: the strategy that ran and what the probe measured). A run measured in several calls counts once
(the median of its measurements). Runs whose allocated peak is under ``MIN_ALLOCATED_BYTES`` are left out of the
margin: there the allocator's block granularity (2 MiB segments for small blocks, sizes rounded up to 512 bytes and
large blocks split at 1 MiB), not the program, sets the fraction.

Classes (what the measured runs show changes the margin, estimators/allocator_overhead.py):

* margin: steps that recompute every block (full activation checkpointing frees and re-allocates each layer's
  activations while the saved boundaries stay, a pattern that leaves split blocks) and steps that do not;
* context: a torch process alone (no process group) and a process with a NCCL process group (DeepSpeed at any
  world size, torch with more than one rank).

Each class records the median (what optplan predicts), the 10th and 90th percentiles and the run count.

    python benchmarks/fit_allocator_overhead.py [--write] [RESULTS_DIR ...]

Last line: ``allocator overhead: margin R% (recompute, N runs), M% (none, K runs); context A GiB (one process), B
GiB (process group) from T runs``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from optplan.estimators.allocator_overhead import context_class, margin_class
from optplan.planner.results import MeasuredCase, read_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT / "estimators" / "data" / "allocator_overhead.yaml"
GIB = 2**30
MIN_ALLOCATED_BYTES = GIB
"""Runs below this allocated peak are left out of the margin (module docstring)."""


@dataclass(frozen=True)
class Run:
    """One distinct measured run (a strategy of a model on a GPU): its measurements' medians."""

    key: str
    margin_class: str
    context_class: str
    allocated_bytes: float
    reserved_bytes: float
    non_torch_bytes: float | None

    @property
    def margin(self) -> float:
        return self.reserved_bytes / self.allocated_bytes - 1


def runs_from(folders: list[Path]) -> list[Run]:
    """Every distinct ok run with both peaks in the ``fidelity.json`` files under ``folders``."""
    seen: dict[str, list[MeasuredCase]] = {}
    for folder in folders:
        for path in sorted(folder.rglob("fidelity.json")):
            for case in read_results(path):
                r = case.comparison.result
                if not r.ok or not r.peak_allocated_bytes or not r.peak_reserved_bytes:
                    continue
                key = f"{case.gpu} {case.model} {case.comparison.probed.label()} x{r.world_size}"
                seen.setdefault(key, []).append(case)
    out = []
    for key, cases in sorted(seen.items()):
        probed = cases[0].comparison.probed
        results = [c.comparison.result for c in cases]
        non_torch = [r.non_torch_bytes for r in results if r.non_torch_bytes is not None]
        out.append(Run(
            key=key, margin_class=margin_class(probed),
            context_class=context_class(probed, world_size=results[0].world_size),
            allocated_bytes=statistics.median(r.peak_allocated_bytes or 0 for r in results),
            reserved_bytes=statistics.median(r.peak_reserved_bytes or 0 for r in results),
            non_torch_bytes=statistics.median(non_torch) if non_torch else None))
    return out


def _summary(values: list[float], digits: int) -> dict[str, Any]:
    """Median, 10th and 90th percentile (inclusive quantiles) and the count of ``values``."""
    if len(values) == 1:
        low = high = values[0]
    else:
        deciles = statistics.quantiles(values, n=10, method="inclusive")
        low, high = deciles[0], deciles[-1]
    return {"median": round(statistics.median(values), digits), "low": round(low, digits),
            "high": round(high, digits), "runs": len(values)}


def fit(runs: list[Run], source: str) -> dict[str, Any]:
    """The data file's content: per class, the margins' and context bytes' summaries."""
    margins: dict[str, list[float]] = {}
    contexts: dict[str, list[float]] = {}
    for run in runs:
        if run.allocated_bytes >= MIN_ALLOCATED_BYTES:
            margins.setdefault(run.margin_class, []).append(run.margin)
        if run.non_torch_bytes is not None:
            contexts.setdefault(run.context_class, []).append(run.non_torch_bytes)
    return {
        "margin": {name: _summary(v, 4) for name, v in sorted(margins.items())},
        "context_bytes": {name: {k: (int(x) if k != "runs" else x) for k, x in _summary(v, 0).items()}
                          for name, v in sorted(contexts.items())},
        "source": source,
    }


def source_of(runs: list[Run], folders: list[Path]) -> str:
    """The data file's ``source``: how many runs, on which GPUs, from which folders."""
    gpus = sorted({r.key.split()[0] for r in runs})
    names = sorted({str(p.resolve().relative_to(ROOT)) if p.resolve().is_relative_to(ROOT) else str(p)
                    for p in folders})
    return f"{len(runs)} distinct runs on {', '.join(gpus)} under {', '.join(names)}"


def render(doc: dict[str, Any]) -> str:
    header = ("# Device memory outside the tensors, measured (read by optplan.estimators.allocator_overhead).\n"
              "# Written by benchmarks/fit_allocator_overhead.py --write from the GPU runs committed under\n"
              "# benchmarks/results/ (do not edit by hand: tests/benchmarks/test_allocator_overhead_fit.py checks it).\n"
              "# margin: max_memory_reserved / max_memory_allocated - 1 per run (fraction of the allocated peak);\n"
              "# context_bytes: (total - free) - memory_reserved per run (bytes). median / 10th / 90th percentile.\n")
    return header + yaml.safe_dump(doc, sort_keys=False, width=118)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", type=Path, default=[RESULTS], help="results folders (default: all)")
    parser.add_argument("--write", action="store_true", help=f"write {DATA.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    runs = runs_from(args.folders)
    if not runs:
        print("no GPU run with both memory peaks under " + ", ".join(map(str, args.folders)), file=sys.stderr)
        return 1
    print(f"{'run':64} {'class':10} {'alloc GiB':>9} {'reserved':>9} {'margin':>7} {'context GiB':>11}")
    for r in runs:
        ctx = f"{r.non_torch_bytes / GIB:.2f}" if r.non_torch_bytes is not None else "-"
        note = "" if r.allocated_bytes >= MIN_ALLOCATED_BYTES else "  (margin not fitted: under 1 GiB allocated)"
        print(f"{r.key:64} {r.margin_class:10} {r.allocated_bytes / GIB:9.2f} {r.reserved_bytes / GIB:9.2f} "
              f"{100 * r.margin:6.1f}% {ctx:>11}{note}")
    doc = fit(runs, source=source_of(runs, args.folders))
    if args.write:
        DATA.write_text(render(doc), encoding="utf-8")
        print(f"wrote {DATA.relative_to(ROOT)}")
    m, c = doc["margin"], doc["context_bytes"]

    def margin_text(name: str) -> str:
        return f"{100 * m[name]['median']:.1f}% ({name}, {m[name]['runs']} runs)" if name in m else f"- ({name})"

    def context_text(name: str, label: str) -> str:
        return f"{c[name]['median'] / GIB:.2f} GiB ({label})" if name in c else f"- ({label})"

    print(f"allocator overhead: margin {margin_text('recompute')}, {margin_text('none')}; context "
          f"{context_text('one_process', 'one process')}, {context_text('process_group', 'process group')} "
          f"from {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
