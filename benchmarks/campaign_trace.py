"""The campaign's ``trace`` section (trace.json): where the step time goes. A few runs with two extra steps under
``torch.profiler`` (probes/step_trace.py): kernel time by category, the host's operators and the kernels that took
longest, beside the predicted step's parts."""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity  # noqa: E402
import fidelity_suite  # noqa: E402
from campaign_core import EXAMPLES, Campaign  # noqa: E402
from campaign_io import write_json  # noqa: E402
from probe_pool import ProbePool  # noqa: E402

from optplan.estimators.estimate import estimate  # noqa: E402
from optplan.estimators.profile import ModelProfile  # noqa: E402
from optplan.estimators.strategy import Strategy  # noqa: E402
from optplan.probes.runtime import ProbeResult, ProbeSpec  # noqa: E402


@dataclass(frozen=True)
class TraceCase:
    key: str
    path: Path
    seq_len: int | None
    strategy: Strategy


def trace_cases(device: str, tmp: Path) -> list[TraceCase]:
    """The runs the H200 visit's time errors were largest on (benchmarks/results/2026-11-26-H200): GPT-2 small
    at micro-batch 4 (28-54 % slower predicted than measured), 16 and 64 (where the GPU paces the step and the fourth
    visit measured 18-21 % slower than predicted), the Llama-3 1B layout at 2 and 4 with
    checkpointing (23-38 % faster predicted), DeepSpeed ZeRO-1 and ZeRO-3 at world size 1 (1.6-5.8x slower
    measured than predicted), ResNet-50 at 32 and 128 and timm's in channels-last and channels-first at 128 (the
    counted-traffic path) and the MLP (the FLOPs-only path: 8-90x); on the CPU one small MLP run.
    --quick on a GPU keeps the first GPT-2 and the first Llama run."""
    if device == "cpu":
        return [TraceCase("mlp", EXAMPLES / "mlp.py", None, Strategy(precision="fp32", optimizer="adamw", mbs=16,
                                                                     engine="torch"))]
    llama = fidelity_suite.llama_wrapper(tmp, None, 1024)
    return [
        *(TraceCase("gpt2", EXAMPLES / "gpt2.py", 1024, Strategy(precision="bf16", mbs=b, engine="torch"))
          for b in (4, 16, 64)),
        TraceCase("llama1b", llama, 1024, Strategy(precision="bf16", mbs=2, engine="torch")),
        TraceCase("llama1b", llama, 1024, Strategy(precision="bf16", mbs=4, checkpointing="full", engine="torch")),
        TraceCase("llama1b", llama, 1024, Strategy(precision="bf16", mbs=2, engine="deepspeed", zero=1)),
        TraceCase("llama1b", llama, 1024, Strategy(precision="bf16", mbs=2, checkpointing="full",
                                                   engine="deepspeed", zero=3)),
        *(TraceCase("resnet", EXAMPLES / "resnet.py", None, Strategy(precision="bf16", optimizer="sgd", mbs=b,
                                                                    engine="torch")) for b in (32, 128)),
        *(TraceCase(f"r50-{layout}", fidelity_suite.convnet_model(tmp, "resnet50", 224, layout), None,
                    Strategy(precision="amp-bf16", optimizer="sgd", mbs=128, engine="torch"))
          for layout in ("nhwc", "nchw")),
        TraceCase("mlp", EXAMPLES / "mlp.py", None, Strategy(precision="fp32", optimizer="adamw", mbs=1024,
                                                             engine="torch")),
    ]


def part_trace(c: Campaign) -> dict[str, Any]:
    """Kernel time by category (probes/step_trace.py) beside the predicted step's parts, for a few runs."""
    path = c.out / "trace.json"
    doc = c.doc("trace", gpu=c.gpu_name, time_comparable=c.time_comparable, runs=[])
    with tempfile.TemporaryDirectory(prefix="optplan_campaign_trace_") as tmp:
        cases = trace_cases(c.device, Path(tmp))
        if c.quick and c.device == "cuda":  # one run per model: GPT-2 at micro-batch 4, the Llama layout at 2
            cases = [next(t for t in cases if t.key == key) for key in ("gpt2", "llama1b")]
        wanted = [case for case in cases if c.wants(case.key)]

        def measure(case: TraceCase) -> tuple[ModelProfile, ProbeResult] | str:
            """In a worker: the traced run, or why it did not run."""
            if case.strategy.engine == "deepspeed" and c.deepspeed_error:
                return c.deepspeed_error
            if c.left_s() < 30:
                return "out of time"
            profile = pool.profile(case.path, case.seq_len).result().profile
            if profile is None:
                return "profiling failed"
            block = profile.repeated_block.class_name if profile.repeated_block else None
            spec = ProbeSpec(model_path=str(case.path), seq_len=case.seq_len, strategy=case.strategy,
                             block_class=block, device=c.device,  # type: ignore[arg-type]
                             ds_config=fidelity.ds_config(case.strategy, profile, torch_optimizer=True),
                             warmup_steps=2 if c.device == "cuda" else 1,
                             timed_steps=3 if c.device == "cuda" else 1, trace_steps=2 if c.device == "cuda" else 1)
            return profile, pool.run_probe(spec, timeout_s=max(30.0, min(240.0, c.left_s())))

        with ProbePool(c.jobs, Path(tmp)) as pool:
            for case, done in zip(wanted, pool.ordered(measure, wanted), strict=True):
                key, strategy = case.key, case.strategy
                if isinstance(done, str):
                    doc["runs"].append({"model": key, "strategy": strategy.label(), "skipped": done})
                    write_json(path, doc)
                    continue
                profile, result = done
                t = estimate(profile, c.cluster(1), strategy,
                             adam_impl=fidelity.probe_adam_impl(strategy, c.device, ds_torch_optimizer=True)).time
                predicted = {"step_s": t.step_s, "compute_s": t.compute_s, "recompute_s": t.recompute_s,
                             "memory_bound_s": t.memory_bound_s, "optimizer_s": t.optimizer_s,
                             "host_overhead_s": t.host_overhead_s}
                doc["runs"].append({"model": key, "strategy": strategy.label(), "status": result.status,
                                    "reason": result.reason, "measured_step_s": result.step_s,
                                    "trace": result.step_trace, "predicted": predicted if c.time_comparable else None,
                                    "probe_wall_s": result.wall_s, "device_wait_s": result.device_wait_s})
                busy = (result.step_trace or {}).get("busy_s")
                host = ((result.step_trace or {}).get("host_per_step") or {}).get("aten_self_s")
                attention = next((k["name"][:60] for k in (result.step_trace or {}).get("top_kernels") or []
                                  if k.get("category") == "attention"), None)  # which SDPA backend ran
                c.log(f"trace: {key} {strategy.label()}: {result.status}"
                      + (f", step {result.step_s * 1e3:.1f} ms, busy {busy * 1e3:.1f} ms" if result.step_s and busy else "")
                      + (f", host operators {host * 1e3:.1f} ms" if host else "")
                      + (f", attention kernel {attention}" if attention else ""))
                write_json(path, doc)
    write_json(path, doc)
    return doc
