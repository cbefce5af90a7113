"""Fidelity report (issue 5): predicted vs measured peak memory, and step time on a GPU, over a suite of
(model, strategy) cases run for real by the runtime probe.

Every case is one short real training run, ``optplan.probes.runtime.run_probe`` (a child process;
``torchrun`` with 2 processes for DDP / FSDP / DeepSpeed ZeRO, gloo on the CPU), compared with what the
estimators predict for the same Strategy from the model's static profile
(``optplan.probes.loader.profile_model_file``, fake tensors, one profile per model):

* memory: ``optplan.estimators.memory.memory_breakdown(profile, strategy, capacity, gpus_per_node=nproc,
  device=...)``; the predicted figure is the ALLOCATED bytes, ``total_bytes - overhead_bytes``: the
  overhead (the context outside the allocator and the allocator's margin, estimators/allocator_overhead.py) lies outside what
  ``torch.cuda.max_memory_allocated`` counts, and does not exist on the CPU. Measured: on the CPU the peak
  live tensor bytes of one tracked step (parameters, gradients, optimizer states, master copies,
  activations, communication buffers, inputs: every tensor alive), on CUDA ``max_memory_allocated`` over
  the whole run (the maximum over ranks);
* time (CUDA only): ``optplan.estimators.estimate.estimate(profile, cluster, strategy)`` with the detected
  GPU's catalogue entry, ``gpus = gpus_per_node = nproc``, against the median measured step. "Calibrated":
  the first case of each model is its calibration probe, ``Calibration(compute_scale = measured /
  predicted)`` of that case (one probe per model, as ``optplan.planner.calibrate`` would fit it), and the
  model's other cases are predicted again with ``estimate(..., calibration=cal)``; the calibration probe
  itself is left out of the calibrated statistics.

Errors are absolute relative errors, ``|predicted - measured| / measured``. A probe that did not finish
("oom", "error", "timeout", ...) prints its status and reason and is left out of the statistics (counted
and listed at the end).

The suite (at least 20 cases; ``--quick`` a subset): examples/mlp.py, examples/gpt2.py (GPT-2 small, a
short sequence on the CPU), a reduced examples/llama.py (the Llama-3 1B layout with fewer, narrower
layers on the CPU; the 1B model on a GPU), examples/resnet.py (ResNet-50, SGD as its file says) and two timm
models through ``--hf`` timm configs (a ViT and a ResNet, built by transformers' TimmWrapperForImageClassification;
vit_tiny and resnet18 on the CPU, vit_base and resnet50 on a GPU), at
micro-batches 1/2/4 (scaled up per model: on the CPU the MLP's x16; on a GPU the MLP's x256, GPT-2's x4
and ResNet's x16, so the steps are not all launch overhead), fp32 / amp-bf16 / bf16 / bf16-pure, checkpointing none /
selective (the training loop's op-level policy: matmul and attention outputs saved) / full,
single-process torch, and with 2 processes DDP, FSDP2 full / grad_op and DeepSpeed ZeRO 1/2/3. On the CPU
DeepSpeed runs without its ds_config's "optimizer" section (the probe then passes a torch AdamW, no
fused-Adam JIT build), which the prediction follows (torch's CPU AdamW loop). On a machine with a single
GPU the 2-process cases are skipped (listed).

Run: ``python benchmarks/fidelity.py [--device cpu|cuda] [--quick] [--models mlp,llama] [--explain]
[--timeout S] [--ds-torch-optimizer]``. A full CPU run is about 8 min on 2 cores; ``--quick`` on the CPU is 6
single-process cases (no MLP DDP, FSDP2 or ZeRO-2 case, no Llama amp-bf16 case with full checkpointing:
``Case.cpu_quick``) with a smaller Llama
(``LLAMA_CPU_QUICK_SHAPE``: dim 128, 2 layers, vocabulary 2048, seq 64), about 2 min of CPU (each case is mostly its
child process starting).
``--explain`` prints, under each case whose memory error is over the target, the predicted categories
(memory.py) beside the measured ones (the probe's ``peak_by_category_bytes`` on the CPU). The last line
reads ``memory: median error X%, max Y%; time: median error Z%, max W%`` (time: after calibration); on
the CPU time is not compared (see CPU_TIME_REASON).

Targets: CPU peak memory within 2 %; GPU peak allocated memory median <= 5 %, max <= 10 % before
calibration; GPU step time median <= 10 % after one calibration probe per model.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fidelity_report import (
    Row,
    catalogue_gpu,
    device_name,
    explain_lines,
    format_row,
    header,
    stats,
)
from fidelity_suite import SUITE, Case, Model, label_of, models, strategy_of
from probe_pool import ProbePool, Profiled

from optplan.estimators.calibration import Calibration
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, GPUSpec
from optplan.estimators.memory import MemoryBreakdown, memory_breakdown
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.temporaries import AdamImpl
from optplan.planner.calibrate import ProbeComparison, profile_hash
from optplan.planner.export.deepspeed import render_ds_config
from optplan.probes.runtime import ProbeResult, ProbeSpec, run_probe

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CAPACITY = 2**50  # "unlimited": whether a plan fits is irrelevant here
CPU_MEMORY_TARGET = 2.0
GPU_MEMORY_TARGET = (5.0, 10.0)  # median, max
GPU_TIME_TARGET = 10.0  # median, calibrated
CPU_TIME_REASON = ("the step-time model prices a GPU's FLOP/s, HBM bandwidth and NCCL links; no CPU is in "
                   "the catalogue, and 2 shared cores time noisily")

# one case
# ---------------------------------------------------------------------------------------------------
def ds_config(strategy: Strategy, profile: ModelProfile, torch_optimizer: bool) -> dict[str, Any] | None:
    if strategy.engine != "deepspeed":
        return None
    config = render_ds_config(strategy, profile)
    if torch_optimizer:
        config.pop("optimizer", None)  # the probe passes a torch optimizer: no fused-Adam JIT build
    return config


def probe_adam_impl(strategy: Strategy, device: str, ds_torch_optimizer: bool) -> AdamImpl | None:
    """The AdamW a probed run used when it is not its engine's own: DeepSpeed handed a torch client optimizer
    on CUDA runs torch's foreach AdamW, not the fused kernel the estimators assume for the engine."""
    return "foreach" if device == "cuda" and strategy.engine == "deepspeed" and ds_torch_optimizer else None


def predict_memory(profile: ModelProfile, strategy: Strategy, device: str, nproc: int,
                   ds_torch_optimizer: bool, gpu: str | None = None) -> MemoryBreakdown:
    """memory.py's breakdown for the probed run (:func:`probe_adam_impl`)."""
    return memory_breakdown(profile, strategy, CAPACITY, gpus_per_node=nproc,
                            adam_impl=probe_adam_impl(strategy, device, ds_torch_optimizer),
                            device=device, gpu=gpu)  # type: ignore[arg-type]


@dataclass
class Runner:
    device: str
    gpu: GPUSpec | None
    nproc_available: int
    timeout_s: float
    ds_torch_optimizer: bool
    pool: ProbePool | None = None  # None: each probe alone, in this thread

    def refuses(self, case: Case) -> str | None:
        """Why ``case`` cannot run here, or None."""
        if case.nproc > self.nproc_available:
            return f"needs {case.nproc} devices, {self.nproc_available} available"
        return None

    def probe(self, case: Case, model: Model, profile: ModelProfile, timeout_s: float | None = None,
              trace_steps: int = 0) -> ProbeResult:
        """Run ``case`` for real (through the pool when there is one); ``trace_steps`` more steps under
        torch.profiler after the timed ones and the memory figures (the campaign's trace section)."""
        strategy = strategy_of(case, model)
        block = profile.repeated_block.class_name if profile.repeated_block else None
        spec = ProbeSpec(
            model_path=str(model.path), seq_len=model.seq_len, strategy=strategy, block_class=block,
            ds_config=ds_config(strategy, profile, self.ds_torch_optimizer), device=self.device,  # type: ignore[arg-type]
            nproc=case.nproc,
            # CPU: one timed step, then the memory-tracked one (with a warm-up step first for 2 processes: DDP
            # rebuilds its buckets in the second step); CPU times are shown, not compared. CUDA: the probe's
            # defaults (2 warm-up + 5 timed steps).
            warmup_steps=(0 if case.nproc == 1 else 1) if self.device == "cpu" else 2,
            timed_steps=1 if self.device == "cpu" else 5, trace_steps=trace_steps)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self.pool is not None:
            return self.pool.run_probe(spec, timeout_s=timeout, env=model.env or None)
        return run_probe(spec, timeout_s=timeout, env=model.env or None)

    def row(self, case: Case, model: Model, profile: ModelProfile, result: ProbeResult,
            cal: Calibration | None) -> Row:
        """The case's row: ``result`` beside the predicted memory and step time (and the calibrated step with
        ``cal``)."""
        strategy = strategy_of(case, model)
        label = label_of(case, strategy)
        memory = predict_memory(profile, strategy, self.device, case.nproc, self.ds_torch_optimizer,
                                self.gpu.name if self.gpu is not None else None)
        row = Row(model.key, label, case.nproc, result, memory=memory,
                  pred_bytes=memory.total_bytes - memory.overhead_bytes)
        on_device = comm = None
        if self.device == "cuda" and self.gpu is not None:
            cluster = Cluster(gpu=self.gpu, gpus=case.nproc, gpus_per_node=case.nproc)
            try:
                impl = probe_adam_impl(strategy, self.device, self.ds_torch_optimizer)
                t = estimate(profile, cluster, strategy, adam_impl=impl).time
                row.pred_step_s, comm = t.step_s, t.exposed_comm_s
                on_device = t.step_s - t.exposed_comm_s
                if cal is not None:
                    row.cal_step_s = estimate(profile, cluster, strategy, calibration=cal,
                                              adam_impl=impl).time.step_s
            except Exception as exc:  # noqa: BLE001 - a strategy the estimator refuses is reported, not fatal
                row.time_note = f"no time estimate: {type(exc).__name__}: {exc}"
        row.comparison = ProbeComparison(
            candidate=strategy, probed=strategy, predicted_step_s=row.pred_step_s, predicted_on_device_s=on_device,
            predicted_exposed_comm_s=comm, predicted_allocated_bytes=row.pred_bytes or 0,
            predicted_total_bytes=memory.total_bytes, time_comparable=row.pred_step_s is not None, result=result)
        return row


# the run
# ---------------------------------------------------------------------------------------------------
@dataclass
class SuiteResult:
    """Every case of one run: rows in order, each model's profile hash and description."""

    device: str
    gpu: GPUSpec | None
    gpu_note: str
    rows: list[Row] = field(default_factory=list)
    model_hashes: dict[str, str] = field(default_factory=dict)
    describe: dict[str, str] = field(default_factory=dict)


def select_cases(device: str, quick: bool, wanted: set[str] | None) -> list[Case]:
    return [c for c in SUITE
            if device in c.where and (c.in_quick(device) or not quick) and (wanted is None or c.model in wanted)]


def run_suite(device: str, *, quick: bool = False, wanted: set[str] | None = None, timeout_s: float = 300.0,
              ds_torch_optimizer: bool = False, deadline: float | None = None,
              on_model: Callable[[str, Model, ModelProfile | None, float], None] | None = None,
              on_row: Callable[[Row], None] | None = None,
              skip: Callable[[Case], str | None] | None = None, jobs: int = 1,
              trace: Callable[[Case, Model], int] | None = None) -> SuiteResult:
    """Run the suite's cases for ``device`` (profile each model once, probe each case, predict it).

    ``deadline`` (a ``time.perf_counter()`` value): cases not started by then are recorded as skipped
    ("out of time") and each probe's timeout ends at the deadline (plus 20 s), so a caller with a wall-clock
    limit still gets every result so far. ``on_model`` is called after each model's profile (None when
    profiling failed), ``on_row`` after each case, both in the suite's order; ``skip`` may name a reason to leave
    a case out (e.g. DeepSpeed cannot be imported). ``jobs`` > 1: that many probes at once, taking the device in
    turn (probe_pool.py), and the models profiled ahead, several at once; the rows are the same, in the same
    order (a model's calibration is its first case's, whichever finishes first). ``trace`` may ask for traced steps
    after a case's timed ones (``ProbeResult.step_trace``; its step time and memory are as without)."""
    gpu, gpu_note = (catalogue_gpu() if device == "cuda" else (None, ""))
    nproc_available = torch.cuda.device_count() if device == "cuda" else 2
    out = SuiteResult(device=device, gpu=gpu, gpu_note=gpu_note)
    suite = select_cases(device, quick, wanted)

    with tempfile.TemporaryDirectory(prefix="optplan_fidelity_") as tmp, ProbePool(jobs, Path(tmp)) as pool:
        runner = Runner(device=device, gpu=gpu, nproc_available=nproc_available, timeout_s=timeout_s,
                        ds_torch_optimizer=ds_torch_optimizer or device == "cpu", pool=pool)
        defs = models(device, Path(tmp), quick=quick)
        keys = list(dict.fromkeys(c.model for c in suite))

        def late() -> bool:
            return deadline is not None and time.perf_counter() > deadline

        def profile_of(key: str) -> Future[Profiled] | None:
            """The model's profile, started now if it was not (None: out of time before it started)."""
            made = pool.started_profile(defs[key].path, defs[key].seq_len, defs[key].env or None)
            if made is None and not late():
                made = pool.profile(defs[key].path, defs[key].seq_len, defs[key].env or None)
            return made

        if jobs > 1:  # every profile ahead, before the probes that wait for them
            for key in keys:
                profile_of(key)

        def work(case: Case) -> ProbeResult | str:
            """In a worker: the case's probe, or why it did not run."""
            model = defs[case.model]
            why = skip(case) if skip is not None else None
            if why is None:
                why = runner.refuses(case)
            if why is None and late():
                why = "out of time"
            if why is not None:
                return why
            made = profile_of(case.model)
            if made is None:
                return "out of time"
            profiled = made.result()
            if profiled.profile is None:
                return f"profiling failed: {profiled.error}"
            if late():
                return "out of time"
            left = timeout_s if deadline is None else max(10.0, min(timeout_s, deadline - time.perf_counter() + 20.0))
            return runner.probe(case, model, profiled.profile, left, trace(case, model) if trace is not None else 0)

        futures = {id(case): pool.submit(work, case) for case in suite} if jobs > 1 else {}
        for key in keys:
            model = defs[key]
            out.describe[key] = model.describe
            profile: ModelProfile | None = None
            announced = False
            cal: Calibration | None = None
            for case in (c for c in suite if c.model == key):
                done = futures[id(case)].result() if futures else work(case)
                if not announced and (made := pool.started_profile(model.path, model.seq_len, model.env or None)):
                    announced = True
                    profiled = made.result()
                    profile = profiled.profile
                    if profile is not None:
                        out.model_hashes[key] = profile_hash(profile)
                    if on_model is not None:
                        on_model(key, model, profile, profiled.seconds)
                label = label_of(case, strategy_of(case, model))
                if isinstance(done, str):
                    row = Row(key, label, case.nproc, None, skipped=done)
                else:
                    assert profile is not None
                    row = runner.row(case, model, profile, done, cal)
                    if (cal is None and device == "cuda" and row.ok and row.pred_step_s and row.result
                            and row.result.step_s and case.nproc == 1):
                        cal = Calibration(gpu=gpu.name if gpu else "", model_hash=profile_hash(profile),
                                          torch_version=row.result.torch_version,
                                          compute_scale=row.result.step_s / row.pred_step_s, time_probes=1,
                                          source=f"fidelity: {row.label}")
                        row.is_calibration = True
                out.rows.append(row)
                if on_row is not None:
                    on_row(row)
    return out


# ---------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where the probes run (default: cuda when torch sees a GPU, else cpu)")
    parser.add_argument("--quick", action="store_true", help="a subset of the cases (~1-2 min on a CPU)")
    parser.add_argument("--models", default=None, help="comma-separated subset of mlp,gpt2,llama,resnet,timm-vit,timm-resnet")
    parser.add_argument("--explain", action="store_true",
                        help="print predicted vs measured categories under cases over the memory target")
    parser.add_argument("--timeout", type=float, default=300.0, help="per-probe wall-clock limit (s)")
    parser.add_argument("--ds-torch-optimizer", action="store_true",
                        help="cuda: run DeepSpeed with a torch AdamW instead of its ds_config optimizer "
                             "(always so on the CPU)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="probes at once, taking the device in turn (benchmarks/probe_pool.py); default 1")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        print(f"error: --jobs must be >= 1 (got {args.jobs})", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    wanted = set(args.models.split(",")) if args.models else None
    started = time.perf_counter()
    print(f"fidelity: {device} {device_name(device)}; torch {torch.__version__}; python {platform.python_version()}")
    if device == "cuda":
        gpu_line = catalogue_gpu()
        print(f"time model: {gpu_line[0].name if gpu_line[0] else gpu_line[1]}; calibrated = one probe per model "
              "(its first case)")
        print("memory: predicted allocated (memory.py total - CUDA context - fragmentation margin) vs "
              "torch.cuda.max_memory_allocated, max over ranks")
    else:
        print("memory: predicted allocated (memory.py total - overhead) vs the peak live tensor bytes of one "
              "tracked step (max over ranks); target 2%. step1 s: the first timed step, shown only")
    target = CPU_MEMORY_TARGET if device == "cpu" else GPU_MEMORY_TARGET[1]

    def on_model(key: str, model: Model, profile: ModelProfile | None, profile_s: float) -> None:
        if profile is None:
            print(f"\n{key}: {model.describe}\n  profiling failed")
            return
        print(f"\n{key}: {model.describe}; {profile.params:,} parameters; profile {profile_s:.1f} s")
        print(header(device), flush=True)

    def on_row(row: Row) -> None:
        print(format_row(row, device), flush=True)
        if args.explain and row.ok and (row.mem_err or 0.0) > target:
            for line in explain_lines(row):
                print(line)
            print(flush=True)

    suite = run_suite(device, quick=args.quick, wanted=wanted, timeout_s=args.timeout,
                      ds_torch_optimizer=args.ds_torch_optimizer, on_model=on_model, on_row=on_row, jobs=args.jobs)
    rows = suite.rows
    wall = time.perf_counter() - started
    failed = [r for r in rows if r.result is not None and not r.ok]
    skipped = [r for r in rows if r.result is None]
    ok = [r for r in rows if r.ok]
    mem = [e for r in ok if (e := r.mem_err) is not None]
    print(f"\n{len(rows)} cases: {len(ok)} ok, {len(failed)} failed, {len(skipped)} skipped; wall time {wall:.0f} s")
    for r in failed:
        assert r.result is not None
        print(f"  failed: {r.model} {r.label}: {r.result.status}: {r.result.reason}")
    for r in skipped:
        print(f"  skipped: {r.model} {r.label}: {r.skipped}")
    over = [r for r in ok if (r.mem_err or 0.0) > target]
    if over:
        print(f"memory error over {target:g}%: " + "; ".join(f"{r.model} {r.label} {r.mem_err:.1f}%" for r in over))
    mem_med, mem_max = stats(mem)
    if device == "cpu":
        print(f"memory: median error {mem_med}, max {mem_max}; time: not compared on CPU ({CPU_TIME_REASON})")
        return 0 if ok else 1
    raw_med, raw_max = stats([e for r in ok if (e := r.time_err) is not None])
    cal_med, cal_max = stats([e for r in ok if (e := r.cal_err) is not None])
    print(f"targets: memory median <= {GPU_MEMORY_TARGET[0]:g}%, max <= {GPU_MEMORY_TARGET[1]:g}% (uncalibrated); "
          f"time median <= {GPU_TIME_TARGET:g}% (calibrated)")
    print(f"time before calibration: median error {raw_med}, max {raw_max} (every case); after one calibration "
          f"probe per model: over the other cases")
    print(f"memory: median error {mem_med}, max {mem_max}; time: median error {cal_med}, max {cal_max}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
