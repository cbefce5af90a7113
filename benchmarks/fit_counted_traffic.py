"""The counted-traffic constants of estimators/counted_traffic.py (``TRAFFIC_FACTOR``, ``NCHW_TRANSPOSE_PASSES``)
fitted on published, measured convolution-net training steps.

Fit set: timm's own train benchmark on one RTX 3090 (AMP fp16, 19 architectures, each in NCHW and channels-last:
38 runs, benchmarks/data/convnets_published.json); the NCHW-NHWC pairs set the transpose passes, the architectures'
spread the traffic factor. Check set, never fitted: NVIDIA DeepLearningExamples' ResNet-50 v1.5 on V100 (FP32, AMP)
and A100 (TF32, AMP), 1 and 8 GPUs: other GPUs, another framework's loop, fp32 and TF32.

The fit: the pair minimising the median |log(predicted / measured)| step time over the fit set, on a grid (factor
1.0-3.0 by 0.05, passes 0-2 by 0.25), each architecture also left out in turn (its two runs predicted by the pair
fitted on the others: how far the mechanism carries to a model not in the fit). Prints every run at the fitted
pair and at the constants in the module.

    python benchmarks/fit_counted_traffic.py

Needs timm (and on a CPU-only torch benchmarks/torchvision_ops/install.py); the 38 profiles are cached after the
first run (benchmarks/fidelity_convnets.py). Last line: ``counted traffic: factor F, NCHW passes P over N runs (M
architectures): step time median |error| A% (module constants B%), leave-one-architecture-out C%; check set D%``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity_convnets as fc  # noqa: E402

from optplan.estimators import counted_traffic  # noqa: E402
from optplan.estimators.estimate import estimate  # noqa: E402
from optplan.estimators.profile import ModelProfile  # noqa: E402

FACTORS = [round(1.0 + 0.05 * i, 2) for i in range(41)]
PASSES = [0.25 * i for i in range(9)]


@contextlib.contextmanager
def constants(factor: float, passes: float) -> Iterator[None]:
    with mock.patch.object(counted_traffic, "TRAFFIC_FACTOR", factor), \
            mock.patch.object(counted_traffic, "NCHW_TRANSPOSE_PASSES", passes):
        yield


def log_error(row: dict[str, Any], profile: ModelProfile) -> float:
    """log(predicted / measured) step time under the constants in force."""
    with contextlib.redirect_stderr(io.StringIO()):
        est = estimate(profile, fc.cluster_for(row), fc.plan(row))
    return math.log(est.time.step_s / float(row["step_s"]))


def median_pct(errors: list[float]) -> float:
    return 100.0 * statistics.median(abs(math.expm1(e)) for e in errors)


def error_table(rows: list[dict[str, Any]], profs: dict[Any, ModelProfile]) -> dict[tuple[float, float], dict[str, float]]:
    """log(predicted / measured) of every row at every grid pair."""
    table = {}
    for factor in FACTORS:
        for passes in PASSES:
            with constants(factor, passes):
                table[(factor, passes)] = {r["id"]: log_error(r, profs[fc.model_key(r)]) for r in rows}
    return table


def fit(table: dict[tuple[float, float], dict[str, float]], ids: list[str]) -> tuple[float, float]:
    """The grid pair of least median |log error| over the rows ``ids``."""
    return min(table, key=lambda pair: statistics.median(abs(table[pair][i]) for i in ids))


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    _, rows = fc.load()
    profs = fc.profiles(rows)
    fit_rows = [r for r in rows if r["source"].startswith("timm-")]
    check_rows = [r for r in rows if not r["source"].startswith("timm-")]
    table = error_table(rows, profs)
    factor, passes = fit(table, [r["id"] for r in fit_rows])
    fitted = table[(factor, passes)]
    module = {r["id"]: log_error(r, profs[fc.model_key(r)]) for r in rows}
    print(f"{'run':44s} {'fitted':>7s} {'module':>7s}   (predicted / measured - 1)")
    for r in rows:
        print(f"{r['id']:44s} {100 * math.expm1(fitted[r['id']]):+6.1f}% {100 * math.expm1(module[r['id']]):+6.1f}%")
    held: list[float] = []
    for arch in sorted({r["model"] for r in fit_rows}):
        f, p = fit(table, [r["id"] for r in fit_rows if r["model"] != arch])
        held += [table[(f, p)][r["id"]] for r in fit_rows if r["model"] == arch]
        print(f"  without {arch}: factor {f}, passes {p}")
    fit_err = median_pct([fitted[r["id"]] for r in fit_rows])
    module_err = median_pct([module[r["id"]] for r in fit_rows])
    check_err = median_pct([fitted[r["id"]] for r in check_rows])
    print(f"counted traffic: factor {factor}, NCHW passes {passes} over {len(fit_rows)} runs "
          f"({len({r['model'] for r in fit_rows})} architectures): step time median |error| {fit_err:.1f}% (module "
          f"constants {module_err:.1f}%), leave-one-architecture-out {median_pct(held):.1f}%; check set "
          f"{check_err:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
