"""The campaign's ``grid`` section (grid.json): recommendation quality. For two models, every configuration of a small
single-GPU grid (precision x checkpointing x micro-batch x engine) is measured for a few steps; the report gives the
planner's pick's rank among them, its measured throughput as a share of the best measured (target >= 97 %) and
Spearman's rank correlation of predicted and measured throughput."""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity  # noqa: E402
import fidelity_suite  # noqa: E402
from campaign_core import EXAMPLES, GRID_SHARE_TARGET, Campaign, device_held_s, measured_case  # noqa: E402
from campaign_io import ROOT, write_json  # noqa: E402
from probe_pool import ProbePool  # noqa: E402

from optplan.estimators.estimate import estimate  # noqa: E402
from optplan.estimators.hardware import Cluster  # noqa: E402
from optplan.estimators.profile import ModelProfile  # noqa: E402
from optplan.estimators.strategy import Strategy  # noqa: E402
from optplan.planner.goal import Goal, rank  # noqa: E402
from optplan.planner.probe_stage import LocalDevices, compare_spec  # noqa: E402
from optplan.planner.recommend import recommend  # noqa: E402
from optplan.probes.runtime import ProbeResult, ProbeSpec  # noqa: E402


# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GridModel:
    key: str
    path: Path
    seq_len: int | None
    precisions: tuple[str, ...]
    checkpointing: tuple[str, ...]
    micro_batches: tuple[int, ...]
    engines: tuple[str, ...]  # "torch" or "deepspeed-zeroN"


def grid_models(device: str, quick: bool, tmp: Path) -> list[GridModel]:
    """Two models per device (one with --quick on the CPU). On a GPU: GPT-2 small and the Llama-3 1B
    layout (benchmarks/fidelity.py's wrapper pins the size whatever $OPTPLAN_LLAMA_SIZE says), seq 1,024."""
    llama1b = fidelity_suite.llama_wrapper(tmp, None, 1024)
    if device == "cpu":
        # --quick: micro-batch 16 alone, 4 runs (a run is mostly a process start on the CPU; 64 repeats them)
        return [GridModel("mlp", EXAMPLES / "mlp.py", None, ("fp32", "amp-bf16"), ("none", "full"),
                          (16,) if quick else (16, 64), ("torch",)),
                GridModel("gpt2", EXAMPLES / "gpt2.py", 64, ("fp32",), ("none", "full"), (1, 2), ("torch",))][
                    : 1 if quick else 2]
    if quick:
        return [GridModel("gpt2", EXAMPLES / "gpt2.py", 1024, ("amp-bf16", "bf16"), ("none", "full"), (4, 16),
                          ("torch",)),
                GridModel("llama1b", llama1b, 1024, ("bf16",), ("none", "full"), (2, 4), ("torch",))]
    # 16 runs per model (about 10 s each on an H200): fits one 10-minute call with the exports and the traces
    return [GridModel("gpt2", EXAMPLES / "gpt2.py", 1024, ("amp-bf16", "bf16"), ("none", "full"), (4, 16),
                      ("torch", "deepspeed-zero1")),
            GridModel("llama1b", llama1b, 1024, ("amp-bf16", "bf16"), ("none", "full"), (2, 4),
                      ("torch", "deepspeed-zero1"))]


def grid_strategy(model: GridModel, precision: str, ckpt: str, mbs: int, engine: str) -> Strategy:
    kwargs: dict[str, Any] = {"precision": precision, "optimizer": "adamw", "mbs": mbs, "checkpointing": ckpt}
    if engine == "torch":
        kwargs["engine"] = "torch"
    else:
        kwargs.update(engine="deepspeed", zero=int(engine.rsplit("zero", 1)[1]))
    return Strategy(**kwargs)


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None below 3 points or without spread."""
    if len(x) < 3:
        return None

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    if not sx or not sy:
        return None
    return sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True)) / (sx * sy)


def _measure(c: Campaign, pool: ProbePool, model: GridModel, profile: ModelProfile, strategy: Strategy) -> ProbeResult:
    ds = fidelity.ds_config(strategy, profile, torch_optimizer=True)  # no fused-Adam JIT build on a visit
    block = profile.repeated_block.class_name if profile.repeated_block else None
    spec = ProbeSpec(model_path=str(model.path), seq_len=model.seq_len, strategy=strategy, block_class=block,
                     ds_config=ds, device=c.device, warmup_steps=1 if c.device == "cpu" else 2,  # type: ignore[arg-type]
                     timed_steps=2 if c.device == "cpu" else 3)
    return pool.run_probe(spec, timeout_s=max(30.0, min(240.0, c.left_s())))


def _price(profile: ModelProfile, cluster: Cluster, strategy: Strategy, device: str) -> Any:
    """The estimate of ``strategy`` as the grid runs it (DeepSpeed with torch's AdamW: :func:`_measure`), so that the
    ranking and the rank correlation compare the predicted and the measured program alike; None when refused."""
    try:
        return estimate(profile, cluster, strategy,
                        adam_impl=fidelity.probe_adam_impl(strategy, device, ds_torch_optimizer=True))
    except Exception:  # noqa: BLE001 - a configuration the estimators refuse is not in the ranking
        return None


def grid_one(c: Campaign, pool: ProbePool, model: GridModel, doc: dict[str, Any],
             save: Callable[[], None]) -> Callable[[], dict[str, Any]]:
    """Start measuring one model's grid (the runs ``pool.jobs`` at a time: submitted now, so that the next model's
    runs queue behind them and start importing while this one's last runs hold the device) and return what records
    the runs and judges recommend's pick on them, in order. With one job the runs are made when recorded."""
    profiled = pool.profile(model.path, model.seq_len).result()
    if profiled.profile is None:
        raise RuntimeError(f"profiling failed: {profiled.error}")
    profile = profiled.profile
    cluster = c.cluster(1)
    runs: list[dict[str, Any]] = []
    shown = str(model.path.relative_to(ROOT)) if model.path.is_relative_to(ROOT) else "examples/llama.py 1B layout"
    entry: dict[str, Any] = {"model": model.key, "path": shown, "seq_len": model.seq_len,
                             "params": profile.params, "runs": runs}
    doc["models"].append(entry)
    measured: dict[Strategy, float] = {}
    predicted: dict[Strategy, float] = {}

    local = LocalDevices(device=c.device, name=c.env["device_name"], count=1,
                         catalogue_name=c.gpu.name if c.gpu is not None else None)
    priced: dict[Strategy, Any] = {}

    def price(strategy: Strategy) -> Any:
        if strategy not in priced:
            priced[strategy] = _price(profile, cluster, strategy, c.device)
        return priced[strategy]

    def measure(strategy: Strategy) -> ProbeResult | None:
        """In a worker: the run (None: out of time)."""
        return None if c.left_s() < 15 else _measure(c, pool, model, profile, strategy)

    def record(strategy: Strategy, why: str, result: ProbeResult | None) -> None:
        if result is None:
            runs.append({"strategy": strategy.label(), "status": "skipped", "reason": "out of time", "why": why})
            return
        est = price(strategy)
        pred = est.samples_per_s if est is not None else None
        meas = (result.samples_per_step / result.step_s) if result.ok and result.step_s else None
        if pred is not None:
            predicted[strategy] = pred
        if meas is not None:
            measured[strategy] = meas
        runs.append({"strategy": strategy.label(), "why": why, "status": result.status, "reason": result.reason,
                     "predicted_samples_per_s": pred, "measured_samples_per_s": meas,
                     "measured_allocated_bytes": result.peak_allocated_bytes, "probe_wall_s": result.wall_s,
                     "device_wait_s": result.device_wait_s, "device_held_s": device_held_s(result),
                     "timeline_s": result.timeline_s, "host_op_s": result.host_op_s,
                     "quieted_processes": result.quieted_processes})
        if result.status in ("ok", "oom") and est is not None:
            # predicted as the probe ran it (CPU accounting on the CPU; DeepSpeed with torch's AdamW: _measure)
            impl = fidelity.probe_adam_impl(strategy, c.device, ds_torch_optimizer=True)
            comp = compare_spec(profile, cluster, strategy, strategy, local, c.time_comparable, result,
                                adam_impl=impl)
            doc["measured"].append(measured_case(c, model.key, profile, comp))
        c.log(f"grid: {model.key} {strategy.label()}: {result.status}"
              + (f", measured {meas:.2f} samples/s" if meas else "")
              + (f", predicted {pred:.2f}" if pred else ""))
        save()

    engines = tuple(e for e in model.engines if not (e.startswith("deepspeed") and c.deepspeed_error))
    if len(engines) < len(model.engines):
        entry["skipped_engines"] = c.deepspeed_error
    grid = [grid_strategy(model, p, k, b, e) for e in engines for p in model.precisions
            for k in model.checkpointing for b in model.micro_batches]
    # the planner's choice among exactly these configurations (its ranking: the band's slow end, then the
    # simplest of the ties), so that the pick and the measured runs share batch and accumulation
    fitting = [e for s in grid if (e := price(s)) is not None and e.fits]
    pick = rank(fitting, Goal())[0].strategy if fitting else None
    entry["pick"] = pick.label() if pick is not None else None
    # recommend's free pick over the same precisions and engines, for information (its global batch and
    # accumulation may differ from the grid's, so it is measured but not ranked)
    rec = recommend(profile, cluster, precisions=list(model.precisions), optimizers=["adamw"],
                    engines=sorted({s.engine for s in grid}) or ["torch"], offload=False)
    entry["recommend_pick"] = rec.plan.label() if rec.plan is not None else None
    todo = [(s, "grid") for s in grid]
    if rec.plan is not None and rec.plan.label() not in {s.label() for s in grid}:
        if c.device == "cpu" and c.quick:  # the MLP's batch of 256 in emulated bf16: ~20 s of CPU for a run not ranked
            entry["recommend_pick_run"] = "not measured in the CPU's --quick run (outside the grid: not ranked)"
        else:
            todo.append((rec.plan, "recommend's free pick (outside the grid: not ranked)"))
    results = pool.ordered(measure, [s for s, _ in todo])  # submitted now with several jobs

    def finish() -> dict[str, Any]:
        """Record the runs in order, then the rank correlation and where the pick ranks."""
        for (s, why), result in zip(todo, results, strict=True):
            record(s, why, result)
        _judge(entry, measured, predicted, grid, pick, rec)
        save()
        return entry

    return finish


def _judge(entry: dict[str, Any], measured: dict[Strategy, float], predicted: dict[Strategy, float],
           grid: list[Strategy], pick: Strategy | None, rec: Any) -> None:
    """Into ``entry``: the rank correlation of predicted and measured throughput, where the pick ranks among the
    grid's measured runs and its share of the best, and recommend's free pick's measured throughput."""
    both = [s for s in measured if s in predicted]
    entry["measured_runs"] = len(measured)
    entry["spearman_predicted_vs_measured"] = spearman([predicted[s] for s in both], [measured[s] for s in both])
    if measured:
        in_grid = {s: v for s, v in measured.items() if s in set(grid)}
        if pick is not None and pick in in_grid:
            best = max(in_grid, key=in_grid.__getitem__)
            entry["best_measured"] = {"strategy": best.label(), "samples_per_s": in_grid[best]}
            order = sorted(in_grid.values(), reverse=True)
            entry["pick_rank"] = order.index(in_grid[pick]) + 1
            entry["pick_share_of_best"] = in_grid[pick] / in_grid[best]
            entry["meets_target"] = entry["pick_share_of_best"] >= GRID_SHARE_TARGET
        if rec.plan is not None and rec.plan in measured:
            entry["recommend_pick_samples_per_s"] = measured[rec.plan]


def _finish_all(doc: dict[str, Any], finishers: list[tuple[GridModel, Callable[[], dict[str, Any]]]],
                save: Callable[[], None]) -> None:
    """Record the started models' runs in order (emptying ``finishers``); one model's failure is its entry's error."""
    while finishers:
        model, finish = finishers.pop(0)
        try:
            finish()
        except Exception as exc:  # noqa: BLE001
            entry = next(m for m in doc["models"] if m.get("model") == model.key)
            entry["error"] = f"{type(exc).__name__}: {exc}"
        save()


def part_grid(c: Campaign) -> dict[str, Any]:
    path = c.out / "grid.json"
    doc = c.doc("grid", gpu=c.gpu_name, time_comparable=c.time_comparable, target_share_of_best=GRID_SHARE_TARGET,
                models=[], measured=[])

    def save() -> None:
        write_json(path, doc)

    with (tempfile.TemporaryDirectory(prefix="optplan_campaign_grid_") as tmp,
          ProbePool(c.jobs, Path(tmp)) as pool):
        models = [m for m in grid_models(c.device, c.quick, Path(tmp)) if c.wants(m.key)]
        if c.jobs > 1:  # every profile ahead, while the first model's runs hold the device
            for model in models:
                pool.profile(model.path, model.seq_len)
        finishers: list[tuple[GridModel, Callable[[], dict[str, Any]]]] = []
        for model in models:
            if c.left_s() < 30:
                doc["models"].append({"model": model.key, "skipped": "out of time"})
                continue
            try:
                finishers.append((model, grid_one(c, pool, model, doc, save)))
            except Exception as exc:  # noqa: BLE001 - one model's failure is data
                doc["models"].append({"model": model.key, "error": f"{type(exc).__name__}: {exc}"})
            save()
            if c.jobs == 1:  # one at a time: this model's runs before the next model is planned (and its time checked)
                _finish_all(doc, finishers, save)
        _finish_all(doc, finishers, save)
    shares = [m["pick_share_of_best"] for m in doc["models"] if "pick_share_of_best" in m]
    doc["summary"] = {"models": len(doc["models"]), "pick_share_of_best": shares,
                      "spearman": [m.get("spearman_predicted_vs_measured") for m in doc["models"]],
                      "meets_target": bool(shares) and all(s >= GRID_SHARE_TARGET for s in shares)}
    save()
    return doc
