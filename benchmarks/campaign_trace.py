"""The campaign's ``trace`` section (trace.json): where the step time goes. A few of the fidelity suite's runs with two
extra steps under ``torch.profiler`` (probes/step_trace.py) after their timed ones: kernel time by category, the
host's operators and the kernels that took longest, beside the predicted step's parts. The fidelity section traces
these runs in its own probes (:func:`trace_steps_for`), so a full campaign runs none of them twice; the trace
section probes only what the fidelity section did not run (``--sections trace``, ``--cases``, out of time)."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity  # noqa: E402
import fidelity_suite  # noqa: E402
from campaign_core import Campaign, device_held_s  # noqa: E402
from campaign_io import write_json  # noqa: E402
from probe_pool import ProbePool  # noqa: E402

from optplan.estimators.estimate import estimate  # noqa: E402
from optplan.estimators.profile import ModelProfile  # noqa: E402
from optplan.probes.runtime import ProbeResult  # noqa: E402

TRACED: dict[str, tuple[tuple[str, str], ...]] = {
    "cuda": (
        ("gpt2", "bf16 torch mbs8"), ("gpt2", "amp-bf16 torch mbs16"), ("gpt2", "bf16 torch mbs64"),
        ("llama", "bf16 torch mbs2"), ("llama", "amp-bf16 torch mbs4 ckpt"),
        ("llama", "bf16 ZeRO-1 mbs2"), ("llama", "bf16 ZeRO-3 mbs2 ckpt"),
        ("resnet", "bf16 torch mbs32"), ("resnet", "amp-bf16 torch mbs128"),
        ("r50-nhwc", "amp-bf16 torch mbs128"), ("r50-nchw", "amp-bf16 torch mbs128"),
        ("mlp", "fp32 torch mbs1024"),
    ),
    "cpu": (("mlp", "fp32 torch mbs16"),),
}
"""The traced runs, as (fidelity model, case label) of benchmarks/fidelity_suite.py: those the H200 visits' time
errors were largest on. GPT-2 small at micro-batch 8 (host-paced), 16 and 64 (where the GPU paces the step); the
Llama-3 1B layout at 2 and at 4 with checkpointing; DeepSpeed ZeRO-1 and ZeRO-3 at world size 1 (the host-paced
engine); ResNet-50 at 32 and 128, and timm's in channels-last and channels-first at 128 (the counted-traffic path);
the MLP (the FLOPs-only path). On the CPU one small MLP run. --quick on a GPU: :data:`QUICK_CUDA`."""

TRACE_STEPS = {"cuda": 2, "cpu": 1}
"""Optimizer steps under torch.profiler after a traced run's timed steps."""


QUICK_CUDA = (("gpt2", "bf16 torch mbs8"), ("llama", "amp-bf16 torch mbs4 ckpt"))
"""--quick on a GPU: one traced run of GPT-2 and one of the Llama, both cases of the quick fidelity suite (traced by
its probes: nothing runs twice)."""


def traced(device: str, quick: bool) -> tuple[tuple[str, str], ...]:
    """The (model, label) runs the trace section reports on ``device``."""
    if quick and device == "cuda":
        return QUICK_CUDA
    return TRACED["cuda" if device == "cuda" else "cpu"]


def trace_steps_for(c: Campaign) -> Callable[[fidelity_suite.Case, fidelity_suite.Model], int]:
    """For the fidelity section: traced steps for a case the trace section reports (0 for the others), so that the
    fidelity probe measures both and the trace section has nothing to run again."""
    wanted = set(traced(c.device, c.quick))

    def steps(case: fidelity_suite.Case, model: fidelity_suite.Model) -> int:
        label = fidelity_suite.label_of(case, fidelity_suite.strategy_of(case, model))
        return TRACE_STEPS["cuda" if c.device == "cuda" else "cpu"] if (model.key, label) in wanted else 0

    return steps


def _case(device: str, defs: dict[str, fidelity_suite.Model], key: str, label: str) -> fidelity_suite.Case:
    """The suite's case ``label`` of model ``key`` on ``device``."""
    for case in fidelity.select_cases(device, False, {key}):
        if fidelity_suite.label_of(case, fidelity_suite.strategy_of(case, defs[key])) == label:
            return case
    raise KeyError(f"{key} {label}: not a case of the fidelity suite on {device}")


def part_trace(c: Campaign) -> dict[str, Any]:
    """Kernel time by category (probes/step_trace.py) beside the predicted step's parts, for a few runs: those the
    fidelity section traced in this campaign (``Campaign.traced``) are taken from it, the others are run here."""
    path = c.out / "trace.json"
    doc = c.doc("trace", gpu=c.gpu_name, time_comparable=c.time_comparable, runs=[])
    steps = TRACE_STEPS["cuda" if c.device == "cuda" else "cpu"]
    with tempfile.TemporaryDirectory(prefix="optplan_campaign_trace_") as tmp:
        wanted = [run for run in traced(c.device, c.quick) if c.wants(run[0])]
        defs = fidelity_suite.models(c.device, Path(tmp)) if any(r not in c.traced for r in wanted) else {}
        runner = fidelity.Runner(device=c.device, gpu=c.gpu, nproc_available=1, timeout_s=240.0,
                                 ds_torch_optimizer=True)

        def measure(run: tuple[str, str]) -> tuple[ModelProfile, ProbeResult, str] | str:
            """In a worker: the traced run (from the fidelity section, else probed now), or why it did not run."""
            if run in c.traced:
                return (*c.traced[run], "fidelity")
            key, label = run
            case = _case(c.device, defs, key, label)
            if case.mode.startswith("zero") and c.deepspeed_error:
                return c.deepspeed_error
            if c.left_s() < 30:
                return "out of time"
            model = defs[key]
            profile = pool.profile(model.path, model.seq_len, model.env or None).result().profile
            if profile is None:
                return "profiling failed"
            result = runner.probe(case, model, profile, max(30.0, min(240.0, c.left_s())), trace_steps=steps)
            return profile, result, "trace"

        with ProbePool(c.jobs, Path(tmp)) as pool:
            runner.pool = pool
            for (key, label), done in zip(wanted, pool.ordered(measure, wanted), strict=True):
                if isinstance(done, str):
                    doc["runs"].append({"model": key, "strategy": label, "skipped": done})
                    write_json(path, doc)
                    continue
                profile, result, source = done
                strategy = result.spec.strategy
                t = estimate(profile, c.cluster(1), strategy,
                             adam_impl=fidelity.probe_adam_impl(strategy, c.device, ds_torch_optimizer=True)).time
                predicted = {"step_s": t.step_s, "compute_s": t.compute_s, "recompute_s": t.recompute_s,
                             "memory_bound_s": t.memory_bound_s, "optimizer_s": t.optimizer_s,
                             "host_overhead_s": t.host_overhead_s}
                doc["runs"].append({"model": key, "strategy": strategy.label(), "case": label, "source": source,
                                    "status": result.status, "reason": result.reason,
                                    "measured_step_s": result.step_s, "trace": result.step_trace,
                                    "predicted": predicted if c.time_comparable else None,
                                    "probe_wall_s": result.wall_s, "device_wait_s": result.device_wait_s,
                                    "device_held_s": device_held_s(result)})
                busy = (result.step_trace or {}).get("busy_s")
                host = ((result.step_trace or {}).get("host_per_step") or {}).get("aten_self_s")
                attention = next((k["name"][:60] for k in (result.step_trace or {}).get("top_kernels") or []
                                  if k.get("category") == "attention"), None)  # which SDPA backend ran
                c.log(f"trace: {key} {label}{' (the fidelity probe)' if source == 'fidelity' else ''}: {result.status}"
                      + (f", step {result.step_s * 1e3:.1f} ms, busy {busy * 1e3:.1f} ms" if result.step_s and busy else "")
                      + (f", host operators {host * 1e3:.1f} ms" if host else "")
                      + (f", attention kernel {attention}" if attention else ""))
                write_json(path, doc)
    write_json(path, doc)
    return doc
