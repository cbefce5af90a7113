"""The host time per eager kernel (estimators/eager_host.py ``HOST_KERNEL_S``, ``GpuEfficiency.host_kernel_s``) and
per fully checkpointed block (``CHECKPOINT_BLOCK_HOST_S``), fitted on the eager torch-engine runs measured on a GPU
(``benchmarks/results/*``: the campaign's GPT-2 small, Llama-3 1B layout, MLP, ResNet-50, timm ResNet-50 / ViT-B).

Why: small steps are paced by the host's kernel launches. The H200 visits measured a torchvision ResNet-50 at
micro-batch 32 at 17.4 ms a step under bf16 autocast and 19.2 ms in fp32, where the GPU's work takes 2-4 ms in
16-bit, and GPT-2 small at micro-batch 4 at 23.6 ms where the per-layer-pass constants fitted on Megatron (vTrain,
A100) priced 38 ms. The profile counts the kernels of each precision's step (autocast's casts included:
``ModelProfile.eager_step``), so the host time follows the model and the recipe; torch.utils.checkpoint adds host
work of its own per block (its hooks, the RNG state), beyond the kernels it replays.

The fit: coordinate descent on the median |log(predicted / measured)| step time: the per-block time on the fully
checkpointed runs (0.05 ms grid in [0, 2] ms), then the per-kernel time on all (0.5 µs grid in [0, 100] µs, searched
at 2 µs, then refined), twice; with each model left out in turn (the figures it then gets, fitted on the others, say
how far the mechanism carries to a model not in the fit). "fixed" prices the host with the constants a profile
without counts gets (per layer pass and micro-batch). Prints every run before and after.

    python benchmarks/fit_eager_host.py

Last line: ``eager host kernel K µs, checkpointed block C ms over N runs (M models): step time median |error| A% ->
B%, leave-one-model-out D%``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity_gpu_results import campaign_rows  # noqa: E402

from optplan.estimators.eager_host import CHECKPOINT_BLOCK_HOST_S, HOST_KERNEL_S, microbatch_kernels  # noqa: E402
from optplan.estimators.efficiency import efficiency_for  # noqa: E402
from optplan.estimators.timing import step_time  # noqa: E402

GRID = [round(0.5e-6 * i, 7) for i in range(201)]  # 0 .. 100 µs
CHECKPOINT_GRID = [round(0.05e-3 * i, 6) for i in range(41)]  # 0 .. 2 ms


def _model(row: object) -> str:
    return str(row.label).split(" ", 1)[0]


def _log_error(row: object, kernel_s: float | None, checkpoint_s: float = 0.0) -> float:
    """log(predicted / measured) step time; ``kernel_s`` None: the fixed constants (no counts)."""
    r = row
    profile = r.profile if kernel_s is not None else r.profile.model_copy(update={"eager_step": None})
    eff = efficiency_for(r.cluster.gpu)
    if kernel_s is not None:
        eff = eff.model_copy(update={"host_kernel_s": kernel_s, "host_checkpoint_block_s": checkpoint_s})
    pred = step_time(profile, r.strategy, r.cluster, efficiency=eff, adam_impl=r.adam_impl).step_s
    return math.log(pred / r.measured_s)


def _median_pct(errors: list[float]) -> float:
    return 100.0 * statistics.median(abs(math.expm1(e)) for e in errors)


def _best(rows: list, grid: list[float], checkpoint_s: float = 0.0) -> float:
    """The per-kernel grid value of least median |log error| at ``checkpoint_s``: a 2 µs pass over the grid, then
    every grid value within 2 µs of its best (the error is one smooth valley in the per-kernel time)."""
    def score(k: float) -> tuple[float, float]:
        return statistics.median(abs(_log_error(r, k, checkpoint_s)) for r in rows), k

    coarse = min(grid[::4], key=score)
    return min((k for k in grid if abs(k - coarse) <= 2e-6 + 1e-12), key=score)


def _best_checkpoint(rows: list, kernel_s: float) -> float:
    """The per-block checkpointing host time of least median |log error| over the fully checkpointed ``rows`` (0 when
    there are none)."""
    full = [r for r in rows if r.strategy.checkpointing == "full"]
    if not full:
        return 0.0
    return min(CHECKPOINT_GRID, key=lambda c: (statistics.median(abs(_log_error(r, kernel_s, c)) for r in full), c))


def fit_both(rows: list) -> tuple[float, float]:
    """(host time per kernel, host time full checkpointing adds per block) in s: coordinate descent, the block time
    on the checkpointed runs, then the kernel time on all, twice (a third pass changed neither on the visits' runs)."""
    kernel_s, checkpoint_s = HOST_KERNEL_S, 0.0
    for _ in range(2):
        checkpoint_s = _best_checkpoint(rows, kernel_s)
        kernel_s = _best(rows, GRID, checkpoint_s)
    return kernel_s, checkpoint_s


def eager_rows(rows: list | None = None) -> list:
    """Of ``rows`` (default: every GPU run, ``campaign_rows()``), those the per-kernel host time prices alone: eager
    (not compiled) torch-engine steps whose profile counted its kernels, transformer or not (DeepSpeed's steps add
    its engine's own host work on top: benchmarks/fit_engine_host.py fits that multiplier over this figure)."""
    return [r for r in (campaign_rows() if rows is None else rows) if r.strategy.engine == "torch"
            and not r.strategy.compile and microbatch_kernels(r.profile, r.strategy) is not None]


def fit(rows: list) -> tuple[float, float, float, float]:
    """(the fitted host time per kernel in s, per checkpointed block in s, the rows' step-time median |error| % with
    the fixed constants, with the fitted times)."""
    kernel_s, checkpoint_s = fit_both(rows)
    return (kernel_s, checkpoint_s, _median_pct([_log_error(r, None) for r in rows]),
            _median_pct([_log_error(r, kernel_s, checkpoint_s) for r in rows]))


def host_speed_line(rows: list, errors: list[float]) -> str:
    """Whether the host's speed where each run was timed (``host_op_s``, probes/host_speed.py: recorded by probes
    since the thirty-second session) explains the fitted errors: Pearson's r of log(predicted / measured) against
    log(host_op_s) over the runs that carry it (a fit on one host speed leaves the faster hosts' runs predicted slow:
    r < 0), and the spread of host_op_s across them."""
    pairs = [(math.log(float(r.extra["host_op_s"])), e) for r, e in zip(rows, errors, strict=True)
             if float(r.extra.get("host_op_s") or 0) > 0]
    if len(pairs) < 3:
        return (f"host speed: {len(pairs)} of {len(rows)} runs carry host_op_s (too few to say whether it explains "
                "the errors; GPU runs measured from now on carry it)")
    xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
    sy = math.sqrt(sum((y - my) ** 2 for y in ys))
    r = sum((x - mx) * (y - my) for x, y in pairs) / (sx * sy) if sx and sy else 0.0
    ops = sorted(math.exp(x) * 1e6 for x in xs)
    return (f"host speed: {len(pairs)} of {len(rows)} runs carry host_op_s ({ops[0]:.2f}-{ops[-1]:.2f} µs, median "
            f"{statistics.median(ops):.2f}); log error vs log host_op_s: Pearson r = {r:+.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.parse_args(argv)
    rows = eager_rows()
    if not rows:
        print("error: no eager torch-engine GPU runs under benchmarks/results: run benchmarks/gpu_campaign.py on a GPU",
              file=sys.stderr)
        return 2
    best, block = fit_both(rows)
    models = sorted({_model(r) for r in rows})
    held_out: list[float] = []
    for name in models:
        rest = [r for r in rows if _model(r) != name]
        k, c = fit_both(rest) if rest else (best, block)
        held_out += [_log_error(r, k, c) for r in rows if _model(r) == name]
        print(f"  leave {name} out: {k * 1e6:.1f} µs a kernel, {c * 1e3:.2f} ms a checkpointed block")
    before = [_log_error(r, None) for r in rows]
    after = [_log_error(r, best, block) for r in rows]
    current = [_log_error(r, HOST_KERNEL_S, CHECKPOINT_BLOCK_HOST_S) for r in rows]
    print(f"{'run':56s} {'kernels':>8s} {'meas ms':>8s} {'fixed':>8s} {'fitted':>8s}")
    for r, b, a in zip(rows, before, after, strict=True):
        print(f"{r.label[:56]:56s} {microbatch_kernels(r.profile, r.strategy):8.0f} {r.measured_s * 1e3:8.1f} "
              f"{100 * math.expm1(b):+7.1f}% {100 * math.expm1(a):+7.1f}%")
    print(host_speed_line(rows, after))
    print(f"in use (estimators/eager_host.py): {HOST_KERNEL_S * 1e6:.1f} µs, {CHECKPOINT_BLOCK_HOST_S * 1e3:.2f} ms -> "
          f"median |error| {_median_pct(current):.1f}%")
    print(f"eager host kernel {best * 1e6:.1f} µs, checkpointed block {block * 1e3:.2f} ms over {len(rows)} runs "
          f"({len(models)} models): step time median |error| {_median_pct(before):.1f}% -> {_median_pct(after):.1f}%, "
          f"leave-one-model-out {_median_pct(held_out):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
