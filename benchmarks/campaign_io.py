"""What every section of benchmarks/gpu_campaign.py shares: atomic JSON writes of results, and running a command
(the optplan command line, an exported launch.sh) with a timeout that keeps what it printed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from optplan.probes.host_quiet import group_from_env, wait_while_quiet

ROOT = Path(__file__).resolve().parents[1]


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities as None (strict JSON has neither; a NaN loss is a probe's data)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` atomically (temp file in the same folder + rename): a killed run leaves a whole file.
    NaN and infinities are written as null."""
    doc = _finite(json.loads(json.dumps(doc, default=str)))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=2, allow_nan=False)
            fh.write("\n")
        os.chmod(tmp, 0o644)  # results are committed and shared: readable like any other file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_command(argv: Sequence[str], timeout_s: float, *, cwd: Path = ROOT,
                env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    """Run ``argv``; a timeout is exit code 124 with what it printed so far. In a quiet group it starts after any
    probe's timed steps (probes/host_quiet.py)."""
    wait_while_quiet(group_from_env(env))
    try:
        proc = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                              env=dict(env) if env is not None else None)
    except subprocess.TimeoutExpired as exc:
        def text(b: Any) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return 124, text(exc.stdout), text(exc.stderr) + f"\ntimed out after {timeout_s:.0f} s"
    return proc.returncode, proc.stdout, proc.stderr


def run_optplan(args: Sequence[str], timeout_s: float, *, env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    """Run the optplan command line (this interpreter's) with ``args``."""
    return run_command([sys.executable, "-m", "optplan.tui.cli", *args], timeout_s, env=env)


def last_line(out: str, err: str) -> list[str]:
    """The last line a failed command printed (stderr first), for a results record."""
    return (err or out).strip().splitlines()[-1:] or ["no output"]
