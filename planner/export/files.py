"""Writing export files: all or nothing, atomically, never outside the output folder."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from optplan.estimators.errors import OptplanError

EXECUTABLE_SUFFIXES = (".sh",)


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or name in (".", ".."):
        raise OptplanError(f"export file name {name!r} is not a plain file name")
    separators = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    if any(sep in name for sep in separators) or "\0" in name:
        raise OptplanError(f"export file name {name!r} must be a plain file name inside the output folder "
                           "(no path separators)")
    return name


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    """Make the renames durable (POSIX); a no-op where directories cannot be opened."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_files(out_dir: Path, files: dict[str, str], *, force: bool) -> list[Path]:
    """Write ``files`` (name -> text, UTF-8) into ``out_dir`` and return their paths, in order.

    Nothing is written when a target exists and ``force`` is false (OptplanError naming the files
    and ``--force``), when a name is not a plain file name, or when a target is a folder. Every file
    is first written to a temporary file in ``out_dir`` and fsynced; only when all are written are
    they renamed into place (``os.replace``), so a failure leaves no partial or temporary files
    (each target is either untouched or complete). A failure or Ctrl-C between two renames puts the
    already replaced targets back (from hard-link backups) and removes the new ones: the folder holds
    the whole old set or the whole new set.
    ``*.sh`` files are made executable. An unwritable folder is an OptplanError naming it.
    """
    out_dir = Path(out_dir)
    names = [_check_name(name) for name in files]
    bad = [name for name in names if not isinstance(files[name], str)]
    if bad:
        raise OptplanError(f"export file {bad[0]!r} has no text content")  # a caller bug, caught early
    targets = [out_dir / name for name in names]

    folders = [str(t) for t in targets if t.is_dir()]
    if folders:
        raise OptplanError(f"cannot write {', '.join(folders)}: a folder of that name exists; "
                           "choose another output folder (--out)")
    existing = [str(t) for t in targets if t.exists() or t.is_symlink()]
    if existing and not force:
        raise OptplanError(f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: "
                           "pass --force to overwrite, or choose another output folder (--out)")

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OptplanError(f"cannot create output folder {out_dir}: {exc.strerror or exc}; "
                           "choose a writable folder (--out)") from exc
    if not out_dir.is_dir():
        raise OptplanError(f"output folder {out_dir} is not a folder: choose another (--out)")

    mask = _umask()
    staged: list[tuple[str, Path]] = []  # (temporary path, target)
    replaced: list[tuple[str, Path, str | None]] = []  # (temporary, target, backup of its old content or None)
    try:
        for name, target in zip(names, targets, strict=True):
            fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
            staged.append((tmp, target))
            with os.fdopen(fd, "wb") as fh:
                fh.write(files[name].encode("utf-8"))
                fh.flush()
                os.fsync(fh.fileno())
            mode = 0o777 if name.endswith(EXECUTABLE_SUFFIXES) else 0o666
            os.chmod(tmp, mode & ~mask)
        for tmp, target in staged:
            replaced.append((tmp, target, None))
            replaced[-1] = (tmp, target, _backup(target, out_dir))
            os.replace(tmp, target)
    except BaseException as exc:
        _roll_back(replaced)  # an error or Ctrl-C between two renames: the old set comes back whole
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # already renamed ones are gone: FileNotFoundError, suppressed
        if isinstance(exc, OSError):
            raise OptplanError(f"cannot write to output folder {out_dir}: {exc.strerror or exc}; "
                               "choose a writable folder (--out)") from exc
        raise
    for _, _, backup in replaced:
        if backup is not None:
            with contextlib.suppress(OSError):
                os.unlink(backup)
    _fsync_dir(out_dir)
    return targets


def _backup(target: Path, out_dir: Path) -> str | None:
    """A hidden second name for ``target``'s current content (a hard link: no copy, no moment without the
    file), or None when there is nothing to keep. Falls back to a copy where hard links are refused."""
    if not os.path.lexists(target):
        return None
    fd, backup = tempfile.mkstemp(dir=out_dir, prefix=f".{target.name}.", suffix=".old")
    os.close(fd)
    os.unlink(backup)
    try:
        os.link(target, backup, follow_symlinks=False)
    except OSError:
        try:
            shutil.copy2(target, backup, follow_symlinks=False)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(backup)
            raise
    return backup


def _roll_back(replaced: list[tuple[str, Path, str | None]]) -> None:
    """Undo what the renames did: each target gets its old content back, or goes when it was new. A
    signal can land between any two steps, so each entry is judged by what is on disk: while the
    temporary file still exists its rename did not happen (and the target, if any, is untouched)."""
    for tmp, target, backup in reversed(replaced):
        with contextlib.suppress(OSError):
            renamed = not os.path.lexists(tmp)
            if backup is None:
                if renamed:
                    os.unlink(target)
            elif renamed:
                os.replace(backup, target)
            else:
                os.unlink(backup)  # the same file as the untouched target: a rename onto it would do nothing
