"""torchtitan step-time and memory fidelity: optplan's torch engine against published, measured runs on H100 and H200.

Data: ``benchmarks/data/torchtitan_published.json``: 32 measured torchtitan runs (Llama 3.1 8B/70B/405B; FSDP2,
tensor, context and pipeline parallelism; torch.compile, torchao float8 and async TP) from the three benchmark
files in pytorch/torchtitan's ``benchmarks/`` folder, each with its source, table and row. These are the
PyTorch-native runs on the GPUs people use that the time model was never fitted on: nothing here tunes a constant.

Prediction, through optplan's own pipeline, with no per-row constant:

* the profile: ``estimators.arch.parse_arch`` + ``profile_from_arch`` on torchtitan's Llama 3.1 shape (``SHAPES``);
* the plan: ``Strategy(engine="torch", fsdp="full", ...)`` with the row's fsdp/tp/pp/vpp/cp degrees, local batch
  and pipeline micro-batches, sequence parallelism with tp (torchtitan's ``SequenceParallel`` norms), ``full``
  checkpointing for torchtitan's full AC and optplan's ``selective`` for its per-op selective AC (the same policy,
  estimators/selective.py; with float8 torchtitan recomputes every ``_scaled_mm``: flag ``f8sac``),
  ``fp8`` for torchao float8 (flag ``fp8``), bf16 otherwise; ``compile`` where the run used torch.compile (its
  fused elementwise kernels, Inductor's measured bytes; eager runs are priced by the measured per-operator bytes,
  estimators/eager_traffic.py); attention is torch SDPA's FlashAttention-2 at its measured speed on Hopper
  (estimators/attention_kernels.py);
* the cluster: 8 GPUs per node with NVLink, 400 Gb/s RDMA per GPU as the sources state; the Grand Teton H100
  (96 GB HBM2e at 2.4 TB/s, 500 W cap; the source: its peak is "between SXM and NVL") is priced as that part
  (``grand_teton_h100``: HBM2e, the midpoint of the SXM and NVL peaks; flag ``gpu``), not as the catalogue's
  700 W H100 SXM (until 2026-11-27 it was, which hid the H100 SXM's measured attention speed behind the fit);
* ``estimators.estimate.estimate`` -> tokens/s per GPU and the peak memory.

What optplan does not model is flagged on each row, never corrected for: ``cp`` (context parallelism: torch's ring
attention is priced as its kernels at s/cp tokens per call plus what its Python ring adds, estimators/ring_attention.py:
the K/V all-gather one sub-attention hides, the fp32 dK/dV ring, the fp32 merges and accumulations; the rows at
cp 4-8 still run about 1.3-1.5x slower than priced, from no mechanism found),
``f8ag`` (FSDP all-gathers float8 weights: half the bytes optplan gathers), and ``rw`` (rowwise float8 scaling, slower
than the tensorwise scaling optplan's fp8 stands for). 405B's 126 layers over pp 8 x 2 interleaved stages are
priced at the busiest rank's 16 (torchtitan's uneven split, estimators/pipeline_layout.py). Async TP is the plan's
``async_tp`` (estimators/async_tp.py: its hidden share was measured on the dev-discuss post's forward durations,
never on these rows).

Memory: torchtitan logs ``torch.cuda.max_memory_reserved`` of the rank with the most; optplan's comparable figure is
its peak per GPU without the CUDA context (the caching allocator's share: ``fragmentation_margin`` included).

Run: ``python benchmarks/fidelity_torchtitan.py [--write]`` (``--write`` also writes
benchmarks/results/fidelity_torchtitan.txt). Last line: ``torchtitan: MAPE X% over N runs; memory median Y%,
max Z% over M runs``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.estimate import Estimate, estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import CheckpointName, PrecisionName, Strategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_sets import grand_teton_h100  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "torchtitan_published.json"
RESULTS = ROOT / "benchmarks" / "results" / "fidelity_torchtitan.txt"
GIB = 2**30

SHAPES = {
    "llama3-8b": "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0",
    "llama3-70b": "layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256,gated=1,tied=0",
    "llama3-405b": "layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,gated=1,tied=0",
}
"""torchtitan's Llama 3.1 flavors (``torchtitan/models/llama3/__init__.py``: dim, n_layers, n_heads, n_kv_heads 8,
ffn_dim_multiplier 1.3/1.3/1.2 with multiple_of 1024/4096/4096 -> 14,336 / 28,672 / 53,248), vocabulary 128,256,
untied output."""
GPUS = {"H100-96GB-500W": "H100-SXM", "H200": "H200"}
NIC_BYTES_PER_S = 50e9
"""400 Gb/s RDMA per GPU (every source)."""
CHECKPOINTING: dict[str, CheckpointName] = {"none": "none", "selective-op": "selective", "full": "full"}
REQUIRED = ("id", "source", "table", "model", "gpu", "gpus", "fsdp", "tp", "pp", "vpp", "cp", "local_batch",
            "microbatches", "seq", "ac", "compile", "float8", "fsdp_float8_all_gather", "async_tp",
            "tokens_per_s_per_gpu", "memory_gib")

FLAGS = {
    "gpu": "Grand Teton H100 (96 GB HBM2e 2.4 TB/s, 500 W cap; peak 'between SXM and NVL'): priced as the source "
           "describes it (grand_teton_h100: HBM2e, the midpoint of the two peaks), not a catalogue GPU",
    "cp": "context parallelism: torch's ring attention (one SDPA call per ring step, all-gathered K/V, fp32 merges "
          "and dK/dV ring) priced by its mechanisms (estimators/ring_attention.py); cp 4-8 run slower still",
    "f8sac": "torchtitan's per-op selective AC with float8: torch._scaled_mm is not in its save list, so every "
             "float8 matmul is recomputed; optplan's selective (the same policy) keeps every other one",
    "fp8": "torchao Float8Linear priced as optplan's fp8 recipe (Transformer Engine per-tensor fp8 GEMMs)",
    "rw": "rowwise float8 scaling: slower GEMMs than the tensorwise scaling optplan's fp8 stands for",
    "f8ag": "FSDP all-gathers float8 weights: half the bytes optplan's bf16 all-gather moves",
    "atp24": "async TP with float8 on December 2024's torch: its 70B pair (t4) gained 5.7 % where June 2025's "
             "gained 16 %; priced at the share measured on the later stack (estimators/async_tp.py)",
}


@dataclass(frozen=True)
class Result:
    """One row, its closest plan and the prediction."""

    row: dict[str, Any]
    strategy: Strategy
    flags: tuple[str, ...]
    est: Estimate
    measured_tps: float

    @property
    def predicted_tps(self) -> float:
        return (self.est.time.tokens_per_s or 0.0) / self.strategy.world_size

    @property
    def ratio(self) -> float:
        """Predicted ÷ measured step time (= measured ÷ predicted tokens/s)."""
        return self.measured_tps / self.predicted_tps

    @property
    def in_band(self) -> bool:
        """Whether the measured step lies inside the estimate's band (``time.step_s_low``-``step_s_high``)."""
        t = self.est.time
        measured_s = t.step_s / self.ratio  # ratio = predicted ÷ measured step time
        return t.step_s_low <= measured_s <= t.step_s_high

    @property
    def predicted_reserved_gib(self) -> float:
        """optplan's peak per GPU without the CUDA context: what the caching allocator reserves (GiB)."""
        mem = self.est.memory
        return (mem.total_bytes - mem.detail_bytes.get("cuda_context", 0)) / GIB

    @property
    def memory_error(self) -> float | None:
        measured = self.row["memory_gib"]
        return None if measured is None else self.predicted_reserved_gib / measured - 1


def load() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(sources, rows) of the data file."""
    doc = json.loads(DATA.read_text(encoding="utf-8"))
    return doc["sources"], doc["rows"]


def check_row(row: dict[str, Any], sources: dict[str, Any]) -> list[str]:
    """What is missing or inconsistent in ``row`` (empty when it is complete and cited)."""
    bad = [f"missing {k}" for k in REQUIRED if k not in row]
    if bad:
        return bad
    if row["source"] not in sources or not row["table"]:
        bad.append("source must name a known source and the table row")
    if row["model"] not in SHAPES or row["gpu"] not in GPUS or row["ac"] not in CHECKPOINTING:
        bad.append("unknown model, GPU or AC mode")
    if row["fsdp"] * row["tp"] * row["pp"] * row["cp"] != row["gpus"]:
        bad.append("fsdp·tp·pp·cp must equal the GPUs")
    if row["local_batch"] % row["microbatches"]:
        bad.append("local batch not divisible by the micro-batches")
    if row["float8"] not in ("none", "tensorwise", "rowwise") or not row["tokens_per_s_per_gpu"] > 0:
        bad.append("float8 must be none, tensorwise or rowwise and the throughput positive")
    return bad


def profile_for(row: dict[str, Any]) -> ModelProfile:
    """The ``--arch`` profile of the row's model at its sequence length, with the key heads its attention call
    receives: torchtitan's Llama 3 repeats its 8 key/value heads to every query head before calling SDPA
    (``torchtitan/models/llama3/model.py`` ``repeat_kv``), as the profile of its model file would record
    (probes/attention_heads.py); under context parallelism torch's ring attention moves those
    (estimators/ring_attention.py)."""
    spec = parse_arch(f"{SHAPES[row['model']]},seq={row['seq']}")
    return profile_from_arch(spec).model_copy(update={"attention_key_heads": spec.heads})


def source_compiles_loss(row: dict[str, Any]) -> bool:
    """Whether the torchtitan the row's source ran compiled its loss function under ``--training.compile`` (the data
    file's ``compiles_loss``, read from that commit's code: ``compiles_loss_source``): 2024-12's did not, 2025-06's
    did (estimators/compiled_loss.py)."""
    return bool(load()[0][row["source"]].get("compiles_loss", False))


def plan(row: dict[str, Any]) -> tuple[Strategy, tuple[str, ...]]:
    """The closest optplan plan for ``row`` and the flags of what it does not express."""
    flags: list[str] = []
    if row["gpu"] != "H200":
        flags.append("gpu")
    if row["cp"] > 1:
        flags.append("cp")
    if row["ac"] == "selective-op" and row["float8"] != "none":
        flags.append("f8sac")
    precision: PrecisionName = "bf16"
    if row["float8"] != "none":
        precision = "fp8"
        flags.append("fp8")
        if row["float8"] == "rowwise":
            flags.append("rw")
    if row["fsdp_float8_all_gather"]:
        flags.append("f8ag")
    if row["async_tp"] and row["float8"] != "none" and row["source"] == "torchtitan-h100-2024-12":
        flags.append("atp24")
    micro = row["microbatches"]
    compiled = bool(row["compile"])
    strategy = Strategy(engine="torch", fsdp="full", precision=precision, dp=row["fsdp"], tp=row["tp"], pp=row["pp"],
                        vpp=row["vpp"], cp=row["cp"], mbs=row["local_batch"] // micro, grad_accum=micro,
                        checkpointing=CHECKPOINTING[row["ac"]], sp=row["tp"] > 1, compile=compiled,
                        async_tp=bool(row["async_tp"]),
                        compile_loss=compiled and source_compiles_loss(row))
    return strategy, tuple(flags)


def cluster_for(row: dict[str, Any]) -> Cluster:
    """The cluster ``row`` ran on: its GPU as the source describes it, 8 per node, 400 Gb/s per GPU."""
    gpu = grand_teton_h100() if row["gpu"] == "H100-96GB-500W" else find_gpu(GPUS[row["gpu"]])
    return Cluster(gpu=gpu, gpus=row["gpus"], gpus_per_node=8, inter_node_bandwidth_bytes_per_s=NIC_BYTES_PER_S)


def compile_pairs(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(eager, compiled) runs of one source that differ only in torch.compile: the measured difference is the eager
    elementwise kernels' time over Inductor's (benchmarks/fit_time.py identifies the torch engine's multiplier on it)."""
    same = ("id", "table", "compile", "tokens_per_s_per_gpu", "memory_gib")

    def key(r: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted((k, v) for k, v in r.items() if k not in same))

    compiled = {key(r): r for r in rows if r["compile"]}
    return [(r, compiled[key(r)]) for r in rows if not r["compile"] and key(r) in compiled]


def predict(row: dict[str, Any]) -> Result:
    """optplan's estimate for ``row`` under its closest plan."""
    profile = profile_for(row)
    strategy, flags = plan(row)
    cluster = cluster_for(row)
    with contextlib.redirect_stderr(io.StringIO()):
        est = estimate(profile, cluster, strategy)
    return Result(row=row, strategy=strategy, flags=flags, est=est, measured_tps=float(row["tokens_per_s_per_gpu"]))


def domain_rows() -> list[Any]:
    """The runs of plans optplan makes as ``published_sets.Row`` (rowwise float8 left out: no optplan recipe stands
    for it), for the time model's measured domain (``fidelity_published.py --write-domain``): a set of their own
    beside the GPU's other torch runs (which cover single-node FSDP; these tensor, pipeline and float8 plans at up to
    512 GPUs), and the context-parallel runs another, whose band carries ring attention's measured slowness (flag
    ``cp``) to the plans it covers."""
    from published_sets import Row

    out = []
    for row in load()[1]:
        if row["float8"] == "rowwise":
            continue
        strategy, _ = plan(row)
        measured_s = strategy.global_batch * row["seq"] / (row["tokens_per_s_per_gpu"] * row["gpus"])
        cp = row["cp"] > 1
        out.append(Row(set="torchtitan-benchmarks" + (" (context parallel)" if cp else ""), label=row["id"],
                       profile=profile_for(row), cluster=cluster_for(row), strategy=strategy, measured_s=measured_s,
                       domain="torchtitan-cp" if cp else "torchtitan"))
    return out


def mape(ratios: list[float]) -> float:
    """Mean absolute percentage error of predicted ÷ measured step times (%)."""
    return 100.0 * sum(abs(r - 1.0) for r in ratios) / len(ratios) if ratios else float("nan")


def _layout(s: Strategy) -> str:
    parts = [f"fsdp{s.dp}"] + [f"{k}{v}" for k, v in (("tp", s.tp), ("pp", s.pp), ("v", s.vpp), ("cp", s.cp)) if v > 1]
    return " ".join(parts) + f" mbs{s.mbs}x{s.grad_accum}"


def async_tp_pairs(results: list[Result]) -> list[tuple[Result, Result]]:
    """(async TP run, its vanilla twin): rows of one source that differ in ``async_tp`` alone."""
    def key(r: Result) -> tuple[Any, ...]:
        return tuple(v for k, v in sorted(r.row.items()) if k not in ("id", "table", "async_tp", "tokens_per_s_per_gpu",
                                                                      "memory_gib"))
    vanilla = {key(r): r for r in results if not r.row["async_tp"]}
    return [(r, vanilla[key(r)]) for r in results if r.row["async_tp"] and key(r) in vanilla]


def report(results: list[Result], out: io.TextIOBase) -> tuple[float, float, float, int]:
    """Print the per-row table and the groups; (MAPE %, memory median %, memory max %, memory rows)."""
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("torchtitan runs: optplan (estimate, closest torch-engine plan) against published measurements")
    p("ratio = predicted ÷ measured step time (= measured ÷ predicted tokens/s per GPU); mem = optplan's peak "
      "without the CUDA context against torchtitan's max reserved")
    p("")
    p(f"{'run':28s} {'GPU':15s} {'GPUs':>4s} {'seq':>6s} {'layout':28s} {'prec':4s} {'ac':4s} {'meas t/s':>8s} "
      f"{'pred t/s':>8s} {'ratio':>5s} {'band':4s} {'meas GiB':>8s} {'pred GiB':>8s} {'mem':>7s}  flags")
    for r in results:
        s, row = r.strategy, r.row
        mem = "" if r.memory_error is None else f"{100 * r.memory_error:+6.1f}%"
        meas = "" if row["memory_gib"] is None else f"{row['memory_gib']:.1f}"
        p(f"{row['id']:28s} {row['gpu']:15s} {row['gpus']:4d} {row['seq']:6d} {_layout(s):28s} {s.precision:4s} "
          f"{s.checkpointing[:4]:4s} {r.measured_tps:8.0f} {r.predicted_tps:8.0f} {r.ratio:5.2f} {'in' if r.in_band else 'OUT':4s} {meas:>8s} "
          f"{r.predicted_reserved_gib:8.1f} {mem:>7s}  {','.join(r.flags)}")
    p("")
    groups: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        groups[f"source {r.row['source']}"].append(r)
        groups[f"model {r.row['model']}"].append(r)
        groups["torch.compile" if r.strategy.compile else "eager (no compile)"].append(r)
        groups["bf16" if "fp8" not in r.flags else "float8"].append(r)
        groups["tp > 1" if r.strategy.tp > 1 else "tp 1"].append(r)
        if r.strategy.pp > 1:
            groups["pp > 1"].append(r)
        if r.strategy.cp > 1:
            groups["cp > 1"].append(r)
        if "cp" not in r.flags and "rw" not in r.flags:  # what optplan models: no ring attention, no rowwise float8
            groups["modelled (no cp, no rowwise float8)"].append(r)
    p(f"{'group':40s} {'runs':>4s} {'MAPE':>6s} {'median':>6s} {'min':>5s} {'max':>5s} {'in band':>7s}")
    for name in sorted(groups):
        ratios = [r.ratio for r in groups[name]]
        inside = sum(r.in_band for r in groups[name])
        p(f"{name:40s} {len(ratios):4d} {mape(ratios):5.1f}% {statistics.median(ratios):6.2f} {min(ratios):5.2f} "
          f"{max(ratios):5.2f} {inside:7d}")
    p("")
    p("async TP pairs (the same run with and without it): throughput gain measured vs predicted")
    for r, twin in async_tp_pairs(results):
        p(f"  {r.row['id']:28s} measured x{r.measured_tps / twin.measured_tps:5.3f}  "
          f"predicted x{r.predicted_tps / twin.predicted_tps:5.3f}  {','.join(r.flags)}")
    p("")
    p("flags:")
    for key, text in FLAGS.items():
        p(f"  {key:8s}{text}")
    ratios = [r.ratio for r in results]
    mem = [abs(r.memory_error) * 100 for r in results if r.memory_error is not None]
    mem_median = statistics.median(mem) if mem else float("nan")
    mem_max = max(mem) if mem else float("nan")
    p("")
    p(f"measured step inside the estimate's band (time.step_s_low-high): {sum(r.in_band for r in results)} of "
      f"{len(results)}")
    p("memory figures: every row that published one (per-op selective AC is optplan's torch-engine selective "
      "policy: estimators/selective.py)")
    return mape(ratios), mem_median, mem_max, len(mem)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"also write {RESULTS.relative_to(ROOT)}")
    args = parser.parse_args()
    sources, rows = load()
    problems = {row.get("id", "?"): check_row(row, sources) for row in rows}
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        sys.exit(f"error: {DATA.name} has incomplete rows: {problems}")
    results = [predict(row) for row in rows]
    buf = io.StringIO()
    err, mem_median, mem_max, mem_n = report(results, buf)
    buf.write(f"torchtitan: MAPE {err:.1f}% over {len(results)} runs; memory median {mem_median:.1f}%, "
              f"max {mem_max:.1f}% over {mem_n} runs\n")
    text = buf.getvalue()
    print(text, end="")
    if args.write:
        RESULTS.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
