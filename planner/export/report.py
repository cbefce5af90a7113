"""``plan.json`` and the human ``PLAN.md``: the recommendation itself, as data and as a readable report."""

from __future__ import annotations

import json

from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import Estimate
from optplan.estimators.strategy import Strategy, sharding_name
from optplan.estimators.units import gib_apart, long_duration, margin_text, sig3
from optplan.planner.export.context import ExportPlan
from optplan.planner.recommend import Recommendation

PLAN_JSON_HINT = "write one with: optplan recommend MODEL --out DIR"


def plan_json_text(rec: Recommendation) -> str:
    """The recommendation as indented JSON (the same document as ``recommend --json``)."""
    return json.dumps(rec.model_dump(mode="json"), indent=2) + "\n"


def load_plan_json(text: str, source: str = "plan.json") -> tuple[Recommendation | None, ExportPlan]:
    """The recommendation and export facts in a plan.json text (OptplanError naming the problem)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OptplanError(f"{source} is not JSON ({exc.msg} at line {exc.lineno}): {PLAN_JSON_HINT}") from None
    if not isinstance(doc, dict) or "plan" not in doc:
        raise OptplanError(f"{source} is not an optplan plan (no 'plan' key): {PLAN_JSON_HINT}")
    if doc.get("export") is None:
        why = "it records no fitting plan" if doc.get("fits") is False else "it has no 'export' section"
        raise OptplanError(f"{source} cannot be exported: {why}; {PLAN_JSON_HINT}")
    try:
        export = ExportPlan.model_validate(doc["export"])
    except ValueError as exc:
        first = str(exc).splitlines()
        raise OptplanError(f"{source} has an invalid 'export' section ({' '.join(first[:3])}): "
                           f"{PLAN_JSON_HINT}") from None
    try:
        rec = Recommendation.model_validate(doc)
    except ValueError:
        rec = None  # an older or hand-edited document: the export section is enough to render launch files
    return rec, export


def _step_band(e: Estimate) -> str:
    """'0.266 [0.207-0.326]': the step time (s) and its band (``time.step_s_low``-``step_s_high``), three significant
    digits each (units.sig3: '0.270', never '0.27' beside '0.326')."""
    t = e.time
    if not t.step_s_high:
        return sig3(t.step_s)
    return f"{sig3(t.step_s)} [{sig3(t.step_s_low)}-{sig3(t.step_s_high)}]"


def _row(e: Estimate, tokens: float | None) -> str:
    s = e.strategy
    m = e.memory
    layout = f"{s.tp}/{s.pp}{f'x{s.vpp}' if s.vpp > 1 else ''}/{s.cp}/{s.dp}"
    sharding = sharding_name(s.engine, s.zero, s.fsdp, sep=" ")
    offload = "+".join(n for n, v in (("opt", s.offload_optimizer), ("params", s.offload_params)) if v != "none")
    train = ""
    if tokens is not None and e.cost is not None:
        train = long_duration(e.cost.train_time_s)
    return (f"| {s.engine} | {layout} | {sharding}{' +' + offload if offload else ''} | {s.precision} | "
            f"{s.mbs} x {s.grad_accum} | {_checkpointing(s)} | {m.total_bytes / 2**30:.1f} / "
            f"{m.capacity_bytes / 2**30:.1f} | {_step_band(e)} | {sig3(e.samples_per_s)} | "
            f"{sig3(e.model_tflops_per_gpu)} | {e.mfu * 100:.0f}% | {train} |")


def _checkpointing(s: Strategy) -> str:
    """The plan's checkpointing in a table cell: the mode, and the count of a partial one (first N blocks)."""
    return s.checkpointing if s.checkpoint_layers is None else f"{s.checkpointing} (first {s.checkpoint_layers} blocks)"


_HEADER = ("| engine | tp/pp/cp/dp | sharding | precision | mbs x accum | checkpointing | GiB/GPU | step s [band] | "
           "samples/s | TFLOP/s/GPU | MFU | train |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def render_plan_md(rec: Recommendation) -> str:
    """PLAN.md: the pick, the predicted figures, the rationale, the runners-up and the Pareto front."""
    c = rec.cluster
    lines = [f"# Training plan for {rec.model}", "",
             f"Model `{rec.model_path}`; cluster: {c.gpus} x {c.gpu} ({c.gpus_per_node} per node, "
             f"{c.memory_bytes / 2**30:.0f} GiB each); objective: {rec.objective}"
             + (f", {rec.tokens:.3g} tokens" if rec.tokens else "") + ".", ""]
    if not rec.fits or rec.plan is None or rec.estimate is None:
        lines += ["**No searched plan fits.**", "", *[f"- {r}" for r in rec.rationale], "", "## What would fit", "",
                  *[f"- {s}" for s in rec.suggestions], ""]
        return "\n".join(lines)
    e = rec.estimate
    s = rec.plan
    need, cap = gib_apart(e.memory.total_bytes, e.memory.capacity_bytes)
    lines += [f"## Plan: `{s.label()}` on {e.gpus} GPUs", "", _HEADER, _row(e, rec.tokens), "",
              "## Predicted", "",
              f"- memory per GPU (worst rank: {e.memory.rank}): {need} GiB of {cap} GiB "
              f"({margin_text(e.memory.headroom_bytes)} free)",
              f"- step: {e.time.step_s:.3f} s for {e.global_batch} samples; {e.samples_per_s:.4g} samples/s"
              + (f", {e.tokens_per_s:,.0f} tokens/s" if e.tokens_per_s else "")
              + (f"; band {e.time.step_s_low:.3f}-{e.time.step_s_high:.3f} s ({e.time.band_basis})"
                 if e.time.step_s_high else ""),
              *[f"- out of the measured domain: {why}" for why in e.time.outside_measured],
              f"- {e.model_tflops_per_gpu:.0f} model TFLOP/s per GPU, MFU {e.mfu * 100:.1f}%, HFU {e.hfu * 100:.1f}%"]
    if e.cost is not None:
        c = e.cost
        money = f", ${c.cost_usd:,.0f}" if c.cost_usd is not None else ""
        band = ""
        if c.train_time_s_low is not None and c.train_time_s_high is not None:
            band = f"; over the step's band {long_duration(c.train_time_s_low)}-{long_duration(c.train_time_s_high)}"
            if c.gpu_hours_low is not None and c.gpu_hours_high is not None:
                band += f", {c.gpu_hours_low:,.0f}-{c.gpu_hours_high:,.0f} GPU-hours"
            if c.cost_usd_low is not None and c.cost_usd_high is not None:
                band += f", ${c.cost_usd_low:,.0f}-${c.cost_usd_high:,.0f}"
            if c.energy_kwh_low is not None and c.energy_kwh_high is not None:
                band += f", {c.energy_kwh_low:,.0f}-{c.energy_kwh_high:,.0f} kWh"
        lines.append(f"- {c.tokens:.3g} tokens in {long_duration(c.train_time_s)}: "
                     f"{c.gpu_hours:,.0f} GPU-hours{money}, {c.energy_kwh:,.0f} kWh{band}")
    lines += ["", "## Why", "", *[f"- {r}" for r in rec.rationale], ""]
    if rec.alternatives:
        lines += ["## Runners-up", "", _HEADER, *[_row(a.estimate, rec.tokens) for a in rec.alternatives], ""]
    if rec.pareto:
        axes = "throughput vs memory headroom" if rec.objective == "throughput" else "time vs cost to train"
        lines += [f"## Pareto front ({axes})", "", _HEADER, *[_row(p.estimate, rec.tokens) for p in rec.pareto], ""]
    if rec.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in rec.notes], ""]
    s = rec.search
    priced = (f"{s.evaluated} candidates priced" if not s.resumed else  # a rerun: the study's record, re-priced
              f"resumed the study: {s.resumed} candidates it recorded re-priced (the earlier run priced more and "
              f"recorded its best), {s.evaluated} new")
    lines += ["## Search", "", f"{s.method}: {priced} of {s.space_size} in the space ({s.feasible} fit); study "
              f"`{s.study_name}`" + (f" in {s.storage}" if s.storage else ""), ""]
    return "\n".join(lines)
