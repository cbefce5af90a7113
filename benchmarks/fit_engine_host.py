"""DeepSpeed's host multiplier (estimators/efficiency.py ``EngineEfficiency.host_multiplier``) fitted on the DeepSpeed
runs measured on a GPU (``benchmarks/results/*``: the campaign's fidelity and grid runs, each the same model and
strategy as a torch run beside it).

Why a multiplier: the GPU visits measured DeepSpeed's engine host-paced where torch's is not. The fourth H200 visit's
traces (``2026-11-28-H200-visit4/c2b/trace.json``) of the Llama-3 1B layout at micro-batch 2 (bf16) count 18,779
host operators per step under ``deepspeed.initialize`` (ZeRO-1) against 9,164 for torch alone, kernels busy 91 vs
74 ms of a 159 vs 90 ms step; ZeRO-1/2 at world size 1 measured 18-56 % slower than torch-engine time predictions
(engine copies of every gradient and parameter tensor, the overflow and norm checks' synchronisations). The
multiplier scales the GPU's fitted eager host times (per layer pass, micro-batch and step; timing.py) for the
engine; the p-norm host/device blend keeps it hidden where the device work is longer (the launched GPT-2 plan at
micro-batch 64 x 8 measured DeepSpeed and torch alike against their predictions: 1.24x and 1.21x).

The fit: the multiplier minimising the median |log(predicted / measured)| step time over every DeepSpeed run,
searched on a 0.05 grid in [1, 8]; ZeRO-3 runs count too (one measured: its module hooks are host work of the
same kind). ``--write`` stores it in estimators/data/efficiency.yaml with its source line.

    python benchmarks/fit_engine_host.py [--write]

Last line: ``deepspeed host multiplier K over N runs: step time median |error| A% -> B%``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity_gpu_results import campaign_rows  # noqa: E402
from fit_time import DATA_FILE as TABLE  # noqa: E402
from fit_time import DEEPSPEED_EAGER_STATED, write_table  # noqa: E402

from optplan.estimators.efficiency import engine_efficiency  # noqa: E402
from optplan.estimators.timing import step_time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GRID = [round(1.0 + 0.05 * i, 2) for i in range(141)]  # 1.00 .. 8.00


def _errors(rows: list, multiplier: float) -> list[float]:
    engine = engine_efficiency("deepspeed").model_copy(update={"host_multiplier": multiplier})
    return [math.log(step_time(r.profile, r.strategy, r.cluster, engine=engine, adam_impl=r.adam_impl).step_s
                     / r.measured_s) for r in rows]


def _pct(log_errors: list[float]) -> float:
    return 100.0 * statistics.median(abs(math.expm1(e)) for e in log_errors)


def write(multiplier: float, runs: int, before: float, after: float) -> None:
    """Set DeepSpeed's ``host_multiplier`` in the table, its source line saying how it was fitted (fit_time.py's
    writer: the file's header kept, the rest as that fit writes it)."""
    raw = yaml.safe_load(TABLE.read_text(encoding="utf-8"))
    deepspeed = raw["engines"]["deepspeed"]
    deepspeed.pop("source", None)  # written last again, after the multiplier
    deepspeed["host_multiplier"] = multiplier
    deepspeed["source"] = (f"stated for the eager constants: {DEEPSPEED_EAGER_STATED}; host_multiplier fitted by "
                           f"benchmarks/fit_engine_host.py on {runs} DeepSpeed runs on H200 (benchmarks/results): step "
                           f"time median |error| {before:.1f}% -> {after:.1f}%")
    write_table(raw, TABLE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--write", action="store_true", help="store the fitted multiplier in efficiency.yaml")
    args = parser.parse_args(argv)
    rows = [r for r in campaign_rows() if r.strategy.engine == "deepspeed"]
    if not rows:
        print("error: no DeepSpeed runs measured on a GPU under benchmarks/results: run benchmarks/gpu_campaign.py",
              file=sys.stderr)
        return 2
    current = engine_efficiency("deepspeed").host_multiplier
    scores = {k: statistics.median(abs(e) for e in _errors(rows, k)) for k in GRID}
    best = min(scores, key=scores.__getitem__)
    unit, fitted = _errors(rows, 1.0), _errors(rows, best)
    print(f"{'run':<48} {'measured ms':>11} {'x1 ms':>8} {'fit ms':>8}")
    for r, e1, ef in zip(rows, unit, fitted, strict=True):
        print(f"{r.label[:48]:<48} {r.measured_s * 1e3:11.1f} {r.measured_s * math.exp(e1) * 1e3:8.1f} "
              f"{r.measured_s * math.exp(ef) * 1e3:8.1f}")
    print(f"in the table now: {current}")
    if args.write:
        write(best, len(rows), _pct(unit), _pct(fitted))
        print(f"wrote host_multiplier {best} to {TABLE.relative_to(ROOT)}")
    print(f"deepspeed host multiplier {best} over {len(rows)} runs: step time median |error| {_pct(unit):.1f}% -> "
          f"{_pct(fitted):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
