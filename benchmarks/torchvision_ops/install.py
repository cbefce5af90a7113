"""Write ``torchvision_cpu_ops.pth`` into this interpreter's site-packages, so that every Python started from
this environment imports benchmarks/torchvision_ops/torchvision_cpu_ops.py (see its docstring: torchvision's
CUDA-built wheel on a CPU-only torch). Used by .ci/run, after torchvision and timm are installed; run it the same way
in a development environment to run the timm tests and benchmark rows. Idempotent; the file is written atomically.

Run: ``python benchmarks/torchvision_ops/install.py`` (``--remove`` takes it out again).
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PTH_NAME = "torchvision_cpu_ops.pth"


def pth_text() -> str:
    """A .pth file: its first line puts this folder on sys.path, its second (an ``import`` line, which site.py
    executes) installs the finder."""
    return f"{HERE}\nimport torchvision_cpu_ops\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--remove", action="store_true", help="delete the .pth file instead")
    args = parser.parse_args(argv)
    target = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    if args.remove:
        target.unlink(missing_ok=True)
        print(f"removed {target}")
        return 0
    fd, tmp = tempfile.mkstemp(prefix=".optplan-", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(pth_text())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
