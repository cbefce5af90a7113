"""The README's commands and CI stay in step."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_opens_with_install_and_test_commands() -> None:
    install, test = _readme_commands()[:2]
    assert "pip install torch==2.13.0" in install and "optplan recommend examples/" in install
    assert '".[dev]"' in test and "pytest" in test


def test_ci_runs_exactly_the_readme_test_command() -> None:
    test_cmd = _readme_commands()[1].split("&&")[-1].strip()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in [line.strip() for line in ci]
    assert "pip install -q torch==2.13.0" in ci
