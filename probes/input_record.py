"""Child side of the profile cache: record what a profile read, so that a later run can tell if it still holds.

A profile is a function of the model file, but also of what that file reads while it runs: the local modules it
imports (a ``layers.py`` beside it), the data files it opens (a ``config.json``), the environment variables it
looks at (``OPTPLAN_*`` and its own), and the versions of the installed packages it imports (transformers,
timm). :class:`InputRecorder` records all four in the profiler child (``optplan.probes._child``), using the
interpreter's own hooks rather than guesses:

* files: a :pep:`578` audit hook (``sys.addaudithook``) sees every ``open`` event, whichever API opened the file
  (``open``, ``os.open``, ``io.open_code`` for imports); plus the ``__file__`` of every module imported, since an
  import with a valid ``__pycache__`` entry opens the ``.pyc`` and only stats the source;
* environment: ``os.environ`` is swapped for a subclass of its own class sharing the same data, which records the
  first value of each key read (``os.getenv``, ``os.environ.get``, ``in``) before this process set it itself;
* packages: the distribution and version of each module imported from a site-packages folder
  (``importlib.metadata``).

Files under the standard library and site-packages are not hashed (the Python version and the package versions
stand for them), nor optplan's own (the cache key holds a digest of its source). What is *not* seen: a local
module that would now shadow an installed one, a folder listing, and environment variables read by C/C++ code
(the parent keys on every ``OPTPLAN_*``, ``TORCH*`` and ``PYTORCH*`` variable for that reason). Standard library
only: this runs before torch is imported.
"""

from __future__ import annotations

import hashlib
import os
import site
import sys
import sysconfig
from collections.abc import Iterable
from importlib import metadata
from typing import Any

INPUTS_KEY = "optplan_profile_inputs"
"""Key of the record in the child's JSON profile document (:meth:`InputRecorder.report`); the parent takes it out."""
VOLATILE_ENV = frozenset({"TORCHINDUCTOR_CACHE_DIR", "OPTPLAN_CACHE_DIR", "OPTPLAN_PROFILE_CACHE", "PYTHONSAFEPATH",
                          "OPTPLAN_GUARD_PID"})
"""Variables that differ on every run or only say where caches go: never a profile's input."""
SKIPPED_ROOTS = ("/proc/", "/sys/", "/dev/")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def file_sha256(path: str) -> str | None:
    """SHA-256 hex digest of the file's bytes; None when it is missing or cannot be read."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def _is_read(mode: object, flags: object) -> bool:
    if isinstance(mode, str):
        return not any(c in mode for c in "wax+")
    return isinstance(flags, int) and not flags & _WRITE_FLAGS


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def site_roots() -> tuple[str, ...]:
    """The folders installed packages live in (purelib, platlib, the site and user-site folders)."""
    paths = sysconfig.get_paths()
    roots = [paths.get("purelib", ""), paths.get("platlib", "")]
    roots += list(getattr(site, "getsitepackages", list)())
    user = getattr(site, "getusersitepackages", lambda: "")()
    roots += [user] if isinstance(user, str) else []
    return tuple(sorted({os.path.abspath(r) for r in roots if r}))


def stdlib_roots() -> tuple[str, ...]:
    """The standard library's folders, and its zip (``lib/python311.zip``) where ``sys.path`` names one beside them."""
    paths = sysconfig.get_paths()
    roots = {os.path.abspath(paths[k]) for k in ("stdlib", "platstdlib") if paths.get(k)}
    beside = {os.path.dirname(r) for r in roots}
    roots |= {os.path.abspath(p) for p in sys.path if p.endswith(".zip") and os.path.dirname(os.path.abspath(p)) in beside}
    return tuple(sorted(roots))


class _RecordingEnviron(type(os.environ)):  # type: ignore[misc]
    """``os.environ`` over the same data, noting the first value of each key read before this process set it."""

    def __init__(self, real: Any, seen: dict[str, str | None]) -> None:
        super().__init__(real._data, real.encodekey, real.decodekey, real.encodevalue, real.decodevalue)
        self._seen = seen
        self._written: set[str] = set()

    def __getitem__(self, key: str) -> str:
        try:
            value: str = super().__getitem__(key)
        except KeyError:
            self._note(key, None)
            raise
        self._note(key, value)
        return value

    def _note(self, key: object, value: str | None) -> None:
        if isinstance(key, str) and key not in self._seen and key not in self._written:
            self._seen[key] = value

    def __setitem__(self, key: str, value: str) -> None:
        self._written.add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self._written.add(key)
        super().__delitem__(key)

    def copy(self) -> dict[str, str]:  # os._Environ.copy: a plain dict (for a subprocess), not a read of each key
        return {self.decodekey(k): self.decodevalue(v) for k, v in self._data.items()}

    def items(self) -> Any:  # a scan (tqdm reads every TQDM_* so): not a read of each key by name
        return self.copy().items()

    def values(self) -> Any:
        return self.copy().values()


class InputRecorder:
    """Records the files, environment variables and packages a profile read (see the module docstring).

    :meth:`install` once, first thing in the child (the audit hook cannot be removed: the child is short-lived);
    :meth:`report` at the end gives the JSON-able record the parent's cache keeps beside the profile."""

    def __init__(self) -> None:
        self._opened: set[str] = set()
        self._env: dict[str, str | None] = {}

    def install(self) -> None:
        opened = self._opened

        def hook(event: str, args: tuple[Any, ...]) -> None:
            if event == "open" and args and _is_read(args[1] if len(args) > 1 else None,
                                                     args[2] if len(args) > 2 else None):
                path = args[0]
                if isinstance(path, (str, os.PathLike)):
                    opened.add(os.fspath(path))  # type: ignore[arg-type]

        sys.addaudithook(hook)
        os.environ = _RecordingEnviron(os.environ, self._env)  # type: ignore[misc]  # noqa: B003 - same data, recorded

    def report(self, *, own_roots: Iterable[str]) -> dict[str, Any]:
        """``{"files": {abs path: sha256 or None}, "env": {name: value or None}, "dists": {name: version},
        "cwd": working folder or None}``: ``cwd`` only when a file was opened by a relative path."""
        skip = (*stdlib_roots(), *(os.path.abspath(r) for r in own_roots))
        sites = site_roots()
        inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        skip += (os.path.abspath(inductor),) if inductor else ()
        # opened: kept even when missing (a file looked for and not found), except sys.path's own entries (folders,
        # zips and path-hook names such as an editable install's "__editable__...__path_hook__")
        candidates = self._opened - set(sys.path)
        tops: set[str] = set()
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if isinstance(file, str) and os.path.isabs(file) and os.path.isfile(file):  # not torch's "_ops.py"
                candidates.add(file)
                if _under(file, sites):
                    tops.add(name.partition(".")[0])
        relative = False
        files: dict[str, str | None] = {}
        for raw in candidates:
            path = os.path.abspath(raw)
            if (f"{os.sep}__pycache__{os.sep}" in path or path.startswith(SKIPPED_ROOTS) or _under(path, skip)
                    or _under(path, sites) or os.path.isdir(path)):
                continue
            relative = relative or not os.path.isabs(raw)
            files[path] = file_sha256(path)
        env = {k: v for k, v in self._env.items() if k not in VOLATILE_ENV}
        return {"files": dict(sorted(files.items())), "env": dict(sorted(env.items())),
                "dists": package_versions(tops), "cwd": os.getcwd() if relative else None}


def package_versions(top_level: Iterable[str]) -> dict[str, str]:
    """``{distribution: version}`` of the installed distributions providing these top-level import names."""
    wanted = set(top_level)
    if not wanted:
        return {}
    owners = metadata.packages_distributions()
    versions: dict[str, str] = {}
    for top in wanted:
        for dist in owners.get(top, ()):
            try:
                versions[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
    return dict(sorted(versions.items()))
