"""The campaign's ``launch`` section (issues 16 and 17): what a user does with a plan, end to end, on this machine.

For each engine (a torch plan and a DeepSpeed plan on a GPU; the torch plan on the CPU):

1. ``optplan recommend MODEL --gpus 1 --out DIR`` (analytic search, no probe, no calibration: the plan a first user
   gets);
2. ``bash DIR/launch.sh --steps N`` exactly as written: torchrun starts the exported ``train.py``, which applies the
   plan, prints measured against predicted every few steps and writes ``measurements.json`` (on the CPU, train.py
   runs under optplan's live-tensor tracker, ``python -m optplan.probes.runtime_child --train-script``, as CPU
   memory has no allocator counters for calibrate to take);
3. ``optplan calibrate measurements.json`` into an empty calibration cache (``$OPTPLAN_CACHE_DIR`` set to a
   temporary folder, as a user's own cache would be): its report says how much that run's prediction improves;
4. ``optplan recommend`` again with that cache: the next plan, its prediction, and whether the pick changed.

The record (``launch.json``) keeps the plans, the lines train.py printed, its ``measurements.json`` (step times,
peak allocated and reserved memory, MFU), the calibration's before/after errors and the second plan.

With ``--jobs`` > 1 the two engines' chains run at once: their recommend and calibrate steps overlap, and each
launch holds one lock file for its whole run (train.py is the user's own program and takes no lock itself), so the
launches are one at a time; the other engine's recommend or calibrate may share the host's CPU with a launch's
timed steps (a few of the machine's cores: ``--jobs 1`` runs them one after another).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from campaign_core import EXAMPLES, Campaign
from campaign_io import ROOT, last_line, run_command, run_optplan, write_json

from optplan.estimators.strategy import Strategy
from optplan.probes.device_lock import DEVICE_LOCK_ENV, held, lock_from_env

STEPS_GPU, STEPS_CPU = 8, 3
"""Optimizer steps train.py runs: on a GPU two warm-up steps and six timed; on the CPU the fewest that time one."""


def launch_one(c: Campaign, engine: str, model: Path, work: Path, lock: Path | None = None) -> dict[str, Any]:
    """Steps 1-4 of the module docstring for one engine; every step's outcome is in the returned record. ``lock``:
    held around step 2 (the launch), so that engines run together take the device in turn."""
    entry: dict[str, Any] = {"engine": engine, "model": str(model.relative_to(ROOT))}
    folder, cache = work / engine, work / f"{engine}-cache"
    cache.mkdir(parents=True, exist_ok=True)
    # torchrun (or deepspeed's launcher) from this interpreter's environment, as an activated venv would give
    env = {**os.environ, "OPTPLAN_CACHE_DIR": str(cache),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    args = ["recommend", str(model), "--gpus", "1", *c.plan_args(), "--engine", engine, "--no-probe", "--json"]
    out = _ran(entry, "recommend_exit_code",
               run_optplan([*args, "--no-calibration", "--out", str(folder)], max(30.0, min(300.0, c.left_s())), env=env))
    if out is None:
        return entry
    first = json.loads(out)
    entry["first_plan"] = first["plan"]
    entry["first_predicted"] = _predicted(first)
    steps = STEPS_GPU if c.device == "cuda" else STEPS_CPU
    measurements = folder / "measurements.json"
    train_args = ["--steps", str(steps), "--warmup", "2", "--log-every", "2", "--measurements", str(measurements)]
    if c.device == "cuda":
        how = ["bash", str(folder / "launch.sh")]
    else:  # CPU memory is measured under optplan's live-tensor tracker (calibrate takes no CPU run without it)
        how = [sys.executable, "-m", "optplan.probes.runtime_child", "--train-script", str(folder / "train.py"), "--"]
    entry["how"] = " ".join(Path(how[0]).name if i == 0 else a for i, a in enumerate(how)).replace(str(folder), "DIR")
    launch_env = {k: v for k, v in env.items() if k != DEVICE_LOCK_ENV}  # held here: nothing under it may wait for it
    with held(lock):
        code, out, err = run_command([*how, *train_args], max(60.0, min(300.0, c.left_s())), cwd=folder,
                                     env=launch_env)
    entry["launch_output"] = [line for line in out.splitlines() if line.strip()][-8:]
    if _ran(entry, "launch_exit_code", (code, out, err)) is None:
        return entry
    if not measurements.is_file():
        entry["error"] = [f"train.py exited 0 without writing {measurements.name}"]
        return entry
    entry["measurements"] = json.loads(measurements.read_text())
    out = _ran(entry, "calibrate_exit_code", run_optplan(["calibrate", str(measurements), "--json"], 120.0, env=env))
    if out is None:
        return entry
    entry["calibrations"] = json.loads(out)["calibrations"]
    out = _ran(entry, "recalibrated_recommend_exit_code",
               run_optplan(args, max(30.0, min(300.0, c.left_s())), env=env))
    if out is None:
        return entry
    second = json.loads(out)
    entry["second_plan"] = second["plan"]
    entry["second_predicted"] = _predicted(second)
    entry["second_calibration"] = second.get("calibration")
    return entry


def _ran(entry: dict[str, Any], key: str, result: tuple[int, str, str]) -> str | None:
    """Record a command's exit code under ``key``: its stdout when it succeeded, else None with its last line as the
    entry's ``error``."""
    code, out, err = result
    entry[key] = code
    if code != 0:
        entry["error"] = last_line(out, err)
        return None
    return out


def _predicted(rec: dict[str, Any]) -> dict[str, Any]:
    """recommend --json's prediction for its pick: step time and band (s), memory (bytes), MFU."""
    est = rec.get("estimate") or {}
    t, m = est.get("time") or {}, est.get("memory") or {}
    return {"step_s": t.get("step_s"), "step_s_low": t.get("step_s_low"), "step_s_high": t.get("step_s_high"),
            "mfu": t.get("mfu"), "total_bytes": m.get("total_bytes"), "outside_measured": t.get("outside_measured")}


def _ms(predicted: dict[str, Any]) -> str:
    step = predicted.get("step_s")
    return "n/a" if step is None else f"{step * 1e3:.0f} ms"


def _label(plan: dict[str, Any]) -> str:
    """A plan's short label (``bf16 ZeRO-0 mbs64x8 [deepspeed]``)."""
    return Strategy.model_validate(plan).label()


def _line(engine: str, entry: dict[str, Any], device: str) -> str:
    """The campaign log's line for one engine's launch."""
    if "error" in entry:
        return f"launch: {engine}: {entry['error'][0] if entry['error'] else 'failed'}"
    measured = entry["measurements"]["measured"]
    fit = (entry.get("calibrations") or [{}])[0]
    applied = ("calibrated" if entry.get("second_calibration") else
               "a CPU run calibrates CPU memory only: no GPU plan uses it" if device == "cpu" else "calibration NOT applied")

    def change(what: str) -> str:
        before, after = fit.get(f"{what}_error_before_pct"), fit.get(f"{what}_error_after_pct")
        return "n/a" if before is None or after is None else f"{before:.1f}% -> {after:.1f}%"

    return (f"launch: {engine}: {_label(entry['first_plan'])}: measured {measured['step_s'] * 1e3:.0f} ms vs predicted "
            f"{_ms(entry['first_predicted'])}; calibrate: step time error {change('time')}, "
            f"memory error {change('memory')}; next plan {_label(entry['second_plan'])} predicted {_ms(entry['second_predicted'])} "
            f"({applied})")


def part_launch(c: Campaign) -> dict[str, Any]:
    """Recommend, launch the exported launch.sh, calibrate on its measurements.json, recommend again."""
    path = c.out / "launch.json"
    doc = c.doc("launch", runs=[])
    model = EXAMPLES / ("gpt2.py" if c.device == "cuda" else "mlp.py")
    engines = [e for e in (("torch", "deepspeed") if c.device == "cuda" else ("torch",)) if c.wants_engine(e)]
    with tempfile.TemporaryDirectory(prefix="optplan_campaign_launch_") as tmp:
        # the campaign's lock when sections run at once, else one of this section's own
        lock = Path(lock_from_env() or Path(tmp) / "device.lock") if c.jobs > 1 else None

        def one(engine: str) -> dict[str, Any]:
            if c.left_s() < 60:
                return {"engine": engine, "skipped": "out of time"}
            if engine == "deepspeed" and c.deepspeed_error:
                return {"engine": engine, "skipped": c.deepspeed_error}
            try:
                entry = launch_one(c, engine, model, Path(tmp), lock)
                c.log(_line(engine, entry, c.device))
            except Exception as exc:  # noqa: BLE001 - one engine's failure is data; the other engine's record stays
                entry = {"engine": engine, "error": [f"{type(exc).__name__}: {exc}"]}
                c.log(f"launch: {engine}: {entry['error'][0]}")
            return entry

        # --jobs > 1: the engines' chains at once; their recommend and calibrate steps (CPU) overlap, their
        # launches take the device in turn
        with ThreadPoolExecutor(max_workers=len(engines) if c.jobs > 1 and engines else 1) as pool:
            for entry in pool.map(one, engines):
                doc["runs"].append(entry)
                write_json(path, doc)
    doc["summary"] = {"launched": sum("measurements" in r for r in doc["runs"]),
                      "calibrated": sum("second_plan" in r for r in doc["runs"])}
    write_json(path, doc)
    return doc
