"""Child side of the profile cache: record what a profile read, so that a later run can tell if it still holds.

A profile is a function of the model file, but also of what that file reads while it runs: the local modules it
imports (a ``layers.py`` beside it), the data files it opens (a ``config.json``) and the environment variables it
looks at (``OPTPLAN_*`` and its own). :class:`InputRecorder` records them in the profiler child
(``optplan.probes._child``) with the interpreter's own hooks rather than guesses:

* files: a :pep:`578` audit hook (``sys.addaudithook``) sees every ``open`` event raised by Python code (``open``,
  ``os.open``, ``io.open_code`` for imports); plus the ``__file__`` of every module imported, since an import with
  a valid ``__pycache__`` entry opens the ``.pyc`` and only stats the source. A file opened for reading that did not
  exist is recorded as absent (a later one would change the profile);
* environment: ``os.environ`` is swapped for a subclass of its own class over the same data, which records the
  SHA-256 of the first value of each key read by name (``os.getenv``, ``os.environ.get``, ``in``; absent: None)
  before this process set it itself. Values are never stored, so a token a model reads does not reach the disk.
  Scans (``items()``, ``values()``, ``copy()``: tqdm reads every ``TQDM_*`` so; ``dict(os.environ)`` called from the
  standard library or an installed package: fsspec's config reads every ``FSSPEC_*`` so at import) are not reads of
  each key; ``dict(os.environ)`` in user code does read each key, and then the whole environment is an input.

Files under the standard library and the site-packages folders are not hashed (the parent keys on the Python
version and on the installed distributions), nor optplan's own (the key holds a digest of its source). What is
*not* seen: files opened by C/C++ code (safetensors, tokenizers), existence checks (``os.path.exists``) and folder
listings, a local module whose import failed, and environment variables read only by C/C++ code (the parent keys on
every ``OPTPLAN_*``, ``TORCH*`` and ``PYTORCH*`` variable for that reason). Standard library only: it is installed
before torch or the model file is imported.
"""

from __future__ import annotations

import hashlib
import os
import site
import stat
import sys
import sysconfig
from collections.abc import Iterable
from typing import Any

INPUTS_KEY = "optplan_profile_inputs"
"""Key of the record in the child's JSON profile document (:meth:`InputRecorder.report`); the parent takes it out."""
VOLATILE_ENV = frozenset({"TORCHINDUCTOR_CACHE_DIR", "OPTPLAN_CACHE_DIR", "OPTPLAN_PROFILE_CACHE", "PYTHONSAFEPATH",
                          "OPTPLAN_GUARD_PID", "OPTPLAN_DEVICE_LOCK", "OPTPLAN_QUIET_GROUP", "OPTPLAN_PROBE_TOKEN",
                          "COLUMNS", "LINES"})
"""Variables that differ on every run, only say where caches go or how processes take turns (the device lock's file,
the quiet group's folder: probes/runtime.py, probes/host_quiet.py; a probe's token: probes/distributed.py), or give
the terminal's size (``COLUMNS``, ``LINES``: ``shutil.get_terminal_size`` reads them, e.g. accelerate's menu helpers
at import): never a profile's input."""
SKIPPED_ROOTS = ("/proc/", "/sys/", "/dev/")


def file_sha256(path: str) -> str | None:
    """SHA-256 hex digest of a regular file's bytes; None when it is missing, cannot be read or is not a regular
    file (a FIFO is never read: it could block)."""
    digest = hashlib.sha256()
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    except (OSError, ValueError):  # ValueError: a path with a NUL byte
        return None
    return digest.hexdigest()


def value_sha256(value: str | None) -> str | None:
    """What the cache keeps of an environment value: its SHA-256 (hex), None when the variable is unset."""
    return None if value is None else hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()


def _is_input(mode: object, flags: object) -> bool:
    """Whether an ``open`` event reads the file's existing content (``r``, ``rb``, ``r+``; ``os.open`` without
    ``O_WRONLY``, ``O_TRUNC`` or ``O_CREAT``: tempfile's probe of the temp folder opens a new name ``O_RDWR |
    O_CREAT | O_EXCL``), rather than only writing it."""
    if isinstance(mode, str):
        return "r" in mode
    return (isinstance(flags, int) and flags & os.O_ACCMODE != os.O_WRONLY
            and not flags & (os.O_TRUNC | os.O_CREAT))


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

    def __init__(self, real: Any, seen: dict[str, str | None], library_roots: tuple[str, ...] = ()) -> None:
        super().__init__(real._data, real.encodekey, real.decodekey, real.encodevalue, real.decodevalue)
        self._seen = seen
        self._written: set[str] = set()
        self._library_roots = library_roots
        self._scan: tuple[Any, list[str]] | None = None
        """(the library frame that called ``keys()``, the keys it has still to read in order): ``dict(os.environ)``."""

    def keys(self) -> Any:
        """``dict(os.environ)`` calls ``keys()`` then reads every key in that order from the caller's frame: from a
        library's frame that is a scan (:meth:`_scanned`), like ``items()``."""
        caller = sys._getframe(1)
        if _under(os.path.abspath(caller.f_code.co_filename), self._library_roots):
            self._scan = (caller, list(reversed([self.decodekey(k) for k in self._data])))
        return super().keys()

    def _scanned(self, key: str) -> bool:
        """Whether this read of ``key`` is the next of a library's ``dict(os.environ)`` (:meth:`keys`); any other
        read ends the scan."""
        if self._scan is None:
            return False
        frame, pending = self._scan
        if pending and pending[-1] == key and sys._getframe(2) is frame:
            pending.pop()
            if not pending:
                self._scan = None
            return True
        self._scan = None
        return False

    def __getitem__(self, key: str) -> str:
        scanned = self._scanned(key)
        try:
            value: str = super().__getitem__(key)
        except KeyError:
            if not scanned:
                self._note(key, None)
            raise
        if not scanned:
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
    """Records the files and environment variables a profile read (see the module docstring).

    :meth:`install` once in the child, after its own arguments are parsed and before torch or the model file is
    imported (the audit hook cannot be removed: the child is short-lived); :meth:`report` at the end gives the
    JSON-able record the parent's cache keeps beside the profile."""

    def __init__(self) -> None:
        self._opened: set[str] = set()
        self._relative: set[str] = set()
        self._env: dict[str, str | None] = {}
        self._cwd = ""

    def install(self) -> None:
        opened, relative = self._opened, self._relative
        self._cwd = os.getcwd()

        def hook(event: str, args: tuple[Any, ...]) -> None:
            if event != "open" or not args or not _is_input(args[1] if len(args) > 1 else None,
                                                             args[2] if len(args) > 2 else None):
                return
            raw = args[0]
            if isinstance(raw, (str, bytes, os.PathLike)):
                path = os.fsdecode(raw)
                full = os.path.abspath(path)  # against the working folder of the moment
                opened.add(full)
                if not os.path.isabs(path):
                    relative.add(full)

        sys.addaudithook(hook)
        os.environ = _RecordingEnviron(os.environ, self._env,  # type: ignore[misc]  # noqa: B003 - same data, recorded
                                       (*stdlib_roots(), *site_roots()))

    def report(self, *, own_roots: Iterable[str]) -> dict[str, Any]:
        """``{"files": {absolute path: sha256 or None}, "env": {name: sha256 of the value or None}, "cwd": the
        working folder at install, or None}``: ``cwd`` only when a file was opened by a relative path."""
        env = {k: value_sha256(v) for k, v in sorted(self._env.items()) if k not in VOLATILE_ENV}  # before own reads
        skip = (*stdlib_roots(), *site_roots(), *(os.path.abspath(r) for r in own_roots))
        inductor = os.environ.copy().get("TORCHINDUCTOR_CACHE_DIR")  # a scan: not recorded
        skip += (os.path.abspath(inductor),) if inductor else ()
        # opened: kept even when missing (a file looked for and not found), except sys.path's own entries (folders,
        # zips and path-hook names such as an editable install's "__editable__...__path_hook__")
        entries = {os.path.abspath(p) for p in sys.path}
        candidates = {p for p in self._opened if p not in entries}
        for module in list(sys.modules.values()):
            file = getattr(module, "__file__", None)
            if isinstance(file, str) and os.path.isabs(file) and os.path.isfile(file):  # not torch's "_ops.py"
                candidates.add(os.path.abspath(file))
        files: dict[str, str | None] = {}
        for path in candidates:
            if f"{os.sep}__pycache__{os.sep}" in path or path.startswith(SKIPPED_ROOTS) or _under(path, skip):
                continue
            if os.path.exists(path) and not os.path.isfile(path):
                continue  # a folder, a FIFO, a device: not content
            files[path] = file_sha256(path)
        used_relative = any(p in files for p in self._relative)
        return {"files": dict(sorted(files.items())), "env": env, "cwd": self._cwd if used_relative else None}
