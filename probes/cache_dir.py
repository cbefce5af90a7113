"""Where optplan keeps what it caches on this machine: calibrations (planner/calibrate.py), profiles
(probes/profile_cache.py), Hugging Face model files (planner/hf_source.py)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "OPTPLAN_CACHE_DIR"


def cache_dir() -> Path:
    """``$OPTPLAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/optplan``, else ``~/.cache/optplan`` (the XDG base
    directory specification's user cache folder)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "optplan"
