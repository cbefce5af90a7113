"""Step-time fidelity against every given measured set: per set and GPU, MAPE, median and worst rows.

Sets (``benchmarks/published_sets.py`` says how each row is priced and where it comes from):
- ``vtrain``: 1,440 Megatron-DeepSpeed iterations on 2-8 A100s (the A100 GEMM/HBM/host/link fit);
- ``llmfoundry-<GPU>``: 191 Composer/torch-FSDP MPT runs on A100 40/80 GB and H100 80 GB, 8-64 GPUs
  (the H100 fit, the A100 flash fit and the torch engine fit: benchmarks/fit_time.py);
- ``narayanan-table1``, ``korthikanti-table5``: Megatron-LM on up to 3,072 A100s (never fitted on);
- ``torchtitan``: FSDP2 Llama 3 runs on A100 and H100 (never fitted on);
- ``megatron-bridge``: NVIDIA's Megatron-Bridge fp8 runs on H100, B200 and GB200 (never fitted on);
- ``dgxc-nemo``: NVIDIA's DGX Cloud NeMo recipes, 70 bf16 and fp8 runs on 8-2,304 H100s (never fitted on).
- ``dgxc-nemo-25.05``: their release v25.05.05, 24 runs on GB200 NVL72 racks and H100s, bf16 and fp8 (never fitted on);
- ``bigscience-bloom``: BLOOM-176B's Megatron-DeepSpeed runs on 384 A100s, bf16 (never fitted on).
For fitted sets the held-out half (alternate rows, published_sets.split) is reported beside all rows.
The error of a row is predicted ÷ measured step time − 1 (a throughput error of the same size).

``--write-domain`` records, per GPU and engine, what the sets measured (ranges of model size, GPUs,
sequence, tokens per micro-batch, parallel degrees; precisions; checkpointing), the 5th/95th percentiles of
measured ÷ predicted step time (held-out rows of fitted sets, all rows of the others) and the best
measured MFU, into estimators/data/time_domain.yaml, which sets every estimate's band
(estimators/uncertainty.py).

Run: python benchmarks/fidelity_published.py [--worst N] [--write-domain]
Last line: ``published: MAPE X% over N runs``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from published_sets import Row, all_rows, in_time_domain, split  # noqa: E402

from optplan.estimators.uncertainty import model_kind, precision_class  # noqa: E402

DOMAIN_FILE = Path(__file__).resolve().parents[1] / "estimators" / "data" / "time_domain.yaml"
FITTED_SETS = ("vtrain", "llmfoundry-H100-SXM", "llmfoundry-A100-80GB", "llmfoundry-A100-40GB")
"""Sets some constants were fitted on (their held-out half is what judges the fit)."""


def _mape(ratios: list[float]) -> float:
    return statistics.fmean(abs(r - 1) for r in ratios)


def _quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def report(rows: list[Row], worst: int) -> dict[str, float]:
    """Print per set and GPU: runs, MAPE (all / held-out), median predicted/measured, worst rows."""
    ratios = {id(r): r.ratio() for r in rows}
    _, held = split(rows)
    held_ids = {id(r) for r in held}
    groups: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in rows:
        groups[(r.set, r.gpu)].append(r)
    print(f"{'set':<24} {'GPU':<10} {'runs':>5} {'MAPE':>7} {'held-out':>9} {'median p/m':>11} {'min':>6} {'max':>6}")
    out: dict[str, float] = {}
    for (name, gpu), rs in groups.items():
        rr = [ratios[id(r)] for r in rs]
        held_rr = [ratios[id(r)] for r in rs if id(r) in held_ids]
        held_txt = f"{100 * _mape(held_rr):8.1f}%" if name in FITTED_SETS and held_rr else f"{'-':>9}"
        print(f"{name:<24} {gpu:<10} {len(rs):>5} {100 * _mape(rr):6.1f}% {held_txt} {statistics.median(rr):>11.3f} "
              f"{min(rr):>6.2f} {max(rr):>6.2f}")
        out[f"{name}|{gpu}"] = _mape(rr)
    print(f"-- worst {worst} rows per set (predicted ÷ measured step time)")
    for (name, gpu), rs in groups.items():
        for r in sorted(rs, key=lambda r: -abs(ratios[id(r)] - 1))[:worst]:
            print(f"  {name:<22} {gpu:<10} {r.label:<62} measured {r.measured_s:9.3f} s  x{ratios[id(r)]:.2f}")
    every = [ratios[id(r)] for r in rows]
    out["all"] = _mape(every)
    print(f"published: MAPE {100 * out['all']:.1f}% over {len(every)} runs")
    return out


def _files(set_: str) -> str:
    """Where the rows of measured set ``set_`` come from."""
    if set_ == "gpu-campaign":
        return "benchmarks/results, benchmarks/fidelity_gpu_results.py"
    if set_.startswith("moe:"):
        return "benchmarks/fidelity_moe.py, benchmarks/data/moe_published.json"
    if set_.startswith("torchtitan-benchmarks"):
        return "benchmarks/fidelity_torchtitan.py, benchmarks/data/torchtitan_published.json"
    if set_.startswith("convnets-"):
        return "benchmarks/fidelity_convnets.py, benchmarks/data/convnets_published.json"
    return "benchmarks/published_sets.py"


def _domain_entry(name: str, rows: list[Row], judged: list[Row]) -> dict[str, object]:
    first = rows[0]
    measured_over_predicted = [1.0 / r.ratio() for r in judged]
    params = [float(r.profile.params) for r in rows]
    seqs = [r.profile.tokens_per_sample or 1 for r in rows]
    tokens = [r.strategy.mbs * (r.profile.tokens_per_sample or 1) / r.strategy.cp for r in rows]
    max_mfu: dict[str, float] = {}
    for r in rows:
        t = r.time()
        measured_mfu = t.mfu * t.step_s / r.measured_s
        cls = precision_class(r.strategy.precision)
        max_mfu[cls] = round(max(max_mfu.get(cls, 0.0), measured_mfu), 4)

    def span(values: list[float], cast: type = int) -> list[float]:
        return [cast(min(values)), cast(max(values))]

    return {
        "name": name, "gpu": first.gpu, "engine": first.strategy.engine,
        "source": "; ".join(sorted({r.set for r in rows})) + " (" + "; ".join(sorted({_files(r.set) for r in rows}))
                  + ")",
        "runs": len(rows), "mape": round(_mape([1.0 / x for x in measured_over_predicted]), 4),
        "ratio_low": round(_quantile(measured_over_predicted, 0.05), 4),
        "ratio_high": round(_quantile(measured_over_predicted, 0.95), 4),
        "params": span(params, float), "gpus": span([r.strategy.world_size for r in rows]),
        "seq": span(seqs), "tokens_per_microbatch": span(tokens, float),
        "tp": span([r.strategy.tp for r in rows]), "pp": span([r.strategy.pp for r in rows]),
        "cp": span([r.strategy.cp for r in rows]),
        "precisions": sorted({r.strategy.precision for r in rows}),
        "checkpointing": sorted({r.strategy.checkpointing for r in rows}),
        "comm_overlap": sorted({r.strategy.comm_overlap for r in rows}),
        "max_mfu": max_mfu,
    }


def write_domain(rows: list[Row]) -> None:
    """One measured set per (GPU, engine): ranges, band quantiles (held-out rows of fitted sets and all
    rows of the rest) and the best MFU; derived GPUs from estimators/data/efficiency.yaml."""
    from optplan.estimators.efficiency import efficiency_table

    _, held = split(rows)
    held_ids = {id(r) for r in held}
    from fidelity_convnets import domain_rows as convnet_rows
    from fidelity_gpu_results import campaign_rows
    from fidelity_moe import domain_rows
    from fidelity_torchtitan import domain_rows as torchtitan_rows

    # the GPU campaign's runs (benchmarks/results), the published MoE runs, torchtitan's benchmark runs and the
    # published convolution-net runs (fidelity_convnets.py: two constants fitted on 38 of them): all judged
    rows = [*rows, *campaign_rows(), *domain_rows(), *torchtitan_rows(), *convnet_rows()]
    rows = [r for r in rows if in_time_domain(r)]
    groups: dict[tuple[str, str, str, str], list[Row]] = defaultdict(list)
    for r in rows:
        groups[(r.gpu, r.strategy.engine, model_kind(r.profile), r.domain)].append(r)
    sets = []
    for (gpu, engine, kind, _), rs in sorted(groups.items()):
        judged = [r for r in rs if r.set not in FITTED_SETS or id(r) in held_ids]
        names = ", ".join(sorted({r.set for r in rs}))
        what = {"flops_only": " FLOPs-only models", "moe": " MoE models"}.get(kind, "")
        entry = _domain_entry(f"{gpu} {engine}{what}: {names}", rs, judged)
        if kind != "transformer":
            entry["kind"] = kind
        sets.append(entry)
    widen = {"H200": 0.05, "B200": 0.15, "GB200": 0.15}
    derived = [{"gpu": g, "from_gpu": d.from_gpu, "widen": widen.get(g, 0.10), "reason": d.reason}
               for g, d in efficiency_table().derived.items()]
    header = ("# Measured domain of the step-time model: written by `python benchmarks/fidelity_published.py "
              "--write-domain`.\n# Do not edit by hand; rerun it after changing the time model or its data.\n")
    text = header + yaml.safe_dump({"sets": sets, "derived": derived}, sort_keys=False, width=120,
                                   allow_unicode=True)
    tmp = DOMAIN_FILE.with_suffix(".yaml.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(DOMAIN_FILE)
    print(f"wrote {DOMAIN_FILE} ({len(sets)} measured sets)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worst", type=int, default=3, help="worst rows printed per set and GPU")
    parser.add_argument("--write-domain", action="store_true", help="write estimators/data/time_domain.yaml")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = all_rows()
    if args.write_domain:
        write_domain(rows)
    report(rows, args.worst)
    print(f"wall time {time.perf_counter() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
