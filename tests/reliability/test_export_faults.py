"""Exports on a full disk or into a read-only folder: one error line, exit 2, the old files intact.

The faults are the kernel's own: a file-size limit (``RLIMIT_FSIZE``: writes past it fail with EFBIG, as
they fail with ENOSPC on a full disk), a real full filesystem (a 64 KiB tmpfs filled to the last page)
and a read-only bind mount. The two mounts need the right to mount (root in this container); where it
is missing those tests are skipped and the file-size one still runs.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ARCH = "layers=2,hidden=64,heads=4,vocab=128,seq=32"
LAUNCH_FILES = ("accelerate.yaml", "ds_config.json", "hf_training_args.json", "launch.sh", "lightning.json")


def optplan(*args: str, limit_bytes: int | None = None) -> subprocess.CompletedProcess[str]:
    def limit() -> None:  # in the child, before exec: writes past limit_bytes fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-m", "optplan.tui.cli", *args], capture_output=True, text=True,
                          timeout=300, preexec_fn=None if limit_bytes is None else limit)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file in ``folder`` (hidden ones too) and its bytes."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan.json and the launch files an earlier ``recommend --out`` wrote."""
    out = tmp_path_factory.mktemp("plan")
    # --engine deepspeed: the files below include ds_config.json, which a torch pick (the simplest of the
    # ties for this small decoder) has none of
    proc = optplan("recommend", "--arch", ARCH, "--gpus", "2", "--engine", "deepspeed", "--no-probe", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert all((out / name).is_file() for name in LAUNCH_FILES), sorted(p.name for p in out.iterdir())
    return out


def old_exports(plan_dir: Path, folder: Path) -> Path:
    """``folder`` holding last week's launch files (different bytes from what the plan renders now)."""
    folder.mkdir(exist_ok=True)
    for name in LAUNCH_FILES:
        (folder / name).write_bytes((plan_dir / name).read_bytes() + b"\n# last week's\n")
    return folder


def mount(*args: str) -> bool:
    if not shutil.which("mount"):
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[list[Path]]:
    """Mount points made by the test; unmounted afterwards."""
    points: list[Path] = []
    yield points
    for point in reversed(points):
        subprocess.run(["umount", str(point)], capture_output=True)


def test_writes_that_fail_midway_keep_every_old_file(plan_dir: Path, tmp_path: Path) -> None:
    """Every write past the limit fails part-written; the first to fail is the temporary copy a trainer's
    loader checks (found by this test: it was a traceback), so the error names the temp folder."""
    out = old_exports(plan_dir, tmp_path / "out")
    before = snapshot(out)
    small = min(len(before[name]) for name in LAUNCH_FILES)
    proc = optplan("export", str(plan_dir / "plan.json"), "--to", "all", "--out", str(out), "--force",
                   limit_bytes=small + 1)  # the smallest file fits, the others fail part-written
    line = one_error_line(proc)
    assert line.startswith("error: cannot check the exports with their trainers' loaders: ")
    assert line.endswith("could not be written (File too large); free space there or point TMPDIR at another folder")
    assert snapshot(out) == before  # no file replaced, no temporary file left


def test_a_full_disk_keeps_every_old_file(plan_dir: Path, tmp_path: Path, mounted: list[Path]) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    if not mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)):
        pytest.skip("mounting a tmpfs is not permitted here")
    mounted.append(disk)
    out = old_exports(plan_dir, disk)
    with open(disk / "filler", "wb", buffering=0) as fh:  # fill the filesystem to the last byte
        try:
            while fh.write(b"\0" * 4096):
                pass
        except OSError:
            pass
    before = snapshot(out)
    proc = optplan("export", str(plan_dir / "plan.json"), "--to", "all", "--out", str(out), "--force")
    line = one_error_line(proc)
    assert line == f"error: cannot write to output folder {out}: No space left on device; choose a writable folder (--out)"
    assert snapshot(out) == before


def test_a_read_only_folder_keeps_every_old_file(plan_dir: Path, tmp_path: Path, mounted: list[Path]) -> None:
    out = old_exports(plan_dir, tmp_path / "ro")
    if os.geteuid() != 0:
        out.chmod(0o555)
        why = "Permission denied"
    elif mount("--bind", str(out), str(out)):
        mounted.append(out)
        if not mount("-o", "remount,ro,bind", str(out)):
            pytest.skip("remounting read-only is not permitted here")
        why = "Read-only file system"
    else:
        pytest.skip("root ignores folder modes and bind mounts are not permitted here")
    try:
        before = snapshot(out)
        proc = optplan("export", str(plan_dir / "plan.json"), "--to", "all", "--out", str(out), "--force")
        assert one_error_line(proc) == f"error: cannot write to output folder {out}: {why}; choose a writable folder (--out)"
        assert snapshot(out) == before
        # recommend refuses such an --out before any work (its study journal would live there too)
        proc = optplan("recommend", "--arch", ARCH, "--gpus", "2", "--no-probe", "--out", str(out), "--force")
        assert one_error_line(proc) == f"error: cannot write to {out}: choose a writable --out directory"
        assert snapshot(out) == before
    finally:
        if os.geteuid() != 0:
            out.chmod(0o755)
