"""The host time per eager kernel (estimators/eager_host.py ``HOST_KERNEL_S``, ``GpuEfficiency.host_kernel_s``)
fitted on the eager runs of models without a transformer shape measured on a GPU (``benchmarks/results/*``: the
campaign's MLP, ResNet-50 and timm ResNet-50 / ViT-B runs).

Why: those steps are paced by the host's kernel launches. The H200 visits measured a torchvision ResNet-50 at
micro-batch 32 at 17.4 ms a step under bf16 autocast and 19.2 ms in fp32, where the GPU's work takes 2-4 ms in
16-bit: a fixed host time per micro-batch (``host_microbatch_s``, fitted on Megatron transformer heads) predicted
3.5 ms (-80 %). The profile counts the kernels of each precision's step (autocast's casts included:
``ModelProfile.eager_step``), so the host time follows the model and the recipe.

The fit: the per-kernel time minimising the median |log(predicted / measured)| step time over those runs, on a 0.5 µs
grid in [0, 100] µs (searched at 2 µs, then refined), with each model left out in turn (the figure it then gets, fitted on the others, says how far the
mechanism carries to a model not in the fit). Prints every run before and after.

    python benchmarks/fit_eager_host.py

Last line: ``eager host kernel K µs over N runs (M models): step time median |error| A% -> B%, leave-one-model-out C%``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity_gpu_results import campaign_rows  # noqa: E402

from optplan.estimators.compute import transformer_dims  # noqa: E402
from optplan.estimators.eager_host import HOST_KERNEL_S, microbatch_kernels  # noqa: E402
from optplan.estimators.efficiency import efficiency_for  # noqa: E402
from optplan.estimators.timing import step_time  # noqa: E402

GRID = [round(0.5e-6 * i, 7) for i in range(201)]  # 0 .. 100 µs


def _model(row: object) -> str:
    return str(row.label).split(" ", 1)[0]


def _log_error(row: object, kernel_s: float | None) -> float:
    """log(predicted / measured) step time; ``kernel_s`` None: the fixed per-micro-batch constant (no counts)."""
    r = row
    profile = r.profile if kernel_s is not None else r.profile.model_copy(update={"eager_step": None})
    eff = efficiency_for(r.cluster.gpu)
    if kernel_s is not None:
        eff = eff.model_copy(update={"host_kernel_s": kernel_s})
    pred = step_time(profile, r.strategy, r.cluster, efficiency=eff, adam_impl=r.adam_impl).step_s
    return math.log(pred / r.measured_s)


def _median_pct(errors: list[float]) -> float:
    return 100.0 * statistics.median(abs(math.expm1(e)) for e in errors)


def _best(rows: list, grid: list[float]) -> float:
    """The grid value of least median |log error|: a 2 µs pass over the grid, then every grid value within 2 µs of
    its best (the error is one smooth valley in the per-kernel time)."""
    def score(k: float) -> tuple[float, float]:
        return statistics.median(abs(_log_error(r, k)) for r in rows), k

    coarse = min(grid[::4], key=score)
    return min((k for k in grid if abs(k - coarse) <= 2e-6 + 1e-12), key=score)


def eager_rows(rows: list | None = None) -> list:
    """Of ``rows`` (default: every GPU run, ``campaign_rows()``), those the per-kernel host time prices: eager (not
    compiled) steps of profiles without a transformer shape whose profile counted its kernels."""
    return [r for r in (campaign_rows() if rows is None else rows) if transformer_dims(r.profile) is None
            and not r.strategy.compile and microbatch_kernels(r.profile, r.strategy) is not None]


def fit(rows: list) -> tuple[float, float, float]:
    """(the fitted host time per kernel in s, the rows' step-time median |error| % with the fixed per-micro-batch
    constant, with the fitted time)."""
    best = _best(rows, GRID)
    return (best, _median_pct([_log_error(r, None) for r in rows]),
            _median_pct([_log_error(r, best) for r in rows]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.parse_args(argv)
    rows = eager_rows()
    if not rows:
        print("error: no eager GPU runs of a model without a transformer shape under benchmarks/results: run "
              "benchmarks/gpu_campaign.py on a GPU", file=sys.stderr)
        return 2
    best = _best(rows, GRID)
    models = sorted({_model(r) for r in rows})
    held_out: list[float] = []
    for name in models:
        rest = [r for r in rows if _model(r) != name]
        k = _best(rest, GRID) if rest else best
        held_out += [_log_error(r, k) for r in rows if _model(r) == name]
        print(f"  leave {name} out: {k * 1e6:.1f} µs")
    before = [_log_error(r, None) for r in rows]
    after = [_log_error(r, best) for r in rows]
    current = [_log_error(r, HOST_KERNEL_S) for r in rows]
    print(f"{'run':56s} {'kernels':>8s} {'meas ms':>8s} {'fixed':>8s} {'fitted':>8s}")
    for r, b, a in zip(rows, before, after, strict=True):
        print(f"{r.label[:56]:56s} {microbatch_kernels(r.profile, r.strategy):8.0f} {r.measured_s * 1e3:8.1f} "
              f"{100 * math.expm1(b):+7.1f}% {100 * math.expm1(a):+7.1f}%")
    print(f"in use (estimators/eager_host.py): {HOST_KERNEL_S * 1e6:.1f} µs -> median |error| {_median_pct(current):.1f}%")
    print(f"eager host kernel {best * 1e6:.1f} µs over {len(rows)} runs ({len(models)} models): step time median "
          f"|error| {_median_pct(before):.1f}% -> {_median_pct(after):.1f}%, leave-one-model-out "
          f"{_median_pct(held_out):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
