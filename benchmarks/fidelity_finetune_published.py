"""Fine-tuning peak memory against published measurements (issue 18): predicted against measured, per run.

Data: ``benchmarks/data/finetune_memory_published.json``, one row per published run with its settings and source
(LitGPT's config-hub table, torchtune's LoRA/QLoRA tutorials, the PEFT accelerate docs; see its ``sources``).

Prediction, through optplan's own pipeline, for every ``scored`` row:

* the model: the row's config numbers written as a ``config.json`` (``architectures``, ``model_type``, hidden,
  intermediate, layers, heads, kv heads, vocab, ``tie_word_embeddings``, plus ``extra_config``) and turned into
  the model file ``optplan --hf`` generates (``planner.hf_source``), built on the meta device (no weights);
* the profile: ``probes.loader.profile_model_file(path, seq_len=..., lora=LoraRequest(rank, alpha, targets))``
  (LoRA adapters built by peft on the row's ``hf_lora_targets``; no adapters for full fine-tuning), cached per
  distinct model, adapter and sequence length, two profiles at a time;
* the row's software (:func:`runtime_for`): a bitsandbytes before 0.43.2 keeps each 4-bit layer's input, and
  LitGPT's loop holds the last step's graph into the next forward (estimators/finetune.py);
* the estimate: ``estimators.estimate.estimate(profile, Cluster(gpu, gpus), Strategy(...))`` with the row's
  precision recipe, optimizer, micro-batch, gradient accumulation, checkpointing, quantised base and parallelism
  (``single``: torch, one GPU; ``fsdp-full``: torch FSDP FULL_SHARD over the GPUs, with the row's
  ``fsdp_grad_sync``: ``step`` where its framework accumulates under ``no_sync``, estimators/fsdp_grad_sync.py;
  ``deepspeed-zero3``);
* the compared figure, per the row's ``compare``: ``allocated`` (a torch.cuda.max_memory_allocated figure) is the
  memory breakdown's total less its overhead (no CUDA context, no fragmentation margin); ``reserved``
  (max_memory_reserved) adds the fragmentation margin; ``device`` (nvidia-smi and the like) is the whole total.

Nothing is tuned per row. Error = predicted / measured - 1. Rows marked ``excluded`` (a setting is unknowable from the
source) or ``unpriceable`` (optplan cannot express the run) are printed with the reason and not scored; rows marked
``bound`` (the figure also holds memory from before the steps, which the source itself shows) are predicted and checked
as an upper bound (predicted <= measured), not scored.

Run: ``python benchmarks/fidelity_finetune_published.py [--write] [--detail] [--only ID-SUBSTRING] [--no-cache]``
(about 5 minutes on two cores for the 21 profiles; seconds when the profiles are in the optplan cache folder,
``published_finetune_profiles/``, keyed by a hash of the profiler's code and the torch/transformers/peft versions).
Last line: ``finetune memory: median error X%, max Y% over N runs``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optplan.estimators.estimate import estimate
from optplan.estimators.finetune import LoraRequest, bnb_version_keeps_4bit_inputs
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.memory import MemoryBreakdown
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.planner.hf_source import find_hf_config, write_hf_model_file
from optplan.probes.cache_dir import cache_dir
from optplan.probes.loader import profile_model_file

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "finetune_memory_published.json"
RESULTS = ROOT / "benchmarks" / "results" / "fidelity_finetune_published.txt"
GIB = 2**30
CACHE_NAME = "published_finetune_profiles"
UNIT_BYTES = {"GB": 1e9, "GiB": float(GIB)}
REQUIRED = ("id", "source", "source_detail", "status", "model", "architecture", "model_type", "hidden",
            "intermediate", "layers", "heads", "kv_heads", "vocab", "tie_word_embeddings", "method", "quant",
            "precision", "optplan_precision", "optimizer", "optplan_optimizer", "micro_batch", "grad_accum", "seq_len",
            "checkpointing", "parallelism", "gpu", "gpus", "measured_value", "measured_unit", "measured_quantity",
            "compare", "notes")
RUNTIME_FIELDS = ("bnb_version", "loop_holds_last_loss", "checkpoint_reentrant")
"""Software facts of each row (``bnb_version`` may be empty: no bitsandbytes, or its version does not matter)."""
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "hf_lora_targets")
STATUSES = ("scored", "bound", "excluded", "unpriceable")
"""``bound``: the figure bounds the compared quantity from above (it also holds memory the run kept from before its
steps, e.g. the allocator's cache of the model's initialisation, published beside it): the prediction is checked
against it (predicted <= measured) and not scored."""
COMPARES = ("allocated", "reserved", "device")
PARALLELISMS = ("single", "fsdp-full", "deepspeed-zero3", "fsdp-full-offload")
FFN_KEY = {"falcon": "ffn_hidden_size"}
"""Config key of the MLP width where the architecture does not call it ``intermediate_size``."""
KV_KEY = {"falcon": "num_kv_heads"}


def load_rows(path: Path = DATA) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(sources, rows) of the data file."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    return doc["sources"], doc["rows"]


def check_row(row: dict[str, Any], sources: dict[str, Any]) -> list[str]:
    """What is missing or malformed in ``row`` (empty when it is complete)."""
    problems = [f"no {k}" for k in REQUIRED if row.get(k) in (None, "")]
    problems += [f"no {k}" for k in RUNTIME_FIELDS if k not in row]
    if row.get("method") in ("lora", "qlora"):
        problems += [f"no {k}" for k in LORA_FIELDS if row.get(k) in (None, "", [])]
    if row.get("source") not in sources:
        problems.append(f"source {row.get('source')!r} not in sources")
    if "http" not in str(row.get("source_detail", "")):
        problems.append("source_detail has no URL")
    if row.get("status") not in STATUSES:
        problems.append(f"status {row.get('status')!r}")
    if row.get("status") != "scored" and not row.get("exclude_reason"):
        problems.append("not scored but no exclude_reason")
    if row.get("measured_unit") not in UNIT_BYTES:
        problems.append(f"unit {row.get('measured_unit')!r}")
    if row.get("compare") not in COMPARES:
        problems.append(f"compare {row.get('compare')!r}")
    if row.get("parallelism") not in PARALLELISMS:
        problems.append(f"parallelism {row.get('parallelism')!r}")
    if str(row.get("parallelism", "")).startswith("fsdp") and row.get("fsdp_grad_sync") not in ("micro_batch", "step"):
        problems.append("an FSDP row without fsdp_grad_sync (micro_batch or step: when its framework reduces)")
    if row.get("method") == "qlora" and row.get("quant") == "none":
        problems.append("qlora without a quantised base")
    return problems


def hf_config(row: dict[str, Any]) -> dict[str, Any]:
    """The config.json of the row's model (the numbers of the row, keyed as transformers names them), with
    ``use_cache`` off as in training (transformers 5 Falcon and Gemma2 otherwise fail the profiler's backward)."""
    mt = row["model_type"]
    return {
        "architectures": [row["architecture"]], "model_type": mt, "hidden_size": row["hidden"],
        FFN_KEY.get(mt, "intermediate_size"): row["intermediate"], "num_hidden_layers": row["layers"],
        "num_attention_heads": row["heads"], KV_KEY.get(mt, "num_key_value_heads"): row["kv_heads"],
        "vocab_size": row["vocab"], "tie_word_embeddings": row["tie_word_embeddings"], "use_cache": False,
        **row.get("extra_config", {}),
    }


def lora_request(row: dict[str, Any]) -> LoraRequest | None:
    """The adapters of a LoRA/QLoRA row (None for full fine-tuning)."""
    if row["method"] == "full":
        return None
    return LoraRequest(rank=row["lora_rank"], alpha=row["lora_alpha"], targets=tuple(row["hf_lora_targets"]),
                       dropout=row["lora_dropout"])


def profile_key(row: dict[str, Any]) -> str:
    """Rows sharing a model, adapters and sequence length share one profile."""
    lora = lora_request(row)
    return json.dumps([hf_config(row), lora.model_dump() if lora else None, row["seq_len"]], sort_keys=True)


def profile_row(row: dict[str, Any], folder: Path) -> ModelProfile:
    """Profile the row's model (meta device, fake tensors) in a child process, as ``optplan --hf`` does."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(row)), encoding="utf-8")
    path = write_hf_model_file(find_hf_config(str(folder)), folder)
    return profile_model_file(path, seq_len=row["seq_len"], lora=lora_request(row), timeout_s=900)


PROFILER_CODE = ("probes/*.py", "planner/hf_source.py", "estimators/profile.py", "estimators/finetune.py")
"""The code a profile depends on: the on-disk cache key hashes it, so a change of the profiler invalidates it."""


def code_version() -> str:
    """A hash of the profiler's code and of the library versions the profile depends on."""
    digest = hashlib.sha256()
    for pattern in PROFILER_CODE:
        for path in sorted(ROOT.glob(pattern)):
            digest.update(path.name.encode() + path.read_bytes())
    for dist in ("torch", "transformers", "peft"):
        try:
            digest.update(f"{dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(dist.encode())
    return digest.hexdigest()[:16]


def profiles_for(rows: Iterable[dict[str, Any]], workdir: Path, workers: int = 2,
                 log: Callable[[str], None] = print, cache: Path | None = None) -> dict[str, ModelProfile]:
    """One profile per distinct :func:`profile_key`, ``workers`` child processes at a time; with ``cache``, a
    profile made by the same profiler code (:func:`code_version`) is read from there instead."""
    todo: dict[str, dict[str, Any]] = {}
    for row in rows:
        todo.setdefault(profile_key(row), row)
    keys = list(todo)
    version = code_version()

    def cached(key: str) -> Path | None:
        return cache / f"{hashlib.sha256((version + key).encode()).hexdigest()[:24]}.json" if cache else None

    def run(i: int) -> ModelProfile:
        path = cached(keys[i])
        if path is not None and path.is_file():
            return ModelProfile.model_validate_json(path.read_text(encoding="utf-8"))
        t0 = time.perf_counter()
        prof = profile_row(todo[keys[i]], workdir / f"m{i}")
        log(f"  profiled {todo[keys[i]]['model']:<24} {prof.params / 1e9:6.2f}e9 params, "
            f"{prof.trainable_params:>13,} trainable ({time.perf_counter() - t0:.0f} s)")
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{i}.tmp")
            tmp.write_text(prof.model_dump_json(), encoding="utf-8")
            tmp.replace(path)
        return prof

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(keys, pool.map(run, range(len(keys))), strict=True))


def strategy_for(row: dict[str, Any]) -> Strategy:
    """The optplan Strategy of a row (recipe, optimizer, batch split, checkpointing, base, parallelism)."""
    par = row["parallelism"]
    common: dict[str, Any] = dict(
        precision=row["optplan_precision"], optimizer=row["optplan_optimizer"], mbs=row["micro_batch"],
        grad_accum=row["grad_accum"], checkpointing="full" if row["checkpointing"] else "none", quant=row["quant"],
        dp=row["gpus"])
    if par == "single":
        return Strategy(engine="torch", **common)
    if par == "fsdp-full":  # when the framework reduces under accumulation (estimators/fsdp_grad_sync.py)
        return Strategy(engine="torch", fsdp="full", fsdp_grad_sync=row["fsdp_grad_sync"], **common)
    if par == "deepspeed-zero3":
        return Strategy(engine="deepspeed", zero=3, **common)
    raise ValueError(f"{row['id']}: parallelism {par!r} cannot be priced")


def compared_bytes(memory: MemoryBreakdown, compare: str) -> int:
    """The figure of the breakdown that matches what the source measured (module docstring)."""
    if compare == "allocated":
        return memory.total_bytes - memory.overhead_bytes
    if compare == "reserved":
        return memory.total_bytes - memory.detail_bytes.get("cuda_context", 0)
    return memory.total_bytes


def runtime_for(row: dict[str, Any], profile: ModelProfile) -> ModelProfile:
    """The profile with the row's software facts, which the profile reads from this machine otherwise
    (estimators/finetune.py): whether its bitsandbytes keeps each 4-bit layer's input (``bnb_version`` before
    0.43.2, unless reentrant checkpointing runs the forward without autograd nodes), and whether its training loop
    holds the last step's loss into the next forward (``loop_holds_last_loss``)."""
    if profile.adapter is None:
        return profile
    keeps = (bool(row["bnb_version"]) and bnb_version_keeps_4bit_inputs(row["bnb_version"])
             and not (row["checkpointing"] and row["checkpoint_reentrant"]))
    adapter = profile.adapter.model_copy(update={"bnb_4bit_keeps_inputs": keeps,
                                                 "graph_held_steps": 2 if row["loop_holds_last_loss"] else 1})
    return profile.model_copy(update={"adapter": adapter})


def predict(row: dict[str, Any], profile: ModelProfile) -> tuple[int, MemoryBreakdown]:
    """(predicted bytes in the row's compared quantity, the memory breakdown) of one row."""
    profile = runtime_for(row, profile)
    gpus = int(row["gpus"])
    cluster = Cluster(gpu=find_gpu(row["gpu"]), gpus=gpus, gpus_per_node=min(gpus, 8))
    est = estimate(profile, cluster, strategy_for(row))
    return compared_bytes(est.memory, row["compare"]), est.memory


def measured_bytes(row: dict[str, Any]) -> float:
    return float(row["measured_value"]) * UNIT_BYTES[row["measured_unit"]]


@dataclass
class Result:
    row: dict[str, Any]
    predicted: int
    measured: float
    memory: MemoryBreakdown

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted / self.measured - 1.0)


def settings(row: dict[str, Any]) -> str:
    """A short label of the run's settings."""
    parts = [row["method"]]
    if row["method"] != "full":
        parts.append(f"r{row['lora_rank']}/{len(row['hf_lora_targets'])}t")
    if row["quant"] != "none":
        parts.append(row["quant"])
    parts += [row["optplan_precision"], f"mbs{row['micro_batch']}x{row['seq_len']}"]
    if row["checkpointing"]:
        parts.append("ckpt")
    if row["gpus"] > 1:
        parts.append(f"{row['parallelism']}x{row['gpus']}")
    if row.get("fsdp_grad_sync") == "step" and row["grad_accum"] > 1:
        parts.append(f"ga{row['grad_accum']}-sync-once")
    return " ".join(parts)


def run(rows: list[dict[str, Any]], workers: int = 2, log: Callable[[str], None] = print,
        cache: Path | None = None) -> list[Result]:
    """Predict every scored and bound row (profiles made once per distinct model + adapters; read from ``cache`` if there)."""
    scored = [r for r in rows if r["status"] in ("scored", "bound")]
    with tempfile.TemporaryDirectory(prefix="optplan_published_ft_") as tmp:
        profiles = profiles_for(scored, Path(tmp), workers, log, cache)
    out = []
    for row in scored:
        predicted, memory = predict(row, profiles[profile_key(row)])
        out.append(Result(row, predicted, measured_bytes(row), memory))
    return out


def breakdown(memory: MemoryBreakdown) -> str:
    """The memory breakdown in GiB, one line (for --detail)."""
    parts = {"weights": memory.params_bytes, "grads": memory.grads_bytes, "optim": memory.optimizer_bytes,
             "acts": memory.activations_bytes, **memory.detail_bytes}
    return (f"moment {memory.moment or '-'}: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items() if v)
            + f"; total {memory.total_bytes / GIB:.2f}")


def report(results: list[Result], rows: list[dict[str, Any]], log: Callable[[str], None] = print, *,
           detail: bool = False) -> tuple[float, float]:
    """Print the per-row table, the bound rows' checks, the rows not scored, and the last line; return (median, max)
    |error| in % over the scored rows."""
    bounds = [r for r in results if r.row["status"] == "bound"]
    results = [r for r in results if r.row["status"] == "scored"]
    log(f"{'id':<36} {'model':<22} {'settings':<50} {'cmp':<9} {'pred GiB':>9} {'meas GiB':>9} {'err':>8}")
    for r in results:
        row = r.row
        log(f"{row['id']:<36} {row['model']:<22} {settings(row):<50} {row['compare']:<9} "
            f"{r.predicted / GIB:>9.2f} {r.measured / GIB:>9.2f} {r.error_pct:>+7.1f}%")
        if detail:
            log(f"    {breakdown(r.memory)}")
    by_source: dict[str, list[float]] = {}
    for r in results:
        by_source.setdefault(r.row["source"], []).append(abs(r.error_pct))
    for source, errs in by_source.items():
        log(f"  {source:<26} {len(errs):>3} runs: median |error| {statistics.median(errs):5.1f}%, max {max(errs):5.1f}%")
    for r in bounds:
        ok = r.predicted <= r.measured
        verdict = "consistent" if ok else "INCONSISTENT: the prediction exceeds the bound"
        log(f"bound (not scored): {r.row['id']}: predicted {r.predicted / GIB:.2f} GiB {'<=' if ok else '>'} measured "
            f"{r.measured / GIB:.2f} GiB ({r.row['compare']}): {verdict}; {r.row['exclude_reason']}")
    for row in rows:
        if row["status"] not in ("scored", "bound"):
            log(f"not scored ({row['status']}): {row['id']}: {row['exclude_reason']}")
    errors = [abs(r.error_pct) for r in results]
    median, worst = statistics.median(errors), max(errors)
    log(f"finetune memory: median error {median:.1f}%, max {worst:.1f}% over {len(results)} runs")
    return median, worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"also write the output to {RESULTS.relative_to(ROOT)}")
    parser.add_argument("--only", default=None, help="score only rows whose id contains this text")
    parser.add_argument("--workers", type=int, default=2, help="profiles run at once (child processes)")
    parser.add_argument("--detail", action="store_true", help="print each row's memory breakdown (GiB)")
    parser.add_argument("--no-cache", action="store_true",
                        help=f"profile every model again (default: reuse profiles in {CACHE_NAME}/ of the optplan "
                             "cache folder made by the same profiler code)")
    args = parser.parse_args(argv)
    sources, rows = load_rows()
    bad = {row.get("id", "?"): check_row(row, sources) for row in rows}
    bad = {k: v for k, v in bad.items() if v}
    if bad:
        print(f"malformed rows in {DATA}: {bad}", file=sys.stderr)
        return 2
    if args.only:
        rows = [r for r in rows if args.only in r["id"]]
    lines: list[str] = []

    def log(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    t0 = time.perf_counter()
    results = run(rows, args.workers, log, None if args.no_cache else cache_dir() / CACHE_NAME)
    took = time.perf_counter() - t0
    body: list[str] = []
    report(results, rows, body.append, detail=args.detail)
    for text in body[:-1]:
        log(text)
    log(f"({took:.0f} s)")
    log(body[-1])
    if args.write:
        versions = ", ".join(f"{d} {importlib.metadata.version(d)}" for d in ("torch", "transformers", "peft"))
        header = f"# python benchmarks/fidelity_finetune_published.py {' '.join(argv or sys.argv[1:])} ({versions})"
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text("\n".join([header, *lines]) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
