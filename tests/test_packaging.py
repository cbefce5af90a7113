"""Packaging: the wheel maps the top-level folders to optplan.* and imports from a clean location;
the estimators never import torch or textual."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out)], check=True, capture_output=True, text=True)
    (whl,) = out.glob("optplan-*.whl")
    return whl


def test_wheel_file_list_maps_every_subpackage(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("optplan/estimators/__init__.py", "optplan/estimators/estimate.py",
                     "optplan/estimators/data/gpus.yaml", "optplan/estimators/data/allocator_overhead.yaml",
                     "optplan/probes/loader.py",
                     "optplan/planner/recommend.py", "optplan/planner/export/deepspeed.py",
                     "optplan/tui/cli.py", "optplan/tui/app.tcss", "optplan/tui/screens/plan.py",
                     "optplan/tui/widgets/trials_table.py"):
        assert required in names, required
    assert not any(n.startswith(("estimators/", "probes/", "planner/", "tui/", "tests/")) for n in names)
    assert "optplan/__init__.py" not in names  # optplan is a namespace
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "optplan = optplan.tui.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_wheel_imports_from_an_unpacked_copy(wheel: Path, tmp_path: Path) -> None:
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = ("import optplan.estimators.estimate as e, optplan.planner.recommend, optplan.tui.cli; "
            "from optplan.estimators.hardware import gpu_catalogue; "
            "from optplan.estimators.allocator_overhead import allocator_overhead; "
            "assert allocator_overhead().margin; "
            "print(e.__file__); print(len(gpu_catalogue()))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, check=True)
    first, count = run.stdout.split()
    assert first.startswith(str(tmp_path))
    assert int(count) >= 11


def test_estimators_import_neither_torch_nor_textual() -> None:
    code = ("import sys, optplan.estimators.estimate, optplan.estimators.memory, optplan.estimators.hardware; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'textual')); print(bad)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


def test_cli_starts_without_importing_textual_or_torch() -> None:
    code = ("import sys, optplan.tui.cli; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'textual', 'deepspeed'}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


def test_console_script_is_installed() -> None:
    exe = Path(sys.executable).with_name("optplan")
    run = subprocess.run([str(exe), "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "recommend" in run.stdout
