"""The campaign's ``exports`` section (exports.json): ``optplan recommend --out`` for a DeepSpeed and a torch plan of a
model file on this one GPU, then ``optplan validate`` on what was written: ``ds_config.json`` through
``deepspeed.initialize``, ``launch.sh`` through torchrun, ``accelerate.yaml`` through ``accelerate launch`` (on the CPU
the DeepSpeed plan only).

With ``--jobs`` > 1 the two plans are made and validated at once, and ``validate --jobs`` starts a plan's files
together: every run is one process and takes one device lock (``$OPTPLAN_DEVICE_LOCK``, probes/device_lock.py) in
turn, so the imports of five runs overlap and their device work does not."""

from __future__ import annotations

import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from campaign_core import EXAMPLES, Campaign
from campaign_io import ROOT, last_line, run_optplan, write_json

from optplan.probes.device_lock import DEVICE_LOCK_ENV, lock_from_env


def export_one(c: Campaign, engine: str, model: Path, folder: Path, env: dict[str, str]) -> dict[str, Any]:
    """recommend --out into ``folder`` for ``engine``, then validate what was written; the plan's record."""
    if c.left_s() < 30:
        return {"engine": engine, "skipped": "out of time"}
    if engine == "deepspeed" and c.deepspeed_error:
        return {"engine": engine, "skipped": c.deepspeed_error}
    entry: dict[str, Any] = {"engine": engine, "model": str(model.relative_to(ROOT))}
    # --no-probe --no-calibration: the plan is what the analytic search picks (a GPU would start the
    # probe stage by default, which the grid measures on its own)
    gpus = "1" if c.device == "cuda" else "2"
    code, out, err = run_optplan(["recommend", str(model), "--gpus", gpus, *c.plan_args(), "--engine", engine,
                                  "--no-probe", "--no-calibration", "--out", str(folder), "--json"],
                                 timeout_s=max(30.0, min(300.0, c.left_s())), env=env)
    entry["recommend_exit_code"] = code
    if code != 0:
        entry["error"] = last_line(out, err)
        return entry
    rec = json.loads(out)
    entry["plan"] = rec["plan"]
    entry["files"] = sorted(p.name for p in folder.iterdir())
    per_run = int(max(60.0, min(300.0, c.left_s() / (1 if c.jobs > 1 else 3 if engine == "deepspeed" else 2))))
    code, out, err = run_optplan(["validate", str(folder), str(model),
                                  *(["--seq-len", "512"] if c.device == "cuda" else []), "--steps", "2", "--json",
                                  "--timeout", str(per_run), "--jobs", str(c.jobs)],
                                 timeout_s=max(60.0, min(400.0, c.left_s() + 30)), env=env)
    entry["validate_exit_code"] = code
    try:
        report = json.loads(out)
        entry["runs"] = [{"file": Path(r["file"]).name, "how": r["how"], "started": r["started"], "fits": r["fits"],
                          "status": r["comparison"]["result"]["status"],
                          "reason": r["comparison"]["result"]["reason"],
                          "predicted_step_s": r["comparison"]["predicted_step_s"],
                          "measured_step_s": r["comparison"]["result"]["step_s"],
                          "device_wait_s": r["comparison"]["result"].get("device_wait_s"),
                          "quieted_processes": r["comparison"]["result"].get("quieted_processes"),
                          "probe_wall_s": r["comparison"]["result"].get("wall_s"),
                          "notes": r["notes"]} for r in report["runs"]]  # the temporary folder is gone after the run
    except (json.JSONDecodeError, KeyError, TypeError):
        entry["error"] = last_line(out, err)
    return entry


def part_exports(c: Campaign) -> dict[str, Any]:
    """recommend --out for a DeepSpeed and a torch plan on this one GPU (the DeepSpeed plan on the CPU), then validate
    what was written; both plans at once with ``--jobs`` > 1, sharing the device in turn."""
    path = c.out / "exports.json"
    doc = c.doc("exports", plans=[], jobs=c.jobs)
    model = EXAMPLES / ("gpt2.py" if c.device == "cuda" else "mlp.py")
    # CPU: the DeepSpeed plan only (its three files, planned for 2 GPUs, bf16, and run on one process: the batch
    # scaled to it; the torch plan's launch.sh and accelerate.yaml run under `optplan validate` in
    # tests/tui/test_cli_probe.py), a GPU both, planned for its one GPU
    engines = [e for e in (("deepspeed", "torch") if c.device == "cuda" else ("deepspeed",)) if c.wants_engine(e)]
    with tempfile.TemporaryDirectory(prefix="optplan_campaign_exports_") as tmp:
        # the campaign's lock when sections run at once, else one of this section's own
        lock = lock_from_env() or str(Path(tmp) / "device.lock")
        env = {**os.environ, **({DEVICE_LOCK_ENV: lock} if c.jobs > 1 else {})}

        def one(engine: str) -> dict[str, Any]:
            try:
                entry = export_one(c, engine, model, Path(tmp) / engine, env)
            except Exception as exc:  # noqa: BLE001 - one plan's failure is data; the other plan's record stays
                entry = {"engine": engine, "error": [f"{type(exc).__name__}: {exc}"]}
            c.log(f"exports: {engine}: " + (entry.get("skipped") or
                                           f"recommend {entry.get('recommend_exit_code')}, validate "
                                           f"{entry.get('validate_exit_code')}: "
                                           + ", ".join(f"{r['file']} {r['status']}" for r in entry.get("runs", []))))
            return entry

        with ThreadPoolExecutor(max_workers=len(engines) if c.jobs > 1 and engines else 1) as pool:
            for entry in pool.map(one, engines):
                doc["plans"].append(entry)
                write_json(path, doc)
    launched = [r for p in doc["plans"] for r in p.get("runs", [])]
    doc["summary"] = {"launched": len(launched), "ok": sum(r["status"] == "ok" for r in launched),
                      "files": sorted({r["file"] for r in launched if r["status"] == "ok"})}
    write_json(path, doc)
    return doc
