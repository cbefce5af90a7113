"""The generated train.py, run for real: measured peak memory against the plan's prediction.

For each case of the matrix (DDP, FSDP2 full and grad_op, HSDP as 2 replicas x 1 shard, DeepSpeed ZeRO-1/2/3;
fp32 and bf16; checkpointing none and full), it

1. profiles the model file (``optplan.probes.loader.profile_model_file``) once, prices the case with
   ``estimators.estimate`` on a 2-GPU H100 cluster (one GPU per node for HSDP) and writes the plan's exports
   with ``planner.export.registry.render_targets`` (train.py, and ds_config.json for DeepSpeed);
2. runs ``torchrun --nproc-per-node 2 -m optplan.probes.runtime_child --train-script train.py -- --steps 4
   --device cpu`` (gloo): train.py's own loop, with optplan's live-tensor tracker around every step from the second,
   which puts the peak (max over ranks) into the measurements.json train.py writes;
3. compares that peak with the plan's ``prediction.cpu_allocated_bytes`` (memory.py's CPU accounting of the
   same run, bytes).

Run: ``python benchmarks/fidelity_train.py [--quick] [--model FILE]`` (--quick: fp32 without checkpointing
and bf16 with full checkpointing per engine, 14 runs, ~3 min on 2 cores; the full matrix is 28). The last
line is ``train.py: max memory error X% over N runs (M ok)``. tests/planner/test_train_script.py runs the
quick matrix on ``SMALL_GPT2`` and asserts on it (its bf16 cases at ``BF16_TEST_SEQ_LEN``, ``--seq-len 32``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.planner.export.context import FILE_NAMES, export_plan_for
from optplan.planner.export.registry import render_targets
from optplan.planner.export.train_script import read_plan

ENGINES: dict[str, dict[str, Any]] = {
    "ddp": {"engine": "torch"},
    "fsdp-full": {"engine": "torch", "fsdp": "full"},
    "fsdp-grad_op": {"engine": "torch", "fsdp": "grad_op"},
    "hsdp": {"engine": "torch", "fsdp": "hybrid"},
    "zero1": {"engine": "deepspeed", "zero": 1},
    "zero2": {"engine": "deepspeed", "zero": 2},
    "zero3": {"engine": "deepspeed", "zero": 3},
}
"""The matrix's engines (as Strategy fields)."""
RECIPES_QUICK = (("fp32", "none"), ("bf16", "full"))
RECIPES_FULL = (("fp32", "none"), ("fp32", "full"), ("bf16", "none"), ("bf16", "full"))
NPROC = 2
GPU = "H100-SXM"
SMALL_GPT2 = '{"n_layer": 2, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "block_size": 128}'
"""examples/gpt2.py at a size whose runs take seconds on a CPU (3.7M parameters: more than DeepSpeed's reduce buckets, as in real models)."""
BF16_TEST_SEQ_LEN = 32
"""The sequence length tests/planner/test_train_script.py runs its 16-bit cases at (``SMALL_GPT2``, the same
parameters and DeepSpeed buckets; fp32 cases at 128): on a CPU without native bf16 (AVX2 only) torch emulates bf16
matmuls ~90x slower than fp32, and a bf16 step of ``SMALL_GPT2`` at 128 tokens takes seconds per rank. What those
cases add to the fp32 ones, each engine's 16-bit weights, fp32 masters and states under full checkpointing, does
not depend on the length."""
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gpt2.py"


@dataclass(frozen=True)
class Case:
    engine: str
    precision: str
    checkpointing: str
    mbs: int = 2

    @property
    def name(self) -> str:
        return f"{self.engine} {self.precision} ckpt-{self.checkpointing}"

    def strategy(self) -> Strategy:
        return Strategy(precision=self.precision, checkpointing=self.checkpointing, dp=NPROC, mbs=self.mbs,  # type: ignore[arg-type]
                        **ENGINES[self.engine])


@dataclass(frozen=True)
class Outcome:
    case: Case
    ok: bool
    predicted_bytes: int
    measured_bytes: int | None
    reason: str
    wall_s: float
    measurements: dict[str, Any] | None

    @property
    def error_pct(self) -> float | None:
        if not self.measured_bytes:
            return None
        return 100.0 * (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


def cases(quick: bool) -> list[Case]:
    recipes = RECIPES_QUICK if quick else RECIPES_FULL
    return [Case(e, p, c) for e in ENGINES for p, c in recipes]


def cluster_for(case: Case) -> Cluster:
    """Two GPUs; HSDP's are on two nodes of one (two replicas of a one-GPU shard group)."""
    per_node = 1 if case.engine == "hsdp" else NPROC
    return Cluster(gpu=find_gpu(GPU), gpus=NPROC, gpus_per_node=per_node)


def write_plan(case: Case, profile: ModelProfile, folder: Path) -> Path:
    """The case's train.py (and ds_config.json) in ``folder``, rendered as ``optplan export`` does."""
    strategy = case.strategy()
    cluster = cluster_for(case)
    plan = export_plan_for(strategy, profile, cluster, shown=estimate(profile, cluster, strategy))
    names = ["train"] + (["deepspeed"] if strategy.engine == "deepspeed" else [])
    files, _ = render_targets(plan, names)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder / FILE_NAMES["train"]


def torchrun_command(script: Path, *args: str, tracked: bool = True) -> list[str]:
    """``torchrun --standalone --nproc-per-node 2`` of train.py, under the probe's tracker when ``tracked``."""
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}"]
    if tracked:
        return [*head, "-m", "optplan.probes.runtime_child", "--train-script", str(script), "--", *args]
    return [*head, str(script), *args]


def run_case(case: Case, profile: ModelProfile, folder: Path, *, timeout_s: float = 300.0) -> Outcome:
    """One case; a rank killed by a signal (seen once: SIGABRT in a gloo FSDP2 run while other jobs loaded the
    2 cores) is run once more, and the outcome says so."""
    first = _run_case(case, profile, folder, timeout_s=timeout_s)
    if first.ok or "Signal" not in first.reason:
        return first
    again = _run_case(case, profile, folder, timeout_s=timeout_s)
    return Outcome(again.case, again.ok, again.predicted_bytes, again.measured_bytes,
                   f"second try (first: {first.reason[:120]}) {again.reason}".strip(), again.wall_s, again.measurements)


def _run_case(case: Case, profile: ModelProfile, folder: Path, *, timeout_s: float) -> Outcome:
    script = write_plan(case, profile, folder)
    plan_doc = read_plan(script.read_text(encoding="utf-8"))
    predicted = int(plan_doc["prediction"]["cpu_allocated_bytes"])
    out = folder / "measurements.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(torchrun_command(script, "--steps", "4", "--device", "cpu", "--measurements", str(out),
                                               "--log-every", "1"),
                              cwd=folder, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Outcome(case, False, predicted, None, f"timed out after {timeout_s:.0f} s", time.perf_counter() - t0, None)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        said = [x for x in lines if x.startswith("error: ") or "Error" in x or "what():" in x][:3]
        tail = " | ".join(said + lines[-2:])
        return Outcome(case, False, predicted, None, f"exit {proc.returncode}: {tail}", wall, None)
    doc = json.loads(out.read_text())
    return Outcome(case, True, predicted, doc["measured"].get("peak_allocated_bytes"), "", wall, doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two recipes per engine (14 runs)")
    parser.add_argument("--model", type=Path, default=EXAMPLE, help="the model file (default examples/gpt2.py)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--gpt2-config", default=SMALL_GPT2,
                        help="examples/gpt2.py's OPTPLAN_GPT2_CONFIG (JSON; '' for GPT-2 small)")
    args = parser.parse_args(argv)
    if args.gpt2_config:
        os.environ["OPTPLAN_GPT2_CONFIG"] = args.gpt2_config  # the profiler and torchrun children inherit it
    from optplan.probes.loader import profile_model_file

    profile = profile_model_file(args.model, seq_len=args.seq_len)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="optplan-train-") as tmp:
        for i, case in enumerate(cases(args.quick)):
            o = run_case(case, profile, Path(tmp) / f"case{i}")
            outcomes.append(o)
            err = "-" if o.error_pct is None else f"{o.error_pct:+.2f}%"
            measured = "-" if o.measured_bytes is None else f"{o.measured_bytes / 2**20:.2f}"
            print(f"{case.name:32s} predicted {o.predicted_bytes / 2**20:9.2f} MiB  measured {measured:>9s} MiB  "
                  f"{err:>8s}  {o.wall_s:5.1f} s  {o.reason}", flush=True)
    errs = [abs(o.error_pct) for o in outcomes if o.error_pct is not None]
    worst = f"{max(errs):.2f}%" if errs else "n/a"
    print(f"train.py: max memory error {worst} over {len(outcomes)} runs ({sum(o.ok for o in outcomes)} ok)")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
