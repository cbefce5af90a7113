"""write_files: all-or-nothing, atomic, never outside the output folder."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from optplan.estimators.errors import OptplanError
from optplan.planner.export import files as files_mod
from optplan.planner.export.files import write_files

FILES = {"ds_config.json": "{}\n", "launch.sh": "#!/usr/bin/env bash\necho hi\n", "plan.md": "# Plan\n\u00e9\n"}


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_writes_all_files_in_order(tmp_path):
    out = tmp_path / "a" / "b"
    paths = write_files(out, FILES, force=False)
    assert paths == [out / name for name in FILES]
    for name, text in FILES.items():
        assert (out / name).read_text(encoding="utf-8") == text
    assert listing(out) == sorted(FILES)  # no temporary files left


def test_shell_scripts_are_executable_and_others_not(tmp_path):
    write_files(tmp_path, FILES, force=False)
    assert os.stat(tmp_path / "launch.sh").st_mode & stat.S_IXUSR
    assert not os.stat(tmp_path / "ds_config.json").st_mode & stat.S_IXUSR
    assert os.stat(tmp_path / "ds_config.json").st_mode & stat.S_IRUSR


def test_refuses_existing_files_before_writing_anything(tmp_path):
    (tmp_path / "launch.sh").write_text("mine\n")
    with pytest.raises(OptplanError, match=r"launch\.sh already exists: pass --force"):
        write_files(tmp_path, FILES, force=False)
    assert listing(tmp_path) == ["launch.sh"]  # nothing else written
    assert (tmp_path / "launch.sh").read_text() == "mine\n"


def test_refusal_names_every_existing_file(tmp_path):
    for name in ("ds_config.json", "plan.md"):
        (tmp_path / name).write_text("old\n")
    with pytest.raises(OptplanError) as info:
        write_files(tmp_path, FILES, force=False)
    message = str(info.value)
    assert "ds_config.json" in message and "plan.md" in message and "--force" in message
    assert "launch.sh" not in message


def test_force_overwrites(tmp_path):
    (tmp_path / "plan.md").write_text("old\n")
    write_files(tmp_path, FILES, force=True)
    assert (tmp_path / "plan.md").read_text(encoding="utf-8") == FILES["plan.md"]
    assert listing(tmp_path) == sorted(FILES)


def test_force_replaces_a_symlink_not_its_target(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "plan.md").symlink_to(outside)
    with pytest.raises(OptplanError, match="--force"):
        write_files(out, {"plan.md": "new\n"}, force=False)
    write_files(out, {"plan.md": "new\n"}, force=True)
    assert outside.read_text() == "keep\n"
    assert not (out / "plan.md").is_symlink() and (out / "plan.md").read_text() == "new\n"


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", ".", "", "/etc/passwd", "nul\0byte"])
def test_rejects_names_that_are_not_plain(tmp_path, name):
    out = tmp_path / "out"
    with pytest.raises(OptplanError, match="plain file name"):
        write_files(out, {"ok.txt": "x", name: "y"}, force=True)
    assert not out.exists()  # rejected before the folder is even created
    assert listing(tmp_path) == []


def test_folder_in_the_way_is_an_error(tmp_path):
    (tmp_path / "plan.md").mkdir()
    with pytest.raises(OptplanError, match="a folder of that name exists"):
        write_files(tmp_path, FILES, force=True)
    assert listing(tmp_path) == ["plan.md"]


def test_output_folder_under_a_file_is_an_error_naming_it(tmp_path):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "out"
    with pytest.raises(OptplanError, match=f"cannot create output folder {out}"):
        write_files(out, FILES, force=False)


def test_output_folder_that_is_a_file_is_an_error(tmp_path):
    out = tmp_path / "out"
    out.write_text("x")
    with pytest.raises(OptplanError, match=str(out)):
        write_files(out, FILES, force=True)
    assert out.read_text() == "x"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores folder permissions")
def test_unwritable_folder_is_an_error_naming_it(tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        with pytest.raises(OptplanError, match=f"cannot write to output folder {out}"):
            write_files(out, FILES, force=False)
        assert listing(out) == []
    finally:
        out.chmod(0o700)


def test_failure_midway_leaves_nothing_behind(tmp_path, monkeypatch):
    real_fsync = os.fsync
    calls = {"n": 0}

    def flaky_fsync(fd):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(files_mod.os, "fsync", flaky_fsync)
    (tmp_path / "plan.md").write_text("old\n")
    with pytest.raises(OptplanError, match="No space left on device"):
        write_files(tmp_path, FILES, force=True)
    assert listing(tmp_path) == ["plan.md"]  # no new files, no temporary files
    assert (tmp_path / "plan.md").read_text() == "old\n"  # the existing file untouched


def test_non_text_content_is_rejected_before_writing(tmp_path):
    with pytest.raises(OptplanError, match="no text content"):
        write_files(tmp_path / "out", {"a.txt": "x", "b.bin": b"y"}, force=False)  # type: ignore[dict-item]
    assert not (tmp_path / "out").exists()


def test_permission_denied_is_an_error_naming_the_folder(tmp_path, monkeypatch):
    """The same path as an unwritable folder, also when running as root (which ignores modes)."""

    def denied(*_args, **_kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(files_mod.tempfile, "mkstemp", denied)
    with pytest.raises(OptplanError, match=f"cannot write to output folder {tmp_path}: Permission denied"):
        write_files(tmp_path, FILES, force=False)
    assert listing(tmp_path) == []


@pytest.mark.parametrize(("fault", "after"), [(KeyboardInterrupt(), False), (KeyboardInterrupt(), True),
                                              (OSError(18, "Invalid cross-device link"), False)],
                         ids=["ctrl-c", "ctrl-c-after-the-rename", "oserror"])
def test_a_fault_between_renames_brings_the_old_set_back(tmp_path, monkeypatch, fault, after):
    """Two of three targets exist; the second rename fails (or Ctrl-C lands just after it, as CPython
    delivers a signal when the system call returns): every target has its old content again, the new
    third one is not there, and no temporary or backup file is left."""
    (tmp_path / "ds_config.json").write_text("old ds\n")
    (tmp_path / "launch.sh").write_text("old launch\n")
    real_replace = os.replace
    calls = {"n": 0}

    def flaky_replace(src, dst):
        if str(src).endswith(".tmp"):
            calls["n"] += 1
            if calls["n"] == 2:
                if after:
                    real_replace(src, dst)
                raise fault
        return real_replace(src, dst)

    monkeypatch.setattr(files_mod.os, "replace", flaky_replace)
    with pytest.raises(type(fault) if isinstance(fault, KeyboardInterrupt) else OptplanError):
        write_files(tmp_path, FILES, force=True)
    assert listing(tmp_path) == ["ds_config.json", "launch.sh"]
    assert (tmp_path / "ds_config.json").read_text() == "old ds\n"
    assert (tmp_path / "launch.sh").read_text() == "old launch\n"


def test_a_new_set_replaces_an_old_one_without_leftovers(tmp_path):
    (tmp_path / "plan.md").write_text("old\n")
    os.link(tmp_path / "plan.md", tmp_path / "keep.md")  # someone else's hard link to the old content
    write_files(tmp_path, FILES, force=True)
    assert listing(tmp_path) == sorted([*FILES, "keep.md"])
    assert (tmp_path / "plan.md").read_text(encoding="utf-8") == FILES["plan.md"]
    assert (tmp_path / "keep.md").read_text() == "old\n"  # a replace, never a write through the old inode
