"""Rationale: one line per decision of the chosen plan, each naming the number that drove it.

A decision is explained by its neighbours: the same plan with that one choice changed, priced on demand
(``price``), or the best searched plan that differs in it. Lines say what the alternative would cost
(samples/s, GiB per GPU against the capacity, time or money to train). Two lines are about how sure the
pick is: the simplicity tie-break (planner/simplicity.py) when it changed the pick, and the predicted MFU
against the best MFU ever measured on that GPU and precision (estimators/uncertainty.py ``mfu_envelope``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from optplan.estimators.allocator_overhead import needed_bytes
from optplan.estimators.estimate import Estimate
from optplan.estimators.optimizers import optimizer_state_text
from optplan.estimators.precision import get_recipe
from optplan.estimators.selective import runs_op_policy
from optplan.estimators.strategy import Strategy
from optplan.estimators.uncertainty import derived_from, mfu_envelope, precision_class
from optplan.estimators.units import gib
from optplan.planner.goal import TIE_TOLERANCE, Goal, band_factor, rank_by_figure
from optplan.planner.simplicity import TIE_CRITERIA, tie_break, tie_key
from optplan.planner.space import Layout, SearchSpace

Price = Callable[[Strategy], "Estimate | None"]


def _gib(n: float) -> str:
    return f"{gib(n):.1f} GiB"


def _days(seconds: float) -> str:
    return f"{seconds / 86400:.1f} days" if seconds >= 86400 else f"{seconds / 3600:.1f} h"


def _neighbour(price: Price, pick: Strategy, **change: object) -> Estimate | None:
    """The pick with ``change`` applied, priced; None when that combination is not legal."""
    if "checkpointing" in change and "checkpoint_layers" not in change:
        change = {**change, "checkpoint_layers": None}  # a count belongs to full checkpointing only
    try:
        other = Strategy(**{**pick.model_dump(), **change})
    except ValueError:
        return None
    return price(other)


def _vs(pick: Estimate, other: Estimate) -> str:
    """How ``other`` compares: its throughput, or its memory when it does not fit."""
    if not other.fits:
        return f"needs {_gib(other.memory.total_bytes)} > {_gib(other.memory.capacity_bytes)} per GPU"
    return f"{other.samples_per_s:.1f} vs {pick.samples_per_s:.1f} samples/s"


def _best(ranked: Sequence[Estimate], keep: Callable[[Strategy], bool]) -> Estimate | None:
    """The best-ranked estimate whose strategy passes ``keep`` (feasible preferred: ranked is sorted)."""
    return next((e for e in ranked if keep(e.strategy)), None)


def _step(seconds: float) -> str:
    """A step-sized duration: '412 ms' or '3.27 s'."""
    return f"{seconds * 1e3:,.0f} ms" if seconds < 1 else f"{seconds:,.3g} s"


def _band(lo: float, hi: float, fmt: str) -> str:
    """' [lo-hi]' in ``fmt``: the band of a figure, low end first."""
    return f" [{fmt.format(min(lo, hi))}-{fmt.format(max(lo, hi))}]"


def _rate_band(e: Estimate) -> str:
    """Samples/s and its band: at the band's slow end (step_s_high) and fast end (step_s_low)."""
    return (f"{e.samples_per_s:,.1f} samples/s"
            + _band(e.samples_per_s / band_factor(e, "slow"), e.samples_per_s / band_factor(e, "fast"), "{:,.1f}"))


def _time_band(goal: Goal, e: Estimate) -> str:
    return _days(goal.train_time_s(e)) + _band(goal.train_time_s(e, "fast") / _unit(goal.train_time_s(e)),
                                               goal.train_time_s(e, "slow") / _unit(goal.train_time_s(e)), "{:.1f}")


def _unit(seconds: float) -> float:
    """The unit ``_days`` writes ``seconds`` in (s)."""
    return 86400.0 if seconds >= 86400 else 3600.0


def _hours_band(goal: Goal, e: Estimate) -> str:
    return f"{goal.gpu_hours(e):,.0f} GPU-hours" + _band(goal.gpu_hours(e, "fast"), goal.gpu_hours(e, "slow"), "{:,.0f}")


def _headline(pick: Estimate, evaluated: int, goal: Goal, simplest: bool = False) -> str:
    """What was picked and its figures with their bands; ``simplest``: the tie-break chose it (see ``_ties_line``)."""
    figures = (f"{_rate_band(pick)}, {pick.model_tflops_per_gpu:.0f} TFLOP/s per GPU, "
               f"{pick.mfu * 100:.0f}% MFU, {pick.reason}")
    lead = "simplest of the plans tied with the " if simplest else ""
    slow_end = "" if simplest else " (at the band's slow end)"
    if goal.objective == "throughput" or goal.tokens is None:
        return f"{lead}fastest feasible{slow_end} of {evaluated} candidates priced: {figures}"
    money = (f", ${goal.gpu_hours(pick) * goal.price_per_gpu_hour:,.0f}" if goal.price_per_gpu_hour is not None
             else "")
    cost = f"{_hours_band(goal, pick)}{money}"
    if goal.objective == "time" and goal.deadline_s is not None:
        level = goal.deadline_class(pick)
        deadline = _days(goal.deadline_s)
        late = _days(goal.train_time_s(pick) - goal.deadline_s)
        met = (f"meets the {deadline} deadline",
               f"meets the {deadline} deadline at the nominal time only: the band's slow end is past it",
               f"misses the {deadline} deadline by {late}")[level]
        what = (f"fewest GPUs ({pick.gpus}) that train {goal.tokens:.3g} tokens by the deadline" if level < 2 else
                f"fastest plan ({pick.gpus} GPUs) to train {goal.tokens:.3g} tokens, none meeting the deadline")
        return f"{lead}{what} of {evaluated} candidates priced: {_time_band(goal, pick)} ({met}), {cost}; {figures}"
    what = "fastest to train" if goal.objective == "time" else "cheapest to train"
    return (f"{lead}{what}{slow_end} {goal.tokens:.3g} tokens of {evaluated} candidates priced: {_time_band(goal, pick)}, "
            f"{cost}; {figures}")


def _ties_line(pick: Estimate, ranked: Sequence[Estimate], goal: Goal) -> str | None:
    """When the simplicity tie-break changed the pick: how many plans tied with the best by the robust figure,
    the best with its band, and the criterion (simplicity.CRITERIA) that chose the pick over it."""
    tb = tie_break(rank_by_figure(tuple(ranked), goal), goal)
    if tb is None or not tb.changed or tb.chosen.strategy != pick.strategy or tb.criterion is None:
        return None
    best = tb.best
    if goal.objective == "throughput" or goal.tokens is None:
        who, figure = "fastest", _rate_band(best)
    elif goal.objective == "time":
        who, figure = "fastest to train", _time_band(goal, best)
    else:
        who, figure = "cheapest to train", _hours_band(goal, best)
    others = len(tb.tied) - 1
    lead = (f"ties: {others} plan{'s' if others != 1 else ''} within {TIE_TOLERANCE:.0%} (the time model's "
            f"typical error) of the {who} at the band's slow end ({best.strategy.label()} at {figure}); ")
    i = TIE_CRITERIA.index(tb.criterion)
    detail = f"{tie_key(pick)[i]} vs {tie_key(best)[i]}"
    return lead + f"picked the simplest: {tb.criterion} ({detail})"


def _margin_line(pick: Estimate, ranked: Sequence[Estimate], goal: Goal) -> str | None:
    """When faster plans were passed over because they fit only at the median of the measured allocator margins
    (Goal.class_key): how many, the fastest of them and what it needs at the 90th percentile."""
    if pick.fits_at_high_margin is False:
        return None
    risky = [e for e in ranked if e.fits and e.fits_at_high_margin is False and goal.figure(e) < goal.figure(pick)]
    if not risky:  # faster by the robust figure (the band's slow end), the ranking's own measure
        return None
    best = min(risky, key=goal.figure)
    need = needed_bytes(best.memory.total_bytes - best.memory.overhead_bytes, best.strategy, "high")
    n = len(risky)
    return (f"memory margin: {n} plan{'s' if n != 1 else ''} faster at the band's slow end fit{'' if n != 1 else 's'} "
            f"only at the median of "
            f"the allocator margins measured, and may run out of memory (the fastest, {best.strategy.label()}: "
            f"{_step(best.time.step_s)} a step, {_gib(best.memory.total_bytes)} of {_gib(best.memory.capacity_bytes)} "
            f"at the median, {_gib(int(need))} at the 90th percentile); this plan fits at the 90th percentile")


def _envelope_line(pick: Estimate) -> str:
    """The predicted MFU against the best MFU measured on this GPU (or the GPU its figures derive from) and
    precision class; unmeasured ones are said to be so."""
    cls = precision_class(pick.strategy.precision)
    envelope = mfu_envelope(pick.gpu, pick.strategy.precision)
    derivation = derived_from(pick.gpu)
    source = derivation.from_gpu if derivation is not None else None
    where = f"{pick.gpu}" + (f" (figures derived from {source})" if source else "")
    if envelope is None:
        return (f"MFU: no run on {where} in {cls} precision was ever measured, so the predicted "
                f"{pick.mfu:.0%} MFU and the step time are uncertain (step {_step(pick.time.step_s)}, band "
                f"{_step(pick.time.step_s_low)}-{_step(pick.time.step_s_high)})")
    if pick.mfu > envelope and _step(pick.time.step_s * pick.mfu / envelope) == _step(pick.time.step_s):
        return (f"MFU: the predicted {pick.mfu:.1%} is at the best measured MFU for {where} in {cls} precision "
                f"({envelope:.1%}): the edge of what was measured")
    if pick.mfu > envelope:
        return (f"MFU: the predicted {pick.mfu:.0%} is above the best measured MFU for {where} in {cls} precision "
                f"({envelope:.0%}): the time is optimistic; at the measured best the step would take "
                f"{_step(pick.time.step_s * pick.mfu / envelope)}, not {_step(pick.time.step_s)}")
    return ""


def _gpus_line(pick: Estimate, ranked: Sequence[Estimate], space: SearchSpace, goal: Goal) -> str | None:
    counts = space.gpu_counts
    if len(counts) < 2:
        return None
    parts = []
    fewer = _best(ranked, lambda s: s.world_size < pick.gpus)
    more = _best(ranked, lambda s: s.world_size > pick.gpus)
    for label, other in (("fewer", fewer), ("more", more)):
        if other is None:
            continue
        if not other.fits:
            parts.append(f"{label} GPUs ({other.gpus}) do not fit ({_gib(other.memory.total_bytes)} per GPU)")
        elif goal.tokens is not None:
            level = goal.deadline_class(other)
            meets = ("", f" (past the deadline at the band's slow end, {_days(goal.train_time_s(other, 'slow'))})",
                     " (misses the deadline)")[level]
            parts.append(f"{other.gpus} GPUs: {_days(goal.train_time_s(other))}, {goal.gpu_hours(other):,.0f} "
                         f"GPU-hours{meets}")
        else:
            parts.append(f"{other.gpus} GPUs: {other.samples_per_s:.1f} samples/s")
    span = f"{counts[0]}-{counts[-1]}"
    return f"{pick.gpus} GPUs of the {span} searched" + (": " + "; ".join(parts) if parts else "")


def _layout_line(pick: Estimate, ranked: Sequence[Estimate]) -> str:
    s = pick.strategy
    degrees = f"tp {s.tp}, pp {s.pp}" + (f" (vpp {s.vpp})" if s.vpp > 1 else "") + f", cp {s.cp}, dp {s.dp}"
    if not s.model_parallel:
        mp = _best(ranked, lambda o: o.model_parallel and o.world_size == s.world_size)  # on as many GPUs
        states = pick.memory.params_bytes + pick.memory.grads_bytes + pick.memory.optimizer_bytes
        line = f"no model parallelism ({degrees}): model states of {_gib(states)}/GPU fit with data parallelism"
        if mp is not None:
            line += f"; the best tensor/pipeline plan ({mp.strategy.label()}) {_vs(pick, mp)}"
        return line
    parts = []
    for name, what, fewer in (("tp", "tensor parallelism", "less"), ("pp", "pipeline stages", "fewer"),
                              ("cp", "context parallelism", "less")):
        mine = getattr(s, name)
        less = _best(ranked, lambda o, n=name, m=mine: getattr(o, n) < m and o.world_size == s.world_size)
        more = _best(ranked, lambda o, n=name, m=mine: getattr(o, n) > m and o.world_size == s.world_size)
        if less is not None:
            parts.append(f"{fewer} {what} ({name} {getattr(less.strategy, name)}, {less.strategy.label()}) "
                         f"{_vs(pick, less)}")
        elif more is not None and mine == 1:
            parts.append(f"{what} ({name} {getattr(more.strategy, name)}) {_vs(pick, more)}")
    return f"layout {degrees} = {s.world_size} GPUs" + (": " + "; ".join(parts) if parts else "")


def _sharding_line(pick: Estimate, price: Price, ranked: Sequence[Estimate], goal: Goal) -> str:
    s = pick.strategy
    m = pick.memory
    states = m.params_bytes + m.grads_bytes + m.optimizer_bytes
    if s.engine == "torch":
        if s.fsdp == "none":
            alt = _neighbour(price, s, fsdp="full")
            tail = f"; FSDP FULL_SHARD {_vs(pick, alt)}" if alt is not None and s.dp > 1 else ""
            return f"torch DDP: model states of {_gib(states)}/GPU fit unsharded{tail}"
        alt = _neighbour(price, s, fsdp="none", offload_params="none")
        what = {"full": "FULL_SHARD (ZeRO-3-like)", "grad_op": "SHARD_GRAD_OP (ZeRO-2-like)",
                "hybrid": "HYBRID_SHARD (shard in a node, replicate across)"}[s.fsdp]
        tail = f"; unsharded DDP {_vs(pick, alt)}" if alt is not None else ""
        return f"torch FSDP {what}: model states {_gib(states)}/GPU{tail}"
    if s.engine == "megatron":
        name = "distributed optimizer (ZeRO-1)" if s.zero == 1 else "no optimizer sharding"
        alt = _neighbour(price, s, zero=1 - s.zero)
        tail = f"; {'without' if s.zero else 'with'} it {_vs(pick, alt)}" if alt is not None and s.dp > 1 else ""
        if s.comm_overlap:
            flags = (["--tp-comm-overlap"] if s.tp > 1 else []) + ["--overlap-grad-reduce"] + (
                ["--overlap-param-gather"] if s.zero == 1 else [])
            tail += f"; communication overlapped ({' '.join(flags)}, estimators/tp_overlap.py)"
            plain = _neighbour(price, s, comm_overlap=False)
            if plain is not None:
                tail += f", without {_vs(pick, plain)}"
        return f"Megatron-LM, {name} over dp {s.dp}: optimizer states {_gib(m.optimizer_bytes)}/GPU{tail}"
    if s.zero == 0:
        line = f"DeepSpeed ZeRO-0 (plain data parallel): model states of {_gib(states)}/GPU fit unsharded"
        higher = _neighbour(price, s, zero=1)
        if higher is not None and higher.fits and s.dp > 1:
            line += f"; ZeRO-1 {_vs(pick, higher)}"
        return line
    lower = _neighbour(price, s, zero=s.zero - 1, offload_optimizer="none" if s.zero == 1 else s.offload_optimizer,
                       offload_params="none")
    sharded = {1: "optimizer states", 2: "gradients", 3: "weights"}[s.zero]
    if lower is None:
        return f"DeepSpeed ZeRO-{s.zero}: shards the {sharded} over {s.dp} GPUs"
    if not lower.fits:
        return (f"DeepSpeed ZeRO-{s.zero}: under ZeRO-{s.zero - 1} at mbs {s.mbs} the model states of "
                f"{_gib(lower.memory.params_bytes + lower.memory.grads_bytes + lower.memory.optimizer_bytes)}/GPU "
                f"do not fit beside {_gib(lower.memory.activations_bytes)} of activations and "
                f"{_gib(lower.memory.buffers_bytes + lower.memory.overhead_bytes)} of buffers and overhead "
                f"({_gib(lower.memory.total_bytes)} > {_gib(m.capacity_bytes)})")
    return _lower_stage_line(pick, lower, ranked, goal, sharded)


def _grown(pick: Estimate, other: Estimate) -> str:
    """The memory category that grew most from ``other`` to ``pick``, with both sizes."""
    parts = ("params_bytes", "weights"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer states"), \
        ("activations_bytes", "activations"), ("buffers_bytes", "buffers"), ("overhead_bytes", "overhead")
    field, name = max(parts, key=lambda p: getattr(pick.memory, p[0]) - getattr(other.memory, p[0]))
    return f"its {name}, {gib(getattr(pick.memory, field)):.2f} vs {gib(getattr(other.memory, field)):.2f} GiB,"


def _lower_stage_line(pick: Estimate, lower: Estimate, ranked: Sequence[Estimate], goal: Goal, sharded: str) -> str:
    """ZeRO-k against ZeRO-(k-1) that also fits: what sharding frees (or costs: ZeRO-3's gather and prefetch
    buffers can outweigh the weights it shards) and why ZeRO-k ranks first, by the comparison the ranking
    makes (``Goal.rank_key``: the robust figure, then headroom)."""
    s = pick.strategy
    below = f"ZeRO-{s.zero - 1}"
    freed = lower.memory.total_bytes - pick.memory.total_bytes
    speeds = f"{pick.samples_per_s:.1f} vs {lower.samples_per_s:.1f} samples/s under {below}"
    memory = f"frees {_gib(freed)}/GPU" if freed > 0 else (
        f"costs {gib(-freed):.2f} GiB/GPU more than {below} ({_grown(pick, lower)} outweigh the {sharded} it shards)")
    head = f"DeepSpeed ZeRO-{s.zero}: sharding the {sharded} over {s.dp} GPUs {memory}"
    if not any(e.strategy == lower.strategy for e in ranked):
        return f"{head} at {speeds}; {below} at these settings was not among the plans searched"
    mine, theirs = goal.figure(pick), goal.figure(lower)
    if mine < theirs - 0.005 * abs(theirs):
        return f"{head}; chosen for speed: {speeds}"
    if freed > 0:
        return f"DeepSpeed ZeRO-{s.zero}: as fast as {below} ({pick.samples_per_s:.1f} samples/s) and sharding the " \
               f"{sharded} frees {_gib(freed)}/GPU; ties go to headroom"
    return (f"{head} at {speeds}; at the time band's slow end, which the ranking compares: {_rate_band(pick)} vs "
            f"{_rate_band(lower)} under {below}")


def _offload_line(pick: Estimate, price: Price) -> str | None:
    s = pick.strategy
    if s.offload_optimizer == "none" and s.offload_params == "none":
        return None
    plain = _neighbour(price, s, offload_optimizer="none", offload_params="none")
    what = " and ".join(n for n, v in (("optimizer states", s.offload_optimizer), ("parameters", s.offload_params))
                        if v != "none")
    host = f"{_gib(pick.memory.host_bytes)} host memory per GPU"
    if plain is not None and not plain.fits:
        return (f"CPU offload of the {what}: without it this plan needs {_gib(plain.memory.total_bytes)} > "
                f"{_gib(plain.memory.capacity_bytes)} per GPU; it costs {host} and PCIe traffic each step")
    return f"CPU offload of the {what} ({host})"


def _precision_line(pick: Estimate, price: Price, space: SearchSpace) -> str:
    s = pick.strategy
    recipe = get_recipe(s.precision)
    head = f"precision {s.precision} ({recipe.description}; {optimizer_state_text(s.optimizer, recipe)})"
    others = [e for p in space.precisions if p != s.precision if (e := _neighbour(price, s, precision=p)) is not None]
    if not others:
        return f"{head}: the only precision searched for this engine"
    parts = []
    fitting = [e for e in others if e.fits]
    if fitting:
        best = max(fitting, key=lambda e: e.samples_per_s)
        parts.append(f"{pick.samples_per_s / best.samples_per_s:.2f}x the samples/s of {best.strategy.precision} "
                     f"at the same settings ({pick.samples_per_s:.1f} vs {best.samples_per_s:.1f})")
    for e in others:
        if not e.fits and e.samples_per_s > pick.samples_per_s:
            parts.append(f"{e.strategy.precision} would be faster but needs {_gib(e.memory.total_bytes)}")
    if not parts:
        parts.append("the other precisions do not fit at these settings")
    return f"{head}: " + "; ".join(parts)


def _mbs_line(pick: Estimate, price: Price, space: SearchSpace) -> str:
    s = pick.strategy
    larger = [b for b in space.micro_batches(_layout_of(s)) if b > s.mbs]
    if not larger:
        limit = "the global batch" if space.global_batch else "the searched range"
        return f"micro-batch {s.mbs}: the largest {limit} allows ({_gib(pick.memory.total_bytes)} per GPU)"
    nxt_b = larger[0]
    accum = space.global_batch // (s.dp * nxt_b) if space.global_batch else s.grad_accum
    nxt = _neighbour(price, s, mbs=nxt_b, grad_accum=max(1, accum))
    if nxt is not None and not nxt.fits:
        return (f"micro-batch {s.mbs}: the largest that fits with these settings; {nxt_b} needs "
                f"{_gib(nxt.memory.total_bytes)} > {_gib(nxt.memory.capacity_bytes)}")
    if nxt is not None:
        return f"micro-batch {s.mbs}: {_larger_mbs_reason(pick, nxt)}"
    return f"micro-batch {s.mbs} ({_gib(pick.memory.total_bytes)} of {_gib(pick.memory.capacity_bytes)} per GPU)"


def _larger_mbs_reason(pick: Estimate, nxt: Estimate) -> str:
    """Why the next larger micro-batch, which fits, was not picked: it is not faster; it is faster but fits only at
    the allocator's median margin (goal.py ``class_key``); or it is faster nominally but not at the band's slow end,
    which the ranking sorts by, or within ``TIE_TOLERANCE`` of it there (the simpler plan wins a tie)."""
    b, rates = nxt.strategy.mbs, f"{nxt.samples_per_s:.1f} vs {pick.samples_per_s:.1f} samples/s"
    bubble = "; fewer micro-batches would widen the pipeline bubble" if pick.strategy.pp > 1 else ""
    if nxt.samples_per_s <= pick.samples_per_s:
        return f"{b} fits but is not faster ({rates}){bubble}"
    if nxt.fits_at_high_margin is False and pick.fits_at_high_margin is not False:
        return (f"{b} is faster ({rates}) but fits only at the median allocator margin, not at its 90th percentile "
                f"({_gib(nxt.memory.total_bytes)} of {_gib(nxt.memory.capacity_bytes)} per GPU)")
    slow_next = nxt.samples_per_s * nxt.time.step_s / nxt.time.step_s_high
    slow_pick = pick.samples_per_s * pick.time.step_s / pick.time.step_s_high
    if slow_next <= slow_pick:
        return (f"{b} is faster nominally ({rates}) but not at the band's slow end, which the ranking sorts by "
                f"({slow_next:.1f} vs {slow_pick:.1f})")
    if slow_pick >= (1 - TIE_TOLERANCE) * slow_next:
        return (f"{b} is faster ({rates}) but within {TIE_TOLERANCE:.0%} of it at the band's slow end "
                f"({slow_next:.1f} vs {slow_pick:.1f}): a tie, which the simpler plan wins")
    return f"{b} is faster ({rates}) but ranks below it (see the alternatives)"


def _layout_of(s: Strategy) -> Layout:
    return Layout(s.world_size, s.dp, s.tp, s.pp, s.vpp, s.cp, s.ep, s.dispatcher, s.ep_overlap, s.etp)


def _ep_line(pick: Estimate, price: Price, ranked: Sequence[Estimate]) -> str | None:
    """Why this expert-parallel degree: what the next smaller one needs (memory, or its speed), and the
    all-to-all it costs."""
    s = pick.strategy
    if s.ep == 1:
        more = _best(ranked, lambda o: o.ep > 1 and o.world_size == s.world_size)
        return None if more is None else (f"expert parallelism off (ep 1): every expert local; the best ep plan "
                                          f"({more.strategy.label()}) {_vs(pick, more)}")
    line = (f"expert parallelism ep {s.ep}: {s.ep} ranks share each layer's experts (dispatch/combine all-to-all "
            f"{pick.time.ep_comm_s * 1e3:.0f} ms per step{' left exposed' if s.ep_overlap else ''})")
    smaller = _neighbour(price, s, ep=s.ep // 2, dispatcher="alltoall" if s.ep // 2 == 1 else s.dispatcher,
                         ep_overlap=s.ep_overlap and s.ep // 2 > 1)
    if smaller is not None:
        line += f"; ep {s.ep // 2} {_vs(pick, smaller)}"
    if s.expert_tp != s.tp:
        held = "each expert whole on one rank" if s.expert_tp == 1 else f"each expert split over {s.expert_tp} ranks"
        line += (f"; expert tensor parallelism etp {s.expert_tp} (tp {s.tp} for the other layers): {held}, the expert "
                 "group folded over the tensor-parallel ranks, no expert-tp gather of the routed tokens" if
                 s.expert_tp == 1 else f"; expert tensor parallelism etp {s.expert_tp} (tp {s.tp} for the other "
                 f"layers): {held}")
        folded = s.ep * s.expert_tp // s.tp  # the same expert sharding with etp = tp
        same = _neighbour(price, s, etp=None, ep=folded) if folded >= 1 and s.ep * s.expert_tp % s.tp == 0 else None
        if same is not None:
            line += f"; etp {s.tp} with ep {folded} {_vs(pick, same)}"
    if s.dispatcher == "deepep":
        line += "; DeepEP dispatcher: a token crosses to each remote node holding its experts once, then NVLink"
        nccl = _neighbour(price, s, dispatcher="alltoall")
        if nccl is not None:
            line += f" (NCCL all-to-all of every copy: {_vs(pick, nccl)})"
    if s.ep_overlap:
        line += "; all-to-all overlapped with the other micro-batch's compute (--overlap-moe-expert-parallel-comm)"
        plain = _neighbour(price, s, ep_overlap=False)
        if plain is not None:
            line += f", without the overlap {_vs(pick, plain)}"
    return line


def _checkpointing_line(pick: Estimate, price: Price, space: SearchSpace) -> str:
    s = pick.strategy
    acts = _gib(pick.memory.activations_bytes)
    if s.checkpointing == "none":
        # without the plan's checkpointing, recompute is the model's own (estimators/own_checkpointing.py)
        line = (f"no activation checkpointing added (the model's own re-runs {_step(pick.time.recompute_s)} of the "
                f"{_step(pick.time.step_s)} step): activations of {acts} fit" if pick.time.recompute_s > 0
                else f"no activation checkpointing: activations of {acts} fit")
        alt = _neighbour(price, s, checkpointing="full") if "full" in space.checkpointing else None
        if alt is not None and pick.time.step_s > 0:
            # the whole step's change: the re-run forward's memory-bound bytes and host launches count too
            slower = alt.time.step_s / pick.time.step_s - 1
            line += (f"; full checkpointing would make the step {100 * slower:.0f}% slower ({_step(pick.time.step_s)} "
                     f"-> {_step(alt.time.step_s)}: the forward's matmuls, memory-bound kernels and launches again)")
        return line
    name = {"full": "full", "moe": "MoE-layer (--recompute-modules moe)"}.get(
        s.checkpointing, "selective (per-op: every other matmul's output kept)" if runs_op_policy(s)
        else "selective (attention core)")
    less = [m for m in ("none", "selective") if m in space.checkpointing and m != s.checkpointing
            and (m == "none" or s.checkpointing == "full")]
    parts = []
    for mode in less:
        alt = _neighbour(price, s, checkpointing=mode)
        if alt is not None:
            parts.append(f"{mode} {_vs(pick, alt)}")
    if runs_op_policy(s) and not s.compile:
        # estimators/selective_host.py: measured 1.3-2.3x slower than no checkpointing on a host-paced H200 step
        parts.append("in eager mode the policy costs host time per operator (priced; --compile traces it once)")
    if s.checkpoint_layers is not None:  # partial: the fewest first blocks that fit (planner/partial.py)
        name = f"partial (full checkpointing of the first {s.checkpoint_layers} blocks of each stage)"
        for label, change in (("every block", {"checkpoint_layers": None}),
                              (f"{s.checkpoint_layers - 1} blocks", {"checkpoint_layers": s.checkpoint_layers - 1})):
            alt = _neighbour(price, s, **change) if s.checkpoint_layers > 1 or label == "every block" else None
            if alt is None:
                continue
            robust_only = alt.fits and alt.fits_at_high_margin is False and pick.fits_at_high_margin is not False
            parts.append(f"{label} fits only at the median allocator margin measured" if robust_only
                         else f"{label} {_vs(pick, alt)}")
    plain = _neighbour(price, s, checkpointing="none")
    if plain is not None and plain.time.recompute_s > 0:  # the model checkpoints itself too
        parts.append("around a model that also checkpoints itself: both re-run (priced)")
    tail = "; " + "; ".join(parts) if parts else ""
    return (f"{name} activation checkpointing: activations {acts}/GPU, recompute "
            f"{_step(pick.time.recompute_s)} of the {_step(pick.time.step_s)} step{tail}")


def _batch_line(pick: Estimate, space: SearchSpace) -> str:
    s = pick.strategy
    split = f"mbs {s.mbs} x {s.grad_accum} micro-batches x dp {s.dp}"
    if s.pp > 1:
        bubble = (s.pp - 1) / (s.vpp * s.grad_accum + s.pp - 1)
        split += f"; pipeline bubble (p-1)/(v·m+p-1) = {bubble * 100:.0f}%"
    if space.global_batch:
        return f"global batch {s.global_batch} (fixed) = {split}"
    return (f"global batch {s.global_batch} = {split} was free: hold it with --global-batch; if it differs from "
            "your tuned batch, scale the learning rate: linear rule for SGD (Goyal et al. 2017), square-root rule "
            "for Adam (Malladi et al. 2022)")


def _optimizer_line(pick: Estimate, price: Price, space: SearchSpace) -> str:
    s = pick.strategy
    if len(space.optimizers) == 1:
        others = "/".join(o for o in ("adamw", "adamw8bit", "adafactor", "sgd") if o != s.optimizer)
        return (f"optimizer {s.optimizer}: optimizer states {_gib(pick.memory.optimizer_bytes)}/GPU (the one "
                f"searched; --optimizer {others} searches others, which change training dynamics)")
    others = [e for o in space.optimizers if o != s.optimizer if (e := _neighbour(price, s, optimizer=o)) is not None]
    tail = "; ".join(f"{e.strategy.optimizer} {_vs(pick, e)}" for e in others)
    return f"optimizer {s.optimizer}: optimizer states {_gib(pick.memory.optimizer_bytes)}/GPU" + (
        f"; {tail}" if tail else "")


def _compile_line(pick: Estimate, price: Price) -> str | None:
    """What torch.compile would change for an eager torch/DeepSpeed pick (or what it does for a compiled one)."""
    s = pick.strategy
    if s.engine == "megatron" or not pick.time.step_s:
        return None
    other = _neighbour(price, s, compile=not s.compile)
    if other is None or not other.time.step_s:
        return None
    if s.compile:
        what = "each block and the loss function" if s.loss_compiled else "each block (the loss eager: --eager-loss)"
        held = other.memory.activations_bytes - pick.memory.activations_bytes
        memory = (f"; the compiled loss holds the logits and their gradient only: {_gib(held)} less activation "
                  "memory than the eager cross entropy's fp32 copies" if s.loss_compiled and held > 2**28 else "")
        return (f"torch.compile of {what}: {_step(pick.time.step_s)} per step against {_step(other.time.step_s)} "
                f"eager (elementwise ops fused; priced, not measured on this GPU){memory}")
    gain = 1.0 - other.time.step_s / pick.time.step_s
    if gain < 0.01:
        return None
    return (f"eager kernels (the model as written; their bytes measured operator by operator): torch.compile of each "
            f"block (--compile) would price the step at {_step(other.time.step_s)}, {100 * gain:.0f}% less (fused "
            "elementwise ops; priced, not measured on this GPU)")


def rationale(pick: Estimate, ranked: Sequence[Estimate], price: Price, space: SearchSpace, goal: Goal,
              evaluated: int) -> list[str]:
    """The chosen plan's decisions, one line each, with the numbers behind them."""
    ties = _ties_line(pick, ranked, goal)
    lines = [_headline(pick, evaluated, goal, simplest=ties is not None), ties, _margin_line(pick, ranked, goal),
             _envelope_line(pick),
             _gpus_line(pick, ranked, space, goal), _layout_line(pick, ranked), _ep_line(pick, price, ranked),
             _sharding_line(pick, price, ranked, goal), _offload_line(pick, price), _precision_line(pick, price, space),
             _optimizer_line(pick, price, space), _mbs_line(pick, price, space),
             _checkpointing_line(pick, price, space), _compile_line(pick, price), _batch_line(pick, space)]
    return [line for line in lines if line]
