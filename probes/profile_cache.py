"""Parent side of the profile cache: a model file profiled once is not profiled again until something it read changes.

Profiling a model file is a child process that imports torch and runs ~36 fake-tensor steps: 10-25 s for a small
model on a 2-core machine, minutes for a large one. ``optplan estimate model.py`` then ``optplan recommend
model.py`` would pay that twice for the same answer. The cache is a two-level, content-addressed store in the
manner of ccache's "direct mode" manifests (https://ccache.dev/manual/latest.html#_the_direct_mode):

1. the *request key*, computed here without running anything: SHA-256 over the model file's bytes and resolved path
   (the child imports the file from there, so ``examples/m.py``, ``./examples/m.py`` and a symlink to it are one key), the
   profiler options, the Python interpreter, the installed distributions (every ``*.dist-info``/``*.egg-info``
   name in the site-packages folders: a package installed, removed or upgraded is a new key, whether or not the
   model imported it), a digest of optplan's own probes/estimators source, and every
   ``OPTPLAN_*``/``TORCH*``/``PYTORCH*`` variable and ``PYTHONPATH`` (read by C++ code too, where the child
   cannot see them);
2. under that key, up to :data:`MAX_VARIANTS` entries, each a profile with the *inputs* the child recorded while
   making it (:mod:`optplan.probes.input_record`: the local files it opened or imported with their SHA-256, the
   environment variables its Python code read, by the SHA-256 of their values). An entry is used only when every
   one of those inputs is as recorded.

Entries live in ``$OPTPLAN_PROFILE_CACHE`` if that names a folder, else ``profiles/`` under the cache folder
(:func:`optplan.probes.cache_dir.cache_dir`); ``OPTPLAN_PROFILE_CACHE=off`` turns the cache off. Errors are never
cached. Writes are atomic (temp file + rename), so concurrent runs at worst redo a profile; at most
:data:`MAX_ENTRIES` keys are kept (the least recently written go first). The loader treats any failure of the cache
as a miss: a cache can make a command faster, never make it fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from optplan.probes.cache_dir import cache_dir
from optplan.probes.input_record import VOLATILE_ENV, file_sha256, site_roots, value_sha256

PROFILE_CACHE_ENV = "OPTPLAN_PROFILE_CACHE"
OFF_VALUES = frozenset({"0", "off", "false", "no", "none"})
CACHE_FORMAT = 2
MAX_VARIANTS = 4
"""Entries kept per request key (newest first): one per set of inputs seen, e.g. two values of an env variable."""
MAX_ENTRIES = 256
"""Request keys kept in the folder; past it the least recently written are removed (each is ~20-60 KB)."""
STALE_TEMP_S = 3600.0
"""A temp file of an interrupted write older than this (s) is removed by the next write."""
KEYED_ENV_PREFIXES = ("OPTPLAN_", "TORCH", "PYTORCH", "PYTHONPATH")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RecordedInputs(_Frozen):
    """What one profile read (:meth:`optplan.probes.input_record.InputRecorder.report`)."""

    files: dict[str, str | None] = Field(description="absolute path -> SHA-256 of its bytes, None: absent")
    env: dict[str, str | None] = Field(description="variable -> SHA-256 of its value, None: unset")
    cwd: str | None = Field(default=None, description="the working folder, when a file was opened by a relative path")


class CachedProfile(_Frozen):
    """A profile document with the inputs it was made from."""

    inputs: RecordedInputs
    profile: dict[str, Any]


class CacheEntry(_Frozen):
    """One request key's file: its variants, newest first."""

    format: Literal[2] = CACHE_FORMAT
    variants: tuple[CachedProfile, ...] = ()


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
    """SHA-256 over every file of optplan's probes and estimators packages (code and data): a changed profiler is a
    new key, in a development checkout as much as in a new release."""
    digest = hashlib.sha256()
    for root in own_source_roots():
        for file in sorted(Path(root).rglob("*")):
            if "__pycache__" not in file.parts and file.is_file():
                digest.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def installed_digest() -> str:
    """SHA-256 over the names of the installed distributions' metadata folders (``torch-2.13.0+cpu.dist-info``...)
    in the site-packages folders: one listing per folder, no metadata parsed."""
    names: list[str] = []
    for root in site_roots():
        try:
            names += [f"{root}/{n}" for n in os.listdir(root) if n.endswith((".dist-info", ".egg-info"))]
        except OSError:
            continue
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()


def keyed_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables every key holds: those read by torch's C++ side or optplan's child by name."""
    return {k: v for k, v in sorted(environ.items())
            if k.startswith(KEYED_ENV_PREFIXES) and k not in VOLATILE_ENV}


def request_key(path: str | os.PathLike[str], options: Sequence[str],
                environ: Mapping[str, str] | None = None) -> str | None:
    """The request key (hex) of profiling ``path`` with the child's ``options`` in ``environ`` (the child's
    environment; default ``os.environ``); None if the file cannot be read."""
    content = file_sha256(os.fspath(path))
    if content is None:
        return None
    doc = {"format": CACHE_FORMAT, "optplan": source_digest(), "python": sys.version, "executable": sys.executable,
           "installed": installed_digest(), "resolved": str(Path(path).resolve()),
           "sha256": content, "options": list(options), "env": {k: value_sha256(v) for k, v in
                                                                 keyed_env(os.environ if environ is None else environ).items()}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def inputs_hold(inputs: RecordedInputs, hashes: dict[str, str | None] | None = None,
                environ: Mapping[str, str] | None = None) -> bool:
    """Whether every input a cached profile recorded is as it was: environment values (in ``environ``, the child's
    environment; default ``os.environ``), the working folder when the model opened a file by a relative path, file
    contents. ``hashes`` memoises file digests across the variants of one lookup."""
    env = os.environ if environ is None else environ
    if inputs.cwd is not None and inputs.cwd != os.getcwd():
        return False
    if any(value_sha256(env.get(k)) != v for k, v in inputs.env.items()):
        return False
    memo = {} if hashes is None else hashes
    for path, digest in inputs.files.items():
        if path not in memo:
            memo[path] = file_sha256(path)
        if memo[path] != digest:
            return False
    return True


def _entry_path(folder: Path, key: str) -> Path:
    return folder / f"{key}.json"


def read_entry(file: Path) -> CacheEntry:
    """The entry in ``file``; an empty one when it is missing, unreadable or not this format (it is replaced)."""
    try:
        return CacheEntry.model_validate_json(file.read_bytes())
    except (OSError, ValidationError, ValueError):
        return CacheEntry()


def lookup(folder: Path, key: str, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The cached profile document for ``key`` whose recorded inputs all still hold (in ``environ``), or None."""
    hashes: dict[str, str | None] = {}
    for variant in read_entry(_entry_path(folder, key)).variants:
        if inputs_hold(variant.inputs, hashes, environ):
            return dict(variant.profile)
    return None


def store(folder: Path, key: str, inputs: RecordedInputs, profile: Mapping[str, Any]) -> bool:
    """Keep ``profile`` under ``key`` with the ``inputs`` it was made from (newest first, at most
    :data:`MAX_VARIANTS`); atomic. False (nothing written) when the folder cannot be written."""
    file = _entry_path(folder, key)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        kept = [v for v in read_entry(file).variants if v.inputs != inputs]
        entry = CacheEntry(variants=(CachedProfile(inputs=inputs, profile=dict(profile)), *kept)[:MAX_VARIANTS])
        fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(entry.model_dump_json())
            os.replace(tmp, file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        prune(folder)
    except OSError:
        return False
    return True


def prune(folder: Path, *, max_entries: int = MAX_ENTRIES, now: float | None = None) -> None:
    """Remove the least recently written entries past ``max_entries`` and temp files left by interrupted writes."""
    now = time.time() if now is None else now
    entries: list[tuple[float, Path]] = []
    for file in folder.iterdir():
        try:
            mtime = file.stat().st_mtime
        except OSError:
            continue
        if file.name.startswith(".profile-") and file.suffix == ".tmp":
            if now - mtime > STALE_TEMP_S:
                file.unlink(missing_ok=True)
        elif file.suffix == ".json":
            entries.append((mtime, file))
    for _, file in sorted(entries)[:max(0, len(entries) - max_entries)]:
        file.unlink(missing_ok=True)
