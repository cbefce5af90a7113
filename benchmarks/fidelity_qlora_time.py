"""The time a 4-bit base costs (bitsandbytes' dequantisation) against published LoRA/QLoRA runtime pairs (issue 18).

Data: ``benchmarks/data/qlora_time_published.json``: LitGPT's config-hub runtimes of a LoRA and a QLoRA run of the
same model, data, epochs and machine (one A10G). Both runs train the same samples, so the QLoRA run's extra time per
micro-batch is what the 4-bit base costs there:

    measured overhead per micro-batch = (QLoRA runtime / (epochs · samples / mbs_q)) - (LoRA runtime per sample · mbs_q)

with 1,900 training samples per epoch (Alpaca2k's 2,000 less its 5 % validation split); the runtimes include the
periodic validation, which both runs do.

Prediction: optplan's dequantisation term (``estimators.finetune.dequant_bytes_per_layer`` at
``DEQUANT_BANDWIDTH_FRACTION`` of the GPU's HBM bandwidth, priced in ``memory_bound_s``) for the QLoRA row's profile
and strategy, the profiles made as ``benchmarks/fidelity_finetune_published.py`` makes them (shared cache).
``DEQUANT_BANDWIDTH_FRACTION`` is fitted on these same nine pairs (their median): the error column says how well one
constant explains the nine runs, not a held-out test. For context the table also prints the runtime ratio
QLoRA / LoRA, measured and predicted; the predicted ratio assumes 512-token batches (the memory benchmark's
assumption), longer than Alpaca's average, so it comes out below the measured one (the LoRA time it divides by is
too long): not scored.

Run: ``python benchmarks/fidelity_qlora_time.py [--write]``. Last line:
``qlora dequant time: median error X%, max Y% over N runs``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from optplan.estimators.estimate import estimate
from optplan.estimators.finetune import DEQUANT_BANDWIDTH_FRACTION, dequant_bytes_per_layer
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.partial_checkpointing import recompute_fraction
from optplan.probes.cache_dir import cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity_finetune_published as bench  # noqa: E402  (its rows, profiles and strategies)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "qlora_time_published.json"
RESULTS = ROOT / "benchmarks" / "results" / "fidelity_qlora_time.txt"


def load() -> dict[str, Any]:
    return json.loads(DATA.read_text(encoding="utf-8"))


def measured_overhead_s(pair: dict[str, Any], samples: int) -> float:
    """The QLoRA run's extra seconds per (QLoRA) micro-batch (module docstring)."""
    per_epoch = pair["epochs"] * samples
    lora_per_sample = pair["lora_runtime_min"] * 60 / per_epoch
    qlora_per_sample = pair["qlora_runtime_min"] * 60 / per_epoch
    return (qlora_per_sample - lora_per_sample) * pair["qlora_micro_batch"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"also write the output to {RESULTS.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    doc = load()
    _, rows = bench.load_rows()
    by_id = {r["id"]: r for r in rows}
    pairs = doc["rows"]
    needed = [by_id[p[k]] for p in pairs for k in ("lora_row", "qlora_row")]
    lines: list[str] = []

    def log(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    with tempfile.TemporaryDirectory(prefix="optplan_qlora_time_") as tmp:
        profiles = bench.profiles_for(needed, Path(tmp), 2, log, cache_dir() / bench.CACHE_NAME)
    log(f"{'pair':<32} {'mbs':>3} {'4-bit GB':>8} {'meas ms':>8} {'pred ms':>8} {'err':>7} | "
        f"{'ratio meas':>10} {'pred@512':>8}")
    errors = []
    for pair in pairs:
        lrow, qrow = by_id[pair["lora_row"]], by_id[pair["qlora_row"]]
        cluster = Cluster(gpu=find_gpu(pair["gpu"]), gpus=pair["gpus"], gpus_per_node=pair["gpus"])
        qprof = bench.runtime_for(qrow, profiles[bench.profile_key(qrow)])
        lprof = bench.runtime_for(lrow, profiles[bench.profile_key(lrow)])
        qstrat, lstrat = bench.strategy_for(qrow), bench.strategy_for(lrow)
        layers = qprof.repeated_block.count if qprof.repeated_block else 1
        moved = dequant_bytes_per_layer(qprof.adapter, qstrat.quant, layers,
                                        recompute_share=recompute_fraction(qstrat, layers)) * layers
        predicted = moved / (cluster.gpu.memory_bandwidth_bytes_per_s * DEQUANT_BANDWIDTH_FRACTION)
        measured = measured_overhead_s(pair, doc["train_samples_per_epoch"])
        err = 100.0 * (predicted / measured - 1.0)
        errors.append(abs(err))
        q_rate = estimate(qprof, cluster, qstrat).samples_per_s
        l_rate = estimate(lprof, cluster, lstrat).samples_per_s
        log(f"{pair['id']:<32} {pair['qlora_micro_batch']:>3} {moved / 1e9:>8.1f} {measured * 1e3:>8.1f} "
            f"{predicted * 1e3:>8.1f} {err:>+6.1f}% | {pair['qlora_runtime_min'] / pair['lora_runtime_min']:>10.2f} "
            f"{l_rate / q_rate:>8.2f}")
    log(f"DEQUANT_BANDWIDTH_FRACTION {DEQUANT_BANDWIDTH_FRACTION} (fitted on these runs: in-sample)")
    log(f"qlora dequant time: median error {statistics.median(errors):.1f}%, max {max(errors):.1f}% "
        f"over {len(errors)} runs")
    if args.write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text("# python benchmarks/fidelity_qlora_time.py\n" + "\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
