"""Today's model against every GPU run committed under ``benchmarks/results/`` (issue 16: what comes back from
a GPU keeps judging the work after the visit).

``benchmarks/gpu_campaign.py`` writes each measured run as a ``MeasuredCase`` (planner/results.py) in
``fidelity.json`` and ``grid.json``: the strategy that ran, on which GPU, and what the probe measured
(``torch.cuda.max_memory_allocated``, the median step time). This script profiles the same models here on
the meta device (the campaign's own definitions: ``fidelity_suite.models("cuda")`` and the grid's GPT-2 and
Llama-3 1B layout at sequence 1,024), predicts each run again with the current estimators (memory.py's
allocated bytes on ``cuda``; ``estimate``'s uncalibrated step time on the GPU it ran on) and prints the errors.
A run measured in several calls counts once (the last call's, which timed more steps). The profile is
today's (its hash differs from the recorded one wherever the torch version does: the profile records it).

    python benchmarks/fidelity_gpu_results.py [RESULTS_DIR ...] [--models gpt2,llama1b] [--verbose]

The last line reads ``gpu results: memory median X%, max Y% over N runs; step time median A%, max B% over
M runs (GPUS)``. The memory figures leave out the ``mlp`` runs with ``--no-tiny`` (a 36 MB model whose
peak is mostly library workspace), and always the runs whose measured program optplan no longer launches
(:func:`superseded`, marked in the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity  # noqa: E402
import fidelity_suite  # noqa: E402

from optplan.estimators.estimate import estimate  # noqa: E402
from optplan.estimators.hardware import Cluster, find_gpu  # noqa: E402
from optplan.estimators.memory import memory_breakdown, usable_capacity_bytes  # noqa: E402
from optplan.estimators.profile import ModelProfile  # noqa: E402
from optplan.planner.results import MeasuredCase, read_results  # noqa: E402
from optplan.probes.loader import profile_model_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GRID_ALIASES = {"llama1b": "llama"}
"""grid.json's model keys that name a fidelity model (the same file, shape and sequence)."""
TINY_MODELS = ("mlp",)

LOSS_UNDER_ENGINE_AUTOCAST_SINCE = "2026-11-26T07:30:00+00:00"
"""From then on the probe loop (and the exported train.py) takes the loss under DeepSpeed's and accelerate's
autocast (probes/trainloop.py ``Trainer._loss_autocast``); AMP runs under those engines measured before it ran a
bf16 cross entropy, a program optplan no longer launches: their memory figure is shown but left out of the summary
(re-measure them). A rule on how a run was measured, not on its error."""


@dataclass(frozen=True)
class Compared:
    model: str
    label: str
    gpu: str
    source: str
    memory_pct: float | None
    time_pct: float | None
    predicted_step_s: float | None
    measured_step_s: float | None
    predicted_bytes: int
    measured_bytes: int | None
    in_band: bool | None = None
    superseded: str | None = None


def results_files(dirs: list[Path]) -> list[Path]:
    """Every fidelity.json / grid.json under ``dirs`` measured on a GPU, oldest folder first."""
    files = []
    for d in dirs:
        for path in sorted(d.rglob("*.json")):
            if path.name not in ("fidelity.json", "grid.json"):
                continue
            doc = json.loads(path.read_text())
            if doc.get("env", {}).get("device") == "cuda":
                files.append(path)
    return files


def latest_cases(files: list[Path]) -> list[tuple[MeasuredCase, str]]:
    """Measured cases on a GPU, one per (GPU, model, strategy): the last file's (folders sort by date/call). Each
    case's ``model`` is the fidelity model key (grid.json's names mapped through :data:`GRID_ALIASES`)."""
    seen: dict[tuple[str, str, str], tuple[MeasuredCase, str]] = {}
    for path in files:
        for case in read_results(path):
            if not case.gpu or case.gpu == "cpu" or not case.comparison.result.ok:
                continue
            case = case.model_copy(update={"model": GRID_ALIASES.get(case.model, case.model)})
            key = (case.gpu, case.model, case.comparison.probed.model_dump_json())
            seen[key] = (case, str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path))
    return list(seen.values())


def profiles(cases: list[tuple[MeasuredCase, str]]) -> dict[str, ModelProfile]:
    """Today's profile of every model the cases ran, by model key (the campaign's own model definitions)."""
    with tempfile.TemporaryDirectory(prefix="optplan_gpu_results_") as tmp:
        defs = fidelity_suite.models("cuda", Path(tmp))
        out = {}
        for key in sorted({c.model for c, _ in cases}):
            model = defs[key]
            out[key] = profile_model_file(model.path, seq_len=model.seq_len, env=model.env or None)
    return out


def campaign_rows(dirs: list[Path] | None = None) -> list[Any]:
    """Every distinct GPU run under ``dirs`` (default: benchmarks/results) as a ``published_sets.Row`` (set
    ``gpu-campaign``), for ``fidelity_published.py --write-domain``: the measured step time and how to price it."""
    from published_sets import Row

    cases = latest_cases(results_files(dirs or [RESULTS]))
    profs = profiles(cases)
    rows = []
    for case, source in cases:
        strategy, result = case.comparison.probed, case.comparison.result
        if not result.step_s:
            continue
        cluster = Cluster(gpu=find_gpu(case.gpu), gpus=strategy.world_size, gpus_per_node=strategy.world_size)
        rows.append(Row(set="gpu-campaign", label=f"{case.model} {strategy.label()}",
                        profile=profs[case.model], cluster=cluster, strategy=strategy,
                        measured_s=result.step_s,
                        extra={"source": source,  # the host's speed there (probes/host_speed.py), when recorded
                               **({"host_op_s": f"{result.host_op_s:.6g}"} if result.host_op_s else {})},
                        # the campaign hands DeepSpeed torch's foreach AdamW (no fused-Adam JIT build on a visit)
                        adam_impl=fidelity.probe_adam_impl(strategy, "cuda", ds_torch_optimizer=True)))
    return rows


def pct(pred: float | None, meas: float | None) -> float | None:
    if pred is None or not meas:
        return None
    return 100.0 * (pred - meas) / meas


def compare(case: MeasuredCase, source: str, profile: ModelProfile) -> Compared:
    strategy = case.comparison.probed
    result = case.comparison.result
    gpu = find_gpu(case.gpu)
    # the campaign runs DeepSpeed with torch's foreach AdamW as its client optimizer (no fused-Adam JIT build)
    impl = fidelity.probe_adam_impl(strategy, "cuda", ds_torch_optimizer=True)
    memory = memory_breakdown(profile, strategy, usable_capacity_bytes(gpu.memory_bytes), gpus_per_node=1,
                              adam_impl=impl, device="cuda", gpu=gpu.name)
    allocated = memory.total_bytes - memory.overhead_bytes
    t = estimate(profile, Cluster(gpu=gpu, gpus=strategy.world_size, gpus_per_node=strategy.world_size),
                 strategy, adam_impl=impl).time
    step_s = t.step_s
    in_band = (t.step_s_low <= result.step_s <= t.step_s_high) if result.step_s else None
    return Compared(model=case.model, label=strategy.label(), gpu=case.gpu, source=source,
                    memory_pct=pct(allocated, result.peak_allocated_bytes), time_pct=pct(step_s, result.step_s),
                    predicted_step_s=step_s, measured_step_s=result.step_s, predicted_bytes=allocated,
                    measured_bytes=result.peak_allocated_bytes, in_band=in_band,
                    superseded=superseded(case, source))


def superseded(case: MeasuredCase, source: str) -> str | None:
    """Why a run's memory no longer describes what optplan launches (:data:`LOSS_UNDER_ENGINE_AUTOCAST_SINCE`),
    or None."""
    strategy = case.comparison.probed
    if strategy.engine != "deepspeed" or not strategy.precision.startswith("amp-"):
        return None
    path = Path(source) if Path(source).is_absolute() else ROOT / source
    started = str(json.loads(path.read_text()).get("env", {}).get("started_at") or "")
    if started and started >= LOSS_UNDER_ENGINE_AUTOCAST_SINCE:
        return None
    return "loss outside DeepSpeed's autocast (before the loop took it under autocast): re-measure"


def summary(values: list[float]) -> tuple[float, float]:
    vals = [abs(v) for v in values]
    return statistics.median(vals), max(vals)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("dirs", nargs="*", type=Path, help=f"results folders (default: {RESULTS.relative_to(ROOT)})")
    parser.add_argument("--models", default=None, help="comma-separated model keys (mlp, gpt2, llama, resnet)")
    parser.add_argument("--no-tiny", action="store_true", help="leave the mlp runs out of the memory figures")
    args = parser.parse_args(argv)
    files = results_files(args.dirs or [RESULTS])
    cases = latest_cases(files)
    wanted = set(args.models.split(",")) if args.models else None
    if wanted is not None:
        wanted = {GRID_ALIASES.get(m, m) for m in wanted}
        cases = [(c, s) for c, s in cases if c.model in wanted]
    if not cases:
        print(f"error: no GPU runs in {', '.join(str(d) for d in (args.dirs or [RESULTS]))}: run "
              "benchmarks/gpu_campaign.py on a GPU and commit its results", file=sys.stderr)
        return 2
    profs = profiles(cases)
    rows = [compare(c, s, profs[c.model]) for c, s in cases]
    rows.sort(key=lambda r: (r.gpu, r.model, r.label))
    print(f"{len(files)} results files, {len(rows)} distinct GPU runs; predicted vs measured "
          "(allocated MiB, step ms; + = over)")
    print(f"{'gpu':<6} {'model':<7} {'strategy':<36} {'pred MiB':>9} {'meas MiB':>9} {'mem':>8} | "
          f"{'pred ms':>8} {'meas ms':>8} {'time':>8} band")
    for r in rows:
        mem = f"{r.memory_pct:+.2f}%" if r.memory_pct is not None else "-"
        tim = f"{r.time_pct:+.1f}%" if r.time_pct is not None else "-"
        meas_mib = f"{r.measured_bytes / 2**20:9.1f}" if r.measured_bytes else f"{'-':>9}"
        print(f"{r.gpu:<6} {r.model:<7} {r.label[:36]:<36} "
              f"{r.predicted_bytes / 2**20:9.1f} {meas_mib} {mem:>8} | "
              f"{(r.predicted_step_s or 0) * 1e3:8.1f} {(r.measured_step_s or 0) * 1e3:8.1f} {tim:>8} "
              f"{'in' if r.in_band else 'OUT' if r.in_band is not None else '-'}"
              + (" [memory superseded]" if r.superseded else ""))
    for model in sorted({r.model for r in rows}):
        mine = [r for r in rows if r.model == model]
        m = [r.memory_pct for r in mine if r.memory_pct is not None and not r.superseded]
        t = [r.time_pct for r in mine if r.time_pct is not None]
        print(f"  {model}: memory median {summary(m)[0]:.2f}%, max {summary(m)[1]:.2f}% over {len(m)}; "
              f"step time median {summary(t)[0]:.1f}%, max {summary(t)[1]:.1f}% over {len(t)}"
              if m and t else f"  {model}: {len(mine)} runs")
    mem_rows = [r for r in rows if not (args.no_tiny and r.model in TINY_MODELS)]
    mems = [r.memory_pct for r in mem_rows if r.memory_pct is not None and not r.superseded]
    gone = [r for r in rows if r.superseded]
    if gone:
        print(f"  memory superseded (left out of the memory figures): {len(gone)} run(s), {gone[0].superseded}")
    times = [r.time_pct for r in rows if r.time_pct is not None]
    gpus = ", ".join(sorted({r.gpu for r in rows}))
    mm, mx = summary(mems)
    tm, tx = summary(times)
    banded = [r.in_band for r in rows if r.in_band is not None]
    print(f"  measured step inside the predicted band: {sum(banded)} of {len(banded)}")
    print(f"gpu results: memory median {mm:.2f}%, max {mx:.2f}% over {len(mems)} runs; step time median "
          f"{tm:.1f}%, max {tx:.1f}% over {len(times)} runs ({gpus})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
