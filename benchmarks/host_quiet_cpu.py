"""What a quiet host does for a probe's timed steps, on this machine's CPU (probes/host_quiet.py).

Three runs of the same probe (the MLP example, fp32, its steps on the CPU, holding a device lock):

* ``alone``: nothing else running;
* ``busy``: ``--busy`` processes spinning in Python beside it (as the campaign's imports and profiles do);
* ``quiet``: the same spinners in the probe's quiet group (``$OPTPLAN_QUIET_GROUP``): the probe stops them for its
  timed steps.

Prints each run's median step, its ratio to ``alone``, and ``host_op_s`` (probes/host_speed.py), which should move
with the step. Usage: ``python benchmarks/host_quiet_cpu.py [--busy N] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from optplan.estimators.strategy import Strategy
from optplan.probes.host_quiet import QUIET_ENV, owned_group
from optplan.probes.runtime import ProbeResult, ProbeSpec, run_probe

ROOT = Path(__file__).resolve().parents[1]
SPIN = [sys.executable, "-c", "while True: pass"]


def probe(lock: Path, env: dict[str, str]) -> ProbeResult:
    spec = ProbeSpec(model_path=str(ROOT / "examples" / "mlp.py"),
                     strategy=Strategy(precision="fp32", optimizer="adamw", mbs=64, engine="torch"),
                     warmup_steps=2, timed_steps=9, device_lock=str(lock))
    result = run_probe(spec, timeout_s=300, env=env)
    if not result.ok:
        raise SystemExit(f"error: the probe failed ({result.status}: {result.reason})")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="spinning processes (default: cores)")
    parser.add_argument("--repeats", type=int, default=3, help="probes per setting (the median is kept)")
    args = parser.parse_args(argv)
    rows: dict[str, list[ProbeResult]] = {}
    with tempfile.TemporaryDirectory() as tmp, owned_group(Path(tmp) / "quiet") as group:
        lock = Path(tmp) / "device.lock"
        for setting in ("alone", "busy", "quiet"):
            spinners = []
            if setting != "alone":
                env = {**os.environ, **({QUIET_ENV: group} if setting == "quiet" else {})}
                spinners = [subprocess.Popen(SPIN, env=env) for _ in range(args.busy)]
            try:
                rows[setting] = [probe(lock, {QUIET_ENV: group} if setting == "quiet" else {})
                                 for _ in range(args.repeats)]
            finally:
                for p in spinners:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                    p.wait()
    base = statistics.median(r.step_s or 0.0 for r in rows["alone"])
    print(f"host_quiet_cpu: MLP fp32 mbs64 on the CPU ({os.cpu_count()} cores), {args.busy} spinner(s), "
          f"{args.repeats} probe(s) each")
    print(f"{'setting':8s} {'step ms':>9s} {'ratio':>6s} {'host_op us':>11s} {'stopped':>8s}")
    for setting, results in rows.items():
        step = statistics.median(r.step_s or 0.0 for r in results)
        op = statistics.median(r.host_op_s or 0.0 for r in results)
        stopped = max((r.quieted_processes or 0) for r in results)
        print(f"{setting:8s} {step * 1e3:9.2f} {step / base:6.2f} {op * 1e6:11.2f} {stopped:8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
