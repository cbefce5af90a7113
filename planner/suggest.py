"""When nothing fits: what would — the fewest GPUs under ZeRO-3, CPU offload, or a shorter sequence."""

from __future__ import annotations

from collections.abc import Callable

from optplan.estimators.estimate import Estimate, StatesEstimate, estimate, estimate_states
from optplan.estimators.hardware import Cluster
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.units import gib
from optplan.planner.space import SearchSpace

MAX_GPUS_CONSIDERED = 1 << 16


def _lean_strategy(space: SearchSpace, profile: ModelProfile, dp: int, *, zero: int = 3,
                   **extra: object) -> Strategy:
    """The smallest-memory strategy of the space at ``dp`` GPUs: 16-bit weights if searched, mbs 1,
    checkpointing when the model has a repeated block, ZeRO ``zero``."""
    precision = min(space.precisions, key=lambda p: (p.startswith("amp") or p == "fp32", p))
    gb = space.global_batch
    accum = gb // dp if gb and gb % dp == 0 else 1
    return Strategy(precision=precision, optimizer=space.optimizer, zero=zero, mbs=1,  # type: ignore[arg-type]
                    grad_accum=accum, dp=dp, checkpointing="full" if profile.supports_checkpointing else "none",
                    **extra)  # type: ignore[arg-type]


def _pricer(states_only: bool) -> Callable[[ModelProfile, Cluster, Strategy], Estimate | StatesEstimate]:
    return estimate_states if states_only else estimate


def fewest_gpus_zero3(profile: ModelProfile, cluster: Cluster, space: SearchSpace, *,
                      keep_global_batch: bool = True, states_only: bool = False) -> Estimate | StatesEstimate | None:
    """Smallest GPU count (> the given one) at which the lean ZeRO-3 strategy fits, by bisection.

    Per-GPU memory under ZeRO-3 falls monotonically with the GPU count (states ÷ N_d, the rest fixed),
    so bisection over [gpus + 1, 65536] finds the minimum. The count then rises to the next one that can
    be launched: whole nodes once it exceeds one node, and with a fixed global batch a divisor of it.
    None when even 65536 GPUs do not fit.
    """
    if not keep_global_batch:
        space = space.model_copy(update={"global_batch": None})

    price = _pricer(states_only)

    def at(n: int) -> Estimate | StatesEstimate:
        c = cluster.model_copy(update={"gpus": n})
        return price(profile, c, _lean_strategy(space, profile, n))

    lo, hi = max(2, cluster.gpus + 1), MAX_GPUS_CONSIDERED
    if not at(hi).fits:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if at(mid).fits:
            hi = mid
        else:
            lo = mid + 1
    gb = space.global_batch if keep_global_batch else None
    gpn = cluster.gpus_per_node

    def launchable(n: int) -> bool:
        return (n <= gpn or n % gpn == 0) and (not gb or gb % n == 0)

    return at(next((n for n in range(lo, MAX_GPUS_CONSIDERED + 1) if launchable(n)), lo))


def offload_options(profile: ModelProfile, cluster: Cluster, space: SearchSpace, *,
                    states_only: bool = False) -> list[Estimate | StatesEstimate]:
    """ZeRO-3 with CPU offload of the optimizer, then also of the parameters, at the given GPUs."""
    price = _pricer(states_only)
    return [price(profile, cluster, _lean_strategy(space, profile, cluster.gpus, **extra))
            for extra in ({"offload_optimizer": "cpu"}, {"offload_optimizer": "cpu", "offload_params": "cpu"})]


def what_would_fit(profile: ModelProfile, cluster: Cluster, space: SearchSpace, *,
                   states_only: bool = False) -> tuple[list[str], list[Estimate | StatesEstimate]]:
    """What would fit when no searched plan does: lines with the numbers, and the estimates behind them
    (the fewest GPUs under ZeRO-3, then CPU offload at the given GPUs)."""
    lines: list[str] = []
    behind: list[Estimate | StatesEstimate] = []
    fewest = fewest_gpus_zero3(profile, cluster, space, states_only=states_only)
    if fewest is not None:
        behind.append(fewest)
        n = fewest.gpus
        nodes = -(-n // cluster.gpus_per_node)
        lines.append(
            f"{n} x {cluster.gpu.name} ({nodes} node{'s' if nodes > 1 else ''} of {cluster.gpus_per_node}) fit with "
            f"{fewest.strategy.precision} ZeRO-3, mbs 1{', full checkpointing' if fewest.strategy.checkpointing == 'full' else ''}: "
            f"{gib(fewest.memory.total_bytes):.1f} of {gib(fewest.memory.capacity_bytes):.1f} GiB per GPU "
            f"(--gpus {n})")
        loose = fewest_gpus_zero3(profile, cluster, space, keep_global_batch=False, states_only=states_only)
        if loose is not None and loose.gpus < n:
            lines[-1] += (f"; {loose.gpus} GPUs would do if the global batch may change from "
                          f"{space.global_batch}")
    else:
        lines.append(f"no GPU count up to {MAX_GPUS_CONSIDERED} fits this model with ZeRO-3 on {cluster.gpu.name}")
    for est in offload_options(profile, cluster, space, states_only=states_only):
        s = est.strategy
        what = "optimizer states" if s.offload_params == "none" else "optimizer states and parameters"
        host_node = est.memory.host_bytes * min(cluster.gpus, cluster.gpus_per_node)
        verdict = "fit" if est.fits else "still do not fit"
        behind.append(est)
        lines.append(
            f"{cluster.gpus} x {cluster.gpu.name} {verdict} with ZeRO-3 + CPU offload of {what}: "
            f"{gib(est.memory.total_bytes):.1f} GiB per GPU, {gib(host_node):.0f} GiB host memory per node"
            + (f", ~{est.time.step_s:.1f} s per step of {s.global_batch} samples" if est.time is not None else ""))
        if est.fits:
            break
    if states_only:
        return lines, behind
    lean = estimate(profile, cluster, _lean_strategy(space, profile, cluster.gpus,
                                                     zero=3 if cluster.gpus > 1 else 0))
    if lean.memory.activations_bytes > lean.memory.capacity_bytes / 2:
        seq = f" at sequence length {profile.seq_len}" if profile.seq_len else ""
        lines.append(f"one sample's activations{seq} take {gib(lean.memory.activations_bytes):.1f} GiB: "
                     "a shorter --seq-len or smaller inputs would shrink them")
    return lines, behind
