"""Fit the time model's GPU and engine constants on the fit half of the measured sets; write the data file.

What is fitted, on what (``benchmarks/published_sets.py`` rows; the held-out half is never seen):
- H100-SXM (llm-foundry H100 rows, torch FSDP): large-GEMM fraction of peak, flash attention forward and
  backward fractions. Its HBM fraction is not refitted since the eager elementwise bytes became a measured count
  (estimators/eager_traffic.py): on these rows it trades off against the eager multiplier below (a free fit drives
  it to 0.64, under what streaming kernels reach, and slows every fused H100 plan with it); it keeps the 0.82 of
  its first fit. Its GEMM wave size is not fitted: every llm-foundry GEMM is large
  (>= 2,048 tokens per micro-batch), so the data cannot see small-GEMM losses (a free fit drives the wave
  to ~0, i.e. no loss at all, which would flatter tiny micro-batches); it is the A100 fit's effective wave
  scaled by the SM count, 132 / 108 (stated);
- A100 (llm-foundry A100 40/80 GB rows): flash attention forward and backward fractions only (its GEMM,
  HBM, host and link constants stay vTrain's: benchmarks/fidelity_vtrain.py fits those, and vTrain has no
  flash attention);
- the torch engine (all llm-foundry rows): the eager elementwise multiplier (the measured per-operator bytes of
  estimators/eager_traffic.py ÷ what those many small kernels achieve against the streaming HBM fraction) and
  overlap interference. DeepSpeed takes both (it runs the same eager model); torch.compile's kernels keep
  ``compile_multiplier`` 1 over Inductor's measured bytes (benchmarks/compiled_traffic.py; stated: generated
  kernels stream at the HBM fraction the fused count is priced at). The llm-foundry rows ran MPT's own Triton flash
  attention, the kernel the flash fractions stand for (their rows name it ``fitted``).
Physical bounds (``UPPER``): a fraction of peak cannot exceed the best measured large matmul (H100 SXM
bf16: ~0.80 of 989 TFLOP/s; S. Bekman, "Machine Learning Engineering", Maximum Achievable Matmul FLOPS),
flash fractions and the HBM fraction stay below 1, interference in [0, 1].

Method: pattern search (coordinate steps in log space, halved when no step improves) on the mean absolute
percentage error of the step time over the fit rows, from the committed constants. ``--write`` puts the
result into estimators/data/efficiency.yaml (with the fit's MAPE in each source); then run
``python benchmarks/fidelity_published.py --write-domain``.

Run: python benchmarks/fit_time.py [--write] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from published_sets import Row, llmfoundry_rows, split  # noqa: E402

from optplan.estimators.efficiency import (  # noqa: E402
    EngineEfficiency,
    GpuEfficiency,
    efficiency_table,
)

DATA_FILE = Path(__file__).resolve().parents[1] / "estimators" / "data" / "efficiency.yaml"
GROUP = {"A100-80GB": "A100-80GB", "A100-40GB": "A100-80GB", "H100-SXM": "H100-SXM"}
"""Fit groups: both A100 parts share one set of constants (same GA100 die and clocks)."""
PARAMS: tuple[tuple[str, str, str], ...] = (
    ("gpu", "H100-SXM", "gemm_peak_fraction"),
    ("gpu", "H100-SXM", "flash_attention_fraction"),
    ("gpu", "H100-SXM", "flash_backward_fraction"),
    ("gpu", "A100-80GB", "flash_attention_fraction"),
    ("gpu", "A100-80GB", "flash_backward_fraction"),
    ("engine", "torch", "elementwise_multiplier"),
    ("engine", "torch", "overlap_interference"),
)
A100_SMS, H100_SMS = 108, 132
"""Streaming multiprocessors (NVIDIA A100 and H100 SXM5 architecture whitepapers)."""
UPPER = {"gemm_peak_fraction": 0.80, "flash_attention_fraction": 0.9, "flash_backward_fraction": 0.9,
         "hbm_fraction": 0.92, "overlap_interference": 1.0}
LOWER = {"overlap_interference": 0.0}


class Model:
    """A set of constants under trial: GPU constants by fit group, engine constants by engine."""

    def __init__(self, gpus: dict[str, GpuEfficiency], engines: dict[str, EngineEfficiency]) -> None:
        self.gpus, self.engines = gpus, engines

    def get(self, kind: str, key: str, name: str) -> float:
        return float(getattr((self.gpus if kind == "gpu" else self.engines)[key], name))

    def with_(self, kind: str, key: str, name: str, value: float) -> Model:
        lo, hi = LOWER.get(name, 1e-12), UPPER.get(name, float("inf"))
        value = min(hi, max(lo, value))
        gpus, engines = dict(self.gpus), dict(self.engines)
        table = gpus if kind == "gpu" else engines
        table[key] = table[key].model_copy(update={name: value})
        return Model(gpus, engines)

    def ratio(self, row: Row) -> float:
        return row.ratio(self.gpus[GROUP[row.gpu]], self.engines[row.strategy.engine])


def committed() -> Model:
    table = efficiency_table()
    gpus = dict(table.gpus)
    if "H100-SXM" not in gpus:  # first fit: start H100 from the A100 fit's fractions
        a100 = gpus["A100-80GB"]
        gpus["H100-SXM"] = a100.model_copy(update={"gemm_peak_fraction": 0.75,
                                                   "gemm_wave_outputs": a100.gemm_wave_outputs * H100_SMS / A100_SMS})
    gpus = {k: v if v.flash_backward_fraction else v.model_copy(update={"flash_backward_fraction": v.flash_backward})
            for k, v in gpus.items()}
    return Model(gpus, dict(table.engines))


def mape(model: Model, rows: list[Row]) -> float:
    return statistics.fmean(abs(model.ratio(r) - 1) for r in rows)


def fit(model: Model, rows: list[Row], *, step: float, min_step: float, max_rounds: int) -> Model:
    best, best_err = model, mape(model, rows)
    rounds = 0
    while step >= min_step and rounds < max_rounds:
        rounds += 1
        improved = False
        for kind, key, name in PARAMS:
            current = best.get(kind, key, name)
            base = current if current > 0 else 0.01
            for factor in (1 + step, 1 / (1 + step)):
                trial = best.with_(kind, key, name, base * factor)
                err = mape(trial, rows)
                if err < best_err - 1e-7:
                    best, best_err, improved = trial, err, True
                    break
        print(f"  round {rounds:3d} step {step:.3f} fit MAPE {100 * best_err:.2f}%", flush=True)
        if not improved:
            step /= 2
    return best


def by_set(model: Model, rows: list[Row]) -> dict[str, float]:
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.set, []).append(r)
    return {k: mape(model, v) for k, v in sorted(groups.items())}


def write(model: Model, fit_err: dict[str, float], held_err: dict[str, float]) -> None:
    """Update estimators/data/efficiency.yaml with the fitted constants and what produced them."""
    raw = yaml.safe_load(DATA_FILE.read_text(encoding="utf-8"))
    stamp = "; ".join(f"{k}: fit {100 * fit_err[k]:.1f}%, held-out {100 * held_err.get(k, float('nan')):.1f}%"
                      for k in fit_err)
    h100 = model.gpus["H100-SXM"].model_dump()
    h100["source"] = ("fitted by benchmarks/fit_time.py on the fit half of llm-foundry's 52 H100 80GB runs (Composer, "
                      "torch FSDP, bf16, 8-64 GPUs; ../shared/data/llmfoundry_mpt_benchmarks.csv): GEMM fraction, "
                      "flash forward/backward (the HBM fraction of its first fit kept: fit_time.py's docstring); "
                      "host, link and alignment constants from the "
                      f"A100 fit (same software stack) [{stamp}]")
    a100 = model.gpus["A100-80GB"].model_dump()
    a100["source"] = (raw["gpus"]["A100-80GB"]["source"].split(" + flash")[0]
                      + " + flash attention fractions fitted by benchmarks/fit_time.py on the fit half of "
                        f"llm-foundry's 139 A100 runs (torch FSDP) [{stamp}]")
    raw["gpus"] = {"A100-80GB": a100, "A100-40GB": dict(a100), "H100-SXM": h100}
    torch_ = model.engines["torch"].model_dump()
    torch_["source"] = ("fitted by benchmarks/fit_time.py on the fit half of llm-foundry's 191 runs (Composer, "
                        "torch FSDP 1, eager): the eager multiplier over the measured per-operator bytes "
                        "(estimators/data/eager_traffic.yaml) and the overlap interference; compile_multiplier "
                        f"stated (over Inductor's measured bytes, estimators/data/compiled_traffic.yaml) [{stamp}]")
    raw["engines"]["torch"] = torch_
    deepspeed = raw["engines"]["deepspeed"]
    for key in ("elementwise_multiplier", "eager", "compile_multiplier", "overlap_interference"):
        deepspeed[key] = torch_[key]
    deepspeed["source"] = ("stated, no measured DeepSpeed set: the torch engine's constants (DeepSpeed trains the same "
                           "eager model, and ZeRO-3's prefetch overlaps as FSDP's does; ZeRO 0-2 do not overlap)")
    header = "".join(line + "\n" for line in DATA_FILE.read_text(encoding="utf-8").splitlines()
                     if line.startswith("#"))
    body = yaml.safe_dump(raw, sort_keys=False, width=120, allow_unicode=True)
    tmp = DATA_FILE.with_suffix(".yaml.tmp")
    tmp.write_text(header + body, encoding="utf-8")
    tmp.replace(DATA_FILE)
    print(f"wrote {DATA_FILE}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the fitted constants to the data file")
    parser.add_argument("--quick", action="store_true", help="a short search")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = llmfoundry_rows()
    fit_rows, held = split(rows)
    start = committed()
    print(f"{len(rows)} llm-foundry rows: fit {len(fit_rows)}, held out {len(held)}")
    print("committed: fit", {k: f"{100 * v:.1f}%" for k, v in by_set(start, fit_rows).items()},
          "held-out", {k: f"{100 * v:.1f}%" for k, v in by_set(start, held).items()})
    model = fit(start, fit_rows, step=0.1 if args.quick else 0.4, min_step=0.05 if args.quick else 0.005,
                max_rounds=3 if args.quick else 300)
    for kind, key, name in PARAMS:
        print(f"  {kind} {key} {name} = {model.get(kind, key, name):.4g}")
    fit_err, held_err = by_set(model, fit_rows), by_set(model, held)
    print("fitted: fit", {k: f"{100 * v:.1f}%" for k, v in fit_err.items()},
          "held-out", {k: f"{100 * v:.1f}%" for k, v in held_err.items()})
    if args.write:
        write(model, fit_err, held_err)
    print(f"wall time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
