"""Model-file errors and path checks, free of pydantic (imported by the runtime probe child).

:class:`ModelFileError` is the one exception for problems a user can fix in a model file; its message
is one line: ``"<file>: <problem> — <fix>"``. ``optplan.probes.loader`` re-exports everything here,
so ``from optplan.probes.loader import ModelFileError`` keeps working.
"""

from __future__ import annotations

import os
from pathlib import Path

from optplan.estimators.errors import OptplanError

_MAX_TEXT = 400


def one_line(text: object, limit: int = _MAX_TEXT) -> str:
    """``text`` with all whitespace runs collapsed to one space, cut to ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class ModelFileError(OptplanError):
    """A problem with a model file that the user can fix; ``str()`` is one line naming file and fix."""

    def __init__(self, path: str | os.PathLike[str], problem: str, fix: str, *, detail: str = "") -> None:
        self.path = str(path)
        self.detail = detail  # the child's stderr (user output, tracebacks), shown by `optplan --debug`
        self.problem = one_line(problem)
        self.fix = one_line(fix)
        super().__init__(f"{self.path}: {self.problem} — {self.fix}")


def check_model_path(path: str | os.PathLike[str]) -> Path:
    """The path as a resolved ``Path`` when it names an existing ``.py`` file, else ModelFileError."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(path, "file not found",
                             f"check the path (relative paths start at {os.getcwd()})")
    if p.is_dir():
        raise ModelFileError(path, "is a directory, not a model file",
                             "pass the .py file that defines build_model() or your nn.Module")
    if p.suffix != ".py":
        raise ModelFileError(path, f"not a Python file (expected a .py file, got {p.suffix or 'no suffix'!r})",
                             "pass the .py file that defines build_model() or your nn.Module")
    return p.resolve()
