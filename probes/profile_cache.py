"""Parent side of the profile cache: a model file profiled once is not profiled again until something it read changes.

Profiling a model file is a child process that imports torch and runs ~36 fake-tensor steps: 10-20 s for a small
model on a 2-core machine, minutes for a large one. ``optplan estimate model.py`` then ``optplan recommend
model.py`` would pay that twice for the same answer. The cache is a two-level, content-addressed store in the
manner of ccache's "direct mode" manifests (https://ccache.dev/manual/latest.html#_the_direct_mode):

1. the *request key*, computed here without running anything: SHA-256 over the model file's bytes and path, the
   profiler options, the Python interpreter and torch version, a digest of optplan's own probes/estimators source,
   and every ``OPTPLAN_*``/``TORCH*``/``PYTORCH*`` variable and ``PYTHONPATH`` (read by C++ code too, where the
   child cannot see them);
2. under that key, up to :data:`MAX_VARIANTS` entries, each a profile with the *inputs* the child recorded while
   making it (:mod:`optplan.probes.input_record`: the local files it opened or imported with their SHA-256, the
   environment variables its Python code read, the versions of the packages it imported). An entry is used only
   when every one of those inputs is as recorded.

Entries live in ``$OPTPLAN_PROFILE_CACHE`` if that names a folder, else ``profiles/`` under the cache folder
(:func:`optplan.probes.cache_dir.cache_dir`); ``OPTPLAN_PROFILE_CACHE=off`` turns the cache off. Errors are never
cached. Writes are atomic (temp file + rename), so concurrent runs at worst redo a profile; a cache that cannot be
read or written is skipped, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from optplan.probes.cache_dir import cache_dir
from optplan.probes.input_record import VOLATILE_ENV, file_sha256

PROFILE_CACHE_ENV = "OPTPLAN_PROFILE_CACHE"
OFF_VALUES = frozenset({"0", "off", "false", "no", "none"})
CACHE_FORMAT = 1
MAX_VARIANTS = 4
"""Entries kept per request key (newest first): one per set of inputs seen, e.g. two values of an env variable."""
KEYED_ENV_PREFIXES = ("OPTPLAN_", "TORCH", "PYTORCH", "PYTHONPATH")


def profile_cache_dir() -> Path | None:
    """The folder profiles are cached in, or None when ``OPTPLAN_PROFILE_CACHE`` turns the cache off."""
    value = os.environ.get(PROFILE_CACHE_ENV, "").strip()
    if value.lower() in OFF_VALUES:
        return None
    return Path(value).expanduser() if value else cache_dir() / "profiles"


def own_source_roots() -> tuple[str, ...]:
    """The folders of optplan's code that a profile depends on (probes and estimators)."""
    import optplan.estimators
    import optplan.probes

    return tuple(str(Path(mod.__file__).resolve().parent)  # type: ignore[arg-type]
                 for mod in (optplan.probes, optplan.estimators))


def source_digest() -> str:
    """SHA-256 over optplan's probes and estimators source (``.py`` and data ``.json``): a changed profiler is a
    new key, in a development checkout as much as in a new release."""
    digest = hashlib.sha256()
    for root in own_source_roots():
        for file in sorted(Path(root).rglob("*")):
            if file.suffix in (".py", ".json") and "__pycache__" not in file.parts and file.is_file():
                digest.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def keyed_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables every key holds: those read by torch's C++ side or optplan's child by name."""
    return {k: v for k, v in sorted(environ.items())
            if k.startswith(KEYED_ENV_PREFIXES) and k not in VOLATILE_ENV}


def request_key(path: str | os.PathLike[str], options: Sequence[str]) -> str | None:
    """The request key (hex) of profiling ``path`` with the child's ``options``; None if the file cannot be read."""
    content = file_sha256(os.fspath(path))
    if content is None:
        return None
    doc = {"format": CACHE_FORMAT, "optplan": source_digest(), "python": sys.version, "executable": sys.executable,
           "torch": _dist_version("torch"), "path": os.fspath(path), "resolved": str(Path(path).resolve()),
           "sha256": content, "options": list(options), "env": keyed_env(os.environ)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def inputs_hold(inputs: Mapping[str, Any]) -> bool:
    """Whether every input a cached profile recorded is as it was: file contents, environment values, package
    versions, and the working folder when the model opened a file by a relative path."""
    cwd = inputs.get("cwd")
    if cwd is not None and cwd != os.getcwd():
        return False
    env = inputs.get("env", {})
    if any(os.environ.get(k) != v for k, v in env.items()):
        return False
    if any(_dist_version(name) != version for name, version in inputs.get("dists", {}).items()):
        return False
    return all(file_sha256(path) == digest for path, digest in inputs.get("files", {}).items())


def _entry_path(folder: Path, key: str) -> Path:
    return folder / f"{key}.json"


def _read_variants(file: Path) -> list[dict[str, Any]]:
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT or not isinstance(doc.get("variants"), list):
        return []
    return [v for v in doc["variants"]
            if isinstance(v, dict) and isinstance(v.get("inputs"), dict) and isinstance(v.get("profile"), dict)]


def lookup(folder: Path, key: str) -> dict[str, Any] | None:
    """The cached profile document for ``key`` whose recorded inputs all still hold, or None."""
    for variant in _read_variants(_entry_path(folder, key)):
        if inputs_hold(variant["inputs"]):
            return dict(variant["profile"])
    return None


def store(folder: Path, key: str, inputs: Mapping[str, Any], profile: Mapping[str, Any]) -> bool:
    """Keep ``profile`` under ``key`` with the ``inputs`` it was made from (newest first, at most
    :data:`MAX_VARIANTS`); atomic. False (nothing written) when the folder cannot be written."""
    file = _entry_path(folder, key)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        variants = [v for v in _read_variants(file) if v["inputs"] != dict(inputs)]
        variants = [{"inputs": dict(inputs), "profile": dict(profile)}, *variants][:MAX_VARIANTS]
        fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"format": CACHE_FORMAT, "variants": variants}, fh)
            os.replace(tmp, file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        return False
    return True
