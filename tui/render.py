"""Rich renderings of planner results for the command line (no planner logic here)."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from optplan.estimators.estimate import Estimate, StatesEstimate
from optplan.estimators.optimizers import optimizer_state_text
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import UNTAGGED_ENGINE
from optplan.estimators.units import gib
from optplan.planner.goal import TIE_TOLERANCE, band_factor
from optplan.planner.recommend import Recommendation
from optplan.tui.fmt import (
    amount,
    cost_band_text,
    duration,
    gib_text,
    gpu_hours_text,
    long_duration,
    si,
    usd_text,
)

_g = gib_text
_si = si
_duration = duration


def profile_summary(p: ModelProfile) -> Text:
    """One-paragraph model summary."""
    block = (f"{p.repeated_block.count} x {p.repeated_block.class_name}"
             if p.repeated_block else "no repeated block")
    seq = f", seq {p.seq_len}" if p.seq_len else ""
    return Text(f"{p.name} ({p.model_class}): {p.params:,} parameters ({p.trainable_params:,} trainable), "
                f"{block}, {_si(p.train_flops_per_sample)}FLOP/sample fwd+bwd{seq}")


def profile_table(p: ModelProfile) -> Group:
    """The whole profile, readable."""
    head = Table(show_header=False, box=None)
    head.add_column(style="bold")
    head.add_column()
    head.add_row("model", f"{p.name} ({p.model_class}) from {p.path}")
    head.add_row("parameters", f"{p.params:,} unique, {p.trainable_params:,} trainable ({p.param_dtype})")
    if p.repeated_block:
        rb = p.repeated_block
        head.add_row("repeated block", f"{rb.count} x {rb.class_name} ({rb.params_per_block:,} params each)"
                     + (f" at {rb.path}" if rb.path else ""))
    if p.transformer:
        t = p.transformer
        head.add_row("transformer", f"hidden {t.hidden}, layers {t.layers}, heads {t.heads}"
                     + (f", kv heads {t.kv_heads}" if t.kv_heads else "") + (f", vocab {t.vocab}" if t.vocab else ""))
    head.add_row("input", f"{p.input_kind}" + (f", {p.tokens_per_sample} tokens/sample" if p.tokens_per_sample else ""))
    own = (f" (of which {_si(p.self_recompute_flops_per_sample)} re-run by the model's own checkpointing)"
           if p.self_recompute_flops_per_sample > 0 else "")
    head.add_row("FLOPs/sample", f"forward {_si(p.fwd_flops_per_sample)}, backward {_si(p.bwd_flops_per_sample)}{own}")
    cached = ", read from the profile cache (OPTPLAN_PROFILE_CACHE=off profiles again)" if p.from_cache else ""
    if p.torch_version:  # a formula profile (--arch, --params) ran nothing
        head.add_row("profiled in", f"{p.profile_s:.1f} s (torch {p.torch_version}){cached}")
    mods = Table(title="parameters by module", title_justify="left")
    mods.add_column("module")
    mods.add_column("parameters", justify="right")
    for name, n in p.params_by_module.items():
        mods.add_row(name, f"{n:,}")
    acts = Table(title="activation bytes (fixed + per sample)", title_justify="left")
    for col in ("precision", "checkpointing", "fixed MiB", "per sample MiB"):
        acts.add_column(col, justify="right")
    for fit in p.activations:
        acts.add_row(fit.precision, fit.checkpointing, f"{fit.fixed_bytes / 2**20:.1f}",
                     f"{fit.per_sample_bytes / 2**20:.1f}")
    notes = [Text(f"note: {n}", style="dim") for n in p.notes]
    return Group(head, mods, acts, *notes)


ENGINE_LEGEND = f"a plan without an [engine] tag runs on {UNTAGGED_ENGINE}"
"""The plans table's word on its labels' engine tags (estimators/strategy.py ``Strategy.label``)."""
MOMENTS = {"forward": "the model's forward", "loss": "the loss (forward and backward)",
           "backward": "backward, before the first gradient", "grads": "backward, after the first gradient",
           "stem_grads": "backward of the embedding or stem, after the blocks'",
           "backward_end": "the end of backward", "optimizer_step": "the optimizer step"}
"""How the estimate's ``memory.moment`` reads in the tables."""


def _memory_table(e: Estimate | StatesEstimate) -> Table:
    m = e.memory
    where = [f"worst rank: {m.rank}"] if m.rank != "every rank" else []
    if m.moment:
        where.append(f"at its peak moment: {MOMENTS.get(m.moment, m.moment)}")
    mem = Table(title=f"memory per GPU ({e.gpu})", title_justify="left",
                caption="; ".join(where) or None, caption_justify="left")
    mem.add_column("category")
    mem.add_column("GiB", justify="right")
    for name, val in (("weights", m.params_bytes), ("gradients", m.grads_bytes),
                      ("optimizer states", m.optimizer_bytes), ("activations", m.activations_bytes),
                      ("buffers", m.buffers_bytes), ("overhead", m.overhead_bytes)):
        mem.add_row(name, _g(val))
    mem.add_row("[bold]total[/]", f"[bold]{_g(m.total_bytes)}[/] of {_g(m.capacity_bytes)}")
    if m.host_bytes:
        mem.add_row("host (offload)", f"{_g(m.host_bytes)} ({_g(m.host_bytes_per_node)} per node)")
    if m.nvme_bytes:
        mem.add_row("NVMe (offload)", _g(m.nvme_bytes))
    return mem


def _detail_line(e: Estimate | StatesEstimate) -> Text:
    items = ", ".join(f"{name.replace('_', ' ')} {val / 2**20:,.0f} MiB" for name, val in e.memory.detail_bytes.items())
    return Text(f"buffers and overhead: {items}", style="dim")


def estimate_table(e: Estimate | StatesEstimate) -> Group:
    """Memory and time breakdown of one estimate (memory only for a ``--params`` estimate)."""
    verdict = Text(e.reason.replace("fits:", "FITS:", 1).replace("does not fit:", "DOES NOT FIT:", 1),
                   style="green" if e.fits else "red bold")
    if isinstance(e, StatesEstimate):
        head = Text(f"{e.strategy.label()} on {e.gpus} GPU(s): model states, buffers and overhead only")
        return Group(head, verdict, _memory_table(e), _detail_line(e),
                     *(Text(f"note: {n}", style="dim") for n in e.notes))
    t = e.time
    tim = Table(title="step time", title_justify="left")
    tim.add_column("part")
    tim.add_column("ms", justify="right")
    for name, val in (("compute (matmul)", t.compute_s), ("recompute", t.recompute_s),
                      ("memory-bound ops", t.memory_bound_s), ("optimizer", t.optimizer_s),
                      ("pipeline bubble", t.bubble_s), ("host overhead (launches)", t.host_overhead_s),
                      (f"exposed communication (of {t.comm_s * 1e3:.1f})", t.exposed_comm_s)):
        tim.add_row(name, f"{val * 1e3:.1f}")
    tim.add_row("[bold]step[/]", f"[bold]{t.step_s * 1e3:.1f}[/]")
    low, high = _band_ends(e)
    tim.add_row("band", f"{low * 1e3:.1f}-{high * 1e3:.1f}")
    if e.tokens_per_s:
        rate = f"{e.tokens_per_s:,.0f} tokens/s [{_rate_band(e, e.tokens_per_s, '{:,.0f}')}]"
    else:
        rate = f"{e.samples_per_s:,.1f} samples/s [{_rate_band(e, e.samples_per_s, '{:,.1f}')}]"
    summary = Text(f"{e.strategy.label()} on {e.gpus} GPU(s): global batch {e.global_batch}, {rate}, "
                   f"MFU {e.mfu * 100:.1f}%, HFU {e.hfu * 100:.1f}%"
                   + (" (of the dense 16-bit peak, as published fp8 runs state them)"
                      if get_recipe(e.strategy.precision).compute_dtype == "fp8" else "")
                   + f", {e.model_tflops_per_gpu:.1f} TFLOP/s per GPU")
    rec = get_recipe(e.strategy.precision)
    recipe = Text(f"precision {e.strategy.precision}: {rec.description}; "
                  f"{optimizer_state_text(e.strategy.optimizer, rec)}", style="dim")
    basis = [Text(f"time band: {t.band_basis}", style="dim")] if t.band_basis else []
    parts: list = [summary, verdict, recipe, _memory_table(e), _detail_line(e), tim, *basis,
                   *(Text(f"note: {n}", style="dim") for n in e.notes)]
    if e.cost is not None:
        c = e.cost
        money = f", {usd_text(c.cost_usd)}" if c.cost_usd is not None else ""
        parts.append(Text(f"{c.tokens:.3g} tokens: {long_duration(c.train_time_s)}, {gpu_hours_text(c.gpu_hours)}"
                          f"{money}, {amount(c.energy_kwh)} kWh of GPU power{cost_band_text(c)}"))
    return Group(*parts)


def _band_ends(e: Estimate) -> tuple[float, float]:
    """The step time's band (s): ``time.step_s_low``-``step_s_high``; the step itself when it has none."""
    t = e.time
    return (t.step_s_low or t.step_s), (t.step_s_high or t.step_s)


def _rate_band(e: Estimate, rate: float, fmt: str) -> str:
    """'slow-fast' of a rate (samples or tokens per second) over the step time's band (goal.band_factor, as the
    search ranks them)."""
    return f"{fmt.format(rate / band_factor(e, 'slow'))}-{fmt.format(rate / band_factor(e, 'fast'))}"


def _step_cell(e: Estimate) -> str:
    """'412 ms' over '[370-430]': the step time and its band, the band's ends in the step's unit with at most
    9 characters (whole ms; 0.1 s under 10 s; whole seconds above)."""
    low, high = _band_ends(e)
    step = e.time.step_s
    if step < 1:
        return f"{_duration(step)}\n[{low * 1e3:.0f}-{high * 1e3:.0f}]"
    digits = 1 if high < 10 else 0
    return f"{_duration(step)}\n[{low:.{digits}f}-{high:.{digits}f}]"


def _rate(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e4 else f"{n:,.1f}"


def plans_table(rec: Recommendation) -> Table:
    """The pick and its runners-up: memory per GPU by category against usable capacity, speed, MFU.

    States = weights + gradients + optimizer states; other = buffers + overhead (``optplan estimate``
    and --json give every category). Under each step time, its band in brackets (``time.step_s_low``-
    ``step_s_high``, the step's unit); throughput varies inversely. Fits an 80-column terminal.
    """
    usable = _g(rec.estimate.memory.capacity_bytes) if rec.estimate else "?"
    rows = ([rec.estimate] if rec.estimate else []) + [a.estimate for a in rec.alternatives]
    # the band's legend where a row has a step time (--params plans price memory only)
    legend = (Text("[band]: where the step time lies, from measured runs' errors (wider outside them); throughput "
                   "varies inversely; ranked by the band's slow end, the simplest of the plans within "
                   f"{TIE_TOLERANCE:.0%} of the best first (\"why this plan\" says which); {ENGINE_LEGEND}",
                   style="dim")
              if any(isinstance(e, Estimate) for e in rows) else Text(ENGINE_LEGEND, style="dim"))
    table = Table(title=f"best plans (GiB per GPU, {usable} usable)", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False, caption=legend, caption_justify="left")
    counts = len({e.gpus for e in rows}) > 1  # a --gpus-range search: each row says on how many GPUs
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("plan", overflow="fold")
    for col in ("states", "acts", "other", "total", "step", "tokens/s" if rec.seq_len else "samples/s",
                "MFU"):
        table.add_column(col, justify="right", no_wrap=True)
    for i, e in enumerate(rows, start=1):
        m = e.memory
        timed = isinstance(e, Estimate)
        rate = (e.tokens_per_s or e.samples_per_s) if timed else 0.0
        label = f"{e.gpus} GPUs: {e.strategy.label()}" if counts else e.strategy.label()
        table.add_row(str(i), Text(label), _g(m.params_bytes + m.grads_bytes + m.optimizer_bytes),
                      _g(m.activations_bytes), _g(m.buffers_bytes + m.overhead_bytes),
                      _g(m.total_bytes), _step_cell(e) if timed else "-", _rate(rate) if timed else "-",
                      f"{e.mfu * 100:.0f}%" if timed else "-", style="bold green" if i == 1 else None)
    return table


def probes_table(rec: Recommendation) -> Table | None:
    """Predicted vs measured for every probed candidate (``recommend --probe``)."""
    report = rec.probes
    if report is None or not report.probed:
        return None
    where = f"{report.nproc} x {report.device_name}" if report.device == "cuda" else f"CPU ({report.device_name})"
    table = Table(title=f"probes on {where}: predicted vs measured ({report.spent_s:.0f} s of "
                        f"{report.budget_s:.0f} s budget)", box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("candidate → probed as", "status", "step: predicted → measured", "peak GiB: predicted → measured"):
        table.add_column(col, overflow="fold")
    for c in report.probed:
        r = c.result
        t_err = f" ({100 * (c.time_ratio - 1):+.0f}%)" if c.time_ratio is not None else ""
        m_err = f" ({100 * (c.memory_ratio - 1):+.1f}%)" if c.memory_ratio is not None else ""
        status = r.status if r.status == "ok" else f"{r.status}: {r.reason}"[:80]
        step = (f"{_duration(c.predicted_step_s) if c.predicted_step_s else '-'} → "
                f"{_duration(r.step_s) if r.step_s else '-'}{t_err}")
        peak = (f"{gib(c.predicted_allocated_bytes):.2f} → "
                f"{f'{gib(r.peak_allocated_bytes):.2f}' if r.peak_allocated_bytes is not None else '-'}{m_err}")
        table.add_row(Text(f"{c.candidate.label()} → dp {c.probed.dp} mbs {c.probed.mbs} gas {c.probed.grad_accum}"),
                      Text(status), step, peak)
    return table


def _screen_text(rec: Recommendation) -> str:
    """', 100 of 2,517 layouts in full' for a screened search (planner/search.py), else ''."""
    s = rec.search
    if s.method != "screen":
        return ""
    return f": {s.layouts - s.layouts_screened_out:,} of {s.layouts:,} layouts in full, the rest by a probe"


def print_recommendation(console: Console, rec: Recommendation, profile: ModelProfile) -> None:
    """The full human report of a recommendation."""
    console.print(profile_summary(profile))
    c = rec.cluster
    size = f"{c.gpus}" if not c.gpu_counts else f"{min(c.gpu_counts)}-{max(c.gpu_counts)} (searched)"
    s = rec.search
    searched = (f"searched {s.evaluated} plans" if not s.resumed else
                f"resumed the study in {s.storage or 'its storage'}: {s.resumed} plans it recorded re-priced "
                f"(the earlier run priced more and recorded its best), {s.evaluated} new")
    console.print(f"cluster: {size} x {c.gpu} ({_g(c.memory_bytes)} GiB each, {c.gpus_per_node} per node"
                  f"{', detected' if c.detected else ''}); {searched} "
                  f"({s.method}{_screen_text(rec)}), {s.feasible} fit")
    for note in rec.notes:
        console.print(f"note: {note}", style="dim")
    probes = probes_table(rec)
    if probes is not None:
        console.print(probes)
    if rec.fits:
        console.print(plans_table(rec))
        if isinstance(rec.estimate, Estimate):  # the pick's own caveats: out of the measured domain, ...
            for note in rec.estimate.notes:
                if note not in rec.notes:
                    console.print(Text(f"note (#1): {note}", style="dim"))
        console.print(Panel(Text("\n".join(f"- {line}" for line in rec.rationale)), title="why this plan",
                            title_align="left"))
        cost = rec.estimate.cost if isinstance(rec.estimate, Estimate) else None
        if cost is not None:
            money = f", {usd_text(cost.cost_usd)}" if cost.cost_usd is not None else ""
            console.print(f"to train {cost.tokens:.3g} tokens: {long_duration(cost.train_time_s)} on "
                          f"{rec.estimate.gpus} GPUs, {gpu_hours_text(cost.gpu_hours)}{money}, "
                          f"{amount(cost.energy_kwh)} kWh of GPU power{cost_band_text(cost)}")
        if rec.pareto:
            axes = "throughput vs headroom" if rec.objective == "throughput" else "time vs cost"
            n = len(rec.pareto)
            console.print(f"Pareto front ({axes}): {n} plan{'s' if n != 1 else ''} (in --json and PLAN.md)", style="dim")
    else:
        console.print(Panel(Text("\n".join([rec.rationale[0], "", "what would fit:"]  # Text: "[megatron]" is no markup
                                           + [f"- {s}" for s in rec.suggestions])),
                            title="NO PLAN FITS", title_align="left", border_style="red"))
