"""The profile cache (probes/profile_cache.py, probes/input_record.py): a profile is reused exactly while what it read
is unchanged: the model file, the local module it imports, the data file it opens, the environment variable it reads;
anything else is profiled again. Errors are never cached; ``OPTPLAN_PROFILE_CACHE=off`` and ``use_cache=False`` turn
it off."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import optplan.probes.loader as loader
import optplan.probes.profile_cache as profile_cache
from optplan.probes.input_record import _RecordingEnviron, file_sha256
from optplan.probes.loader import ModelFileError, profile_model_file
from optplan.probes.profile_cache import (
    MAX_VARIANTS,
    PROFILE_CACHE_ENV,
    STALE_TEMP_S,
    RecordedInputs,
    inputs_hold,
    lookup,
    profile_cache_dir,
    prune,
    request_key,
    store,
)

# --- the child's record --------------------------------------------------------------------------------------------

RECORD_SCRIPT = """
import json, os, sys
from optplan.probes.input_record import InputRecorder
rec = InputRecorder()
rec.install()
sys.path.insert(0, sys.argv[1])
os.environ.get("OPTPLAN_TEST_READ")            # read, set
os.getenv("OPTPLAN_TEST_ABSENT")               # read, absent
"OPTPLAN_TEST_IN" in os.environ                # membership is a read
os.environ["OPTPLAN_TEST_OWN"] = "1"           # set here first: not an input
os.environ.get("OPTPLAN_TEST_OWN")
env_copy = os.environ.copy()                   # a copy for a subprocess reads nothing
with open(os.path.join(sys.argv[1], "cfg.json")) as fh:
    json.load(fh)
try:
    open(os.path.join(sys.argv[1], "absent.json"))
except OSError:
    pass
with open(os.path.join(sys.argv[1], "out.txt"), "w") as fh:   # written: not an input
    fh.write("x")
import localmod                                 # a sibling module
import tabulate                                 # an installed package
import email.parser                             # the standard library
print(json.dumps(rec.report(own_roots=())))
"""


def _record(tmp_path: Path, env: dict[str, str]) -> dict:
    (tmp_path / "cfg.json").write_text('{"width": 8}')
    (tmp_path / "localmod.py").write_text("WIDTH = 8\n")
    script = tmp_path / "record.py"
    script.write_text(RECORD_SCRIPT)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OPTPLAN_TEST_")}
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                         env={**clean, **env}, timeout=120, check=True)
    return json.loads(out.stdout)


def _sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def test_the_child_records_what_it_read_and_only_that(tmp_path: Path) -> None:
    rec = _record(tmp_path, {"OPTPLAN_TEST_READ": "yes", "OPTPLAN_TEST_UNREAD": "x"})
    files = rec["files"]
    assert files[str(tmp_path / "cfg.json")] == file_sha256(str(tmp_path / "cfg.json"))
    assert files[str(tmp_path / "localmod.py")] == file_sha256(str(tmp_path / "localmod.py"))
    assert files[str(tmp_path / "absent.json")] is None  # a file it looked for and did not find
    assert str(tmp_path / "out.txt") not in files
    assert str(tmp_path / "record.py") in files  # the script itself (__main__)
    assert not any("__pycache__" in f or "/email/" in f or "site-packages" in f for f in files), files
    assert {k: v for k, v in rec["env"].items() if k.startswith("OPTPLAN_TEST_")} == {
        "OPTPLAN_TEST_READ": _sha("yes"), "OPTPLAN_TEST_ABSENT": None, "OPTPLAN_TEST_IN": None}  # hashes, not values
    assert rec["cwd"] is None  # every path was absolute
    assert RecordedInputs.model_validate(rec).files == files


def _environ(values: dict[str, str]) -> os._Environ[str]:
    """An ``os.environ`` of its own over ``values`` (the process's environment is not touched)."""
    e = os.environ
    data = {e.encodekey(k): e.encodevalue(v) for k, v in values.items()}
    return os._Environ(data, e.encodekey, e.decodekey, e.encodevalue, e.decodevalue)  # type: ignore[attr-defined]


def _module(path: Path, name: str) -> Any:
    path.write_text("def scan(env):\n    return dict(env)\n\n\ndef peek(env):\n    env.keys()\n    return env['B']\n")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_librarys_dict_of_the_environment_is_a_scan_and_user_codes_reads_every_key(tmp_path: Path) -> None:
    """fsspec's config runs ``dict(os.environ)`` at import (to find its FSSPEC_* variables): from a library that is a
    scan, like ``items()``, else every LoRA profile (peft imports fsspec) kept the whole environment (PWD, SHLVL, ...)
    as its inputs and missed the cache in every new shell. The same call in the user's code still reads every key."""
    (tmp_path / "lib").mkdir()
    library = _module(tmp_path / "lib" / "scanlib.py", "optplan_test_scanlib")
    user = _module(tmp_path / "usercode.py", "optplan_test_usercode")
    values = {"A": "1", "B": "2"}
    seen: dict[str, str | None] = {}
    env = _RecordingEnviron(_environ(values), seen, (str(tmp_path / "lib"),))
    assert library.scan(env) == values and seen == {}
    assert env.get("B") == "2" and seen == {"B": "2"}  # a read by name after the scan is a read
    seen.clear()
    assert library.peek(env) == "2" and seen == {"B": "2"}  # keys() then one key by name: a read
    seen.clear()
    user_env = _RecordingEnviron(_environ(values), seen, (str(tmp_path / "lib"),))
    assert user.scan(user_env) == values and seen == values


# --- validation and storage -----------------------------------------------------------------------------------------

def test_inputs_hold_checks_files_env_and_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "cfg.json"
    data.write_text("1")
    monkeypatch.setenv("OPTPLAN_TEST_X", "a")
    monkeypatch.delenv("OPTPLAN_TEST_Y", raising=False)
    good = RecordedInputs(files={str(data): file_sha256(str(data)), str(tmp_path / "gone"): None},
                          env={"OPTPLAN_TEST_X": _sha("a"), "OPTPLAN_TEST_Y": None})
    assert inputs_hold(good)
    assert not inputs_hold(good.model_copy(update={"cwd": str(tmp_path / "elsewhere")}))
    assert inputs_hold(good.model_copy(update={"cwd": os.getcwd()}))
    monkeypatch.setenv("OPTPLAN_TEST_X", "b")
    assert not inputs_hold(good)
    monkeypatch.setenv("OPTPLAN_TEST_X", "a")
    monkeypatch.setenv("OPTPLAN_TEST_Y", "now set")
    assert not inputs_hold(good)
    monkeypatch.delenv("OPTPLAN_TEST_Y")
    (tmp_path / "gone").write_text("appeared")
    assert not inputs_hold(good)
    (tmp_path / "gone").unlink()
    assert inputs_hold(good)
    data.write_text("2")
    assert not inputs_hold(good)


def _inputs(value: str) -> RecordedInputs:
    return RecordedInputs(files={}, env={"OPTPLAN_TEST_V": _sha(value)})


def test_store_keeps_variants_newest_first_and_survives_bad_files(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "profiles"
    for i in range(MAX_VARIANTS + 2):
        assert store(folder, "k", _inputs(str(i)), {"n": i})
    doc = json.loads((folder / "k.json").read_text())
    assert [v["profile"]["n"] for v in doc["variants"]] == list(range(MAX_VARIANTS + 1, 1, -1))
    monkeypatch.setenv("OPTPLAN_TEST_V", "3")
    assert lookup(folder, "k") == {"n": 3}
    monkeypatch.setenv("OPTPLAN_TEST_V", "0")  # pushed out by newer variants
    assert lookup(folder, "k") is None
    assert store(folder, "k", _inputs("3"), {"n": 33})  # same inputs: replaced and moved to the front
    variants = json.loads((folder / "k.json").read_text())["variants"]
    assert [v["profile"]["n"] for v in variants] == [33, MAX_VARIANTS + 1, MAX_VARIANTS, 2]
    for damaged in ("{not json", '{"format": 2, "variants": [{"inputs": {"files": [], "env": {}}, "profile": {}}]}',
                    '{"format": 1, "variants": []}', "[]"):
        (folder / "k.json").write_text(damaged)
        assert lookup(folder, "k") is None
    assert store(folder, "k", _inputs("3"), {"n": 1})  # a damaged entry is replaced
    monkeypatch.setenv("OPTPLAN_TEST_V", "3")
    assert lookup(folder, "k") == {"n": 1}

    def refuse(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(profile_cache.os, "replace", refuse)
    assert not store(folder, "k", _inputs("4"), {"n": 4})  # cannot write: skipped, no error
    assert sorted(p.name for p in folder.iterdir()) == ["k.json"]  # its temp file removed
    monkeypatch.undo()
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    assert not store(blocked, "k", _inputs("4"), {"n": 4})


def test_prune_drops_the_oldest_entries_and_stale_temp_files(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"{i}.json").write_text("{}")
        os.utime(tmp_path / f"{i}.json", (1000 + i, 1000 + i))
    (tmp_path / ".profile-old.tmp").write_text("")
    os.utime(tmp_path / ".profile-old.tmp", (1000, 1000))
    (tmp_path / ".profile-new.tmp").write_text("")
    prune(tmp_path, max_entries=3, now=1000 + STALE_TEMP_S / 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".profile-new.tmp", ".profile-old.tmp", "2.json", "3.json",
                                                          "4.json"]
    prune(tmp_path, max_entries=3, now=1001 + STALE_TEMP_S)
    assert ".profile-old.tmp" not in {p.name for p in tmp_path.iterdir()}


def test_the_cache_folder_and_the_off_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROFILE_CACHE_ENV, raising=False)
    monkeypatch.setenv("OPTPLAN_CACHE_DIR", str(tmp_path / "c"))
    assert profile_cache_dir() == tmp_path / "c" / "profiles"
    monkeypatch.setenv(PROFILE_CACHE_ENV, str(tmp_path / "p"))
    assert profile_cache_dir() == tmp_path / "p"
    for off in ("off", "0", "false", "NO"):
        monkeypatch.setenv(PROFILE_CACHE_ENV, off)
        assert profile_cache_dir() is None


def test_the_request_key_follows_file_options_env_and_installed_packages(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m.py"
    model.write_text("x = 1\n")
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(profile_cache, "site_roots", lambda: (str(site),))
    base = request_key(model, ["--seq-len", "8"])
    assert base is not None and base == request_key(model, ["--seq-len", "8"])
    assert request_key(model, ["--seq-len", "16"]) != base
    for name in ("OPTPLAN_TEST_K", "PYTHONPATH", "TORCH_LOGS"):
        monkeypatch.setenv(name, "1")
        assert request_key(model, ["--seq-len", "8"]) != base, name
        monkeypatch.delenv(name)
    monkeypatch.setenv("OPTPLAN_CACHE_DIR", str(tmp_path / "elsewhere"))  # where caches go is not an input
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind"))
    monkeypatch.setenv("OPTPLAN_DEVICE_LOCK", str(tmp_path / "device.lock"))  # nor how processes take turns
    monkeypatch.setenv("OPTPLAN_QUIET_GROUP", str(tmp_path / "quiet"))
    assert request_key(model, ["--seq-len", "8"]) == base
    # the file the child imports, however it is spelt: relative, through "..", through a symlink
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.py").symlink_to(model)
    monkeypatch.chdir(tmp_path)
    for spelling in ("m.py", "./sub/../m.py", tmp_path / "link.py"):
        assert request_key(spelling, ["--seq-len", "8"]) == base, spelling
    other = tmp_path / "sub" / "m.py"
    other.write_text("x = 1\n")  # the same bytes elsewhere: its own key (what it reads beside it may differ)
    assert request_key(other, ["--seq-len", "8"]) != base
    (site / "flash_attn-2.7.0.dist-info").mkdir()  # a package installed, imported by the model or not
    assert request_key(model, ["--seq-len", "8"]) != base
    (site / "flash_attn-2.7.0.dist-info").rmdir()
    assert request_key(model, ["--seq-len", "8"]) == base
    model.write_text("x = 2\n")
    assert request_key(model, ["--seq-len", "8"]) != base
    assert request_key(tmp_path / "missing.py", []) is None


def test_a_child_that_cannot_record_still_returns_its_profile() -> None:
    code = ("import json\nimport optplan.probes._child as c\n"
            "class Broken:\n    def report(self, **kw):\n        raise OSError('the working folder is gone')\n"
            "print(json.dumps(c._inputs(Broken())))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == {} and "the working folder is gone" in out.stderr


# --- end to end, with the profiler child ------------------------------------------------------------------------------

MODEL = '''
import json, os
from pathlib import Path
import torch
import torch.nn as nn
from tinylayers import Block

WIDTH = json.loads((Path(__file__).parent / "cfg.json").read_text())["width"]
DEPTH = int(os.environ.get("OPTPLAN_TEST_DEPTH", "2"))
TOKEN = os.environ.get("MY_TEST_TOKEN")  # read, never stored


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(WIDTH) for _ in range(DEPTH)])

    def forward(self, x, labels=None):
        for b in self.blocks:
            x = b(x)
        return x


def build_model():
    return Net()


def example_batch(batch_size, seq_len):
    return torch.randn(batch_size, WIDTH), torch.zeros(batch_size, dtype=torch.long)


def loss_fn(out, labels):
    return out.float().pow(2).mean()
'''


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "cfg.json").write_text('{"width": 16}')
    (folder / "tinylayers.py").write_text(textwrap.dedent("""
        import torch.nn as nn

        class Block(nn.Module):
            def __init__(self, width):
                super().__init__()
                self.fc = nn.Linear(width, width)

            def forward(self, x):
                return x + self.fc(x)
    """))
    (folder / "net.py").write_text(MODEL)
    monkeypatch.setenv(PROFILE_CACHE_ENV, str(tmp_path / "profiles"))
    monkeypatch.delenv("OPTPLAN_TEST_DEPTH", raising=False)
    return folder / "net.py"


class ChildCounter:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.runs = 0
        real = loader._run_child

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.runs += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(loader, "_run_child", counted)


def test_a_profile_is_reused_until_something_it_read_changes(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    children = ChildCounter(monkeypatch)
    folder = Path(os.environ[PROFILE_CACHE_ENV])
    monkeypatch.setenv("MY_TEST_TOKEN", "hunter2-not-on-disk")
    monkeypatch.setenv("COLUMNS", "123")  # argparse's, not the model's: not an input
    first = profile_model_file(tiny)
    assert not first.from_cache and children.runs == 1
    monkeypatch.setenv("COLUMNS", "77")
    again = profile_model_file(tiny)
    assert again.from_cache and children.runs == 1
    assert again.model_dump(exclude={"from_cache"}) == first.model_dump(exclude={"from_cache"})
    assert first.params == 2 * (16 * 16 + 16)
    (entry,) = folder.glob("*.json")
    recorded = json.loads(entry.read_text())["variants"][0]["inputs"]
    assert "hunter2" not in entry.read_text() and recorded["env"]["MY_TEST_TOKEN"] == _sha("hunter2-not-on-disk")
    assert "COLUMNS" not in recorded["env"] and "LANG" not in recorded["env"]
    assert {Path(f).name for f in recorded["files"]} >= {"cfg.json", "net.py", "tinylayers.py"}
    assert all(Path(f).is_file() for f in recorded["files"])  # no temp-folder probe, nothing written

    (tiny.parent / "tinylayers.py").write_text((tiny.parent / "tinylayers.py").read_text().replace(
        "nn.Linear(width, width)", "nn.Linear(width, width, bias=False)"))  # the imported sibling module
    edited = profile_model_file(tiny)
    assert not edited.from_cache and children.runs == 2 and edited.params == 2 * 16 * 16

    (tiny.parent / "cfg.json").write_text('{"width": 8}')  # the data file it opens
    narrow = profile_model_file(tiny)
    assert not narrow.from_cache and children.runs == 3 and narrow.params == 2 * 8 * 8

    monkeypatch.setenv("OPTPLAN_TEST_DEPTH", "3")  # the variable it reads
    deep = profile_model_file(tiny)
    assert not deep.from_cache and children.runs == 4 and deep.params == 3 * 8 * 8
    monkeypatch.delenv("OPTPLAN_TEST_DEPTH")
    back = profile_model_file(tiny)  # the earlier variant is still there
    assert back.from_cache and children.runs == 4 and back.params == 2 * 8 * 8
    monkeypatch.setenv("MY_TEST_TOKEN", "another")
    assert not profile_model_file(tiny).from_cache and children.runs == 5

    assert not profile_model_file(tiny, use_cache=False).from_cache and children.runs == 6
    entry.write_text('{"format": 2, "variants": [{"inputs": {"files": {}, "env": {}}, "profile": {"name": 1}}]}')
    assert not profile_model_file(tiny).from_cache and children.runs == 7  # a damaged entry: a miss, replaced
    assert profile_model_file(tiny).from_cache and children.runs == 7
    monkeypatch.setenv(PROFILE_CACHE_ENV, "off")
    assert not profile_model_file(tiny).from_cache and children.runs == 8


def test_no_usable_cache_folder_is_no_cache_not_an_error(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HOME unset and no passwd entry (Path.home() raises): the profile is made, nothing is kept."""
    children = ChildCounter(monkeypatch)
    for name in (PROFILE_CACHE_ENV, "OPTPLAN_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", no_home)
    assert profile_model_file(tiny).params == 2 * (16 * 16 + 16) and children.runs == 1
    assert profile_model_file(tiny).params and children.runs == 2


def test_errors_are_never_cached(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    children = ChildCounter(monkeypatch)
    (tiny.parent / "cfg.json").write_text('{"width": "sixteen"}')
    for expected_runs in (1, 2):
        with pytest.raises(ModelFileError):
            profile_model_file(tiny)
        assert children.runs == expected_runs
    assert not any(Path(os.environ[PROFILE_CACHE_ENV]).glob("*.json"))


def test_env_reaches_the_child_and_keys_the_cache_without_touching_os_environ(
        tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``env=`` (threads profiling different files with different variables at once): the child reads it, the cache
    keeps one variant per value and finds each again by it, and this process's environment is left alone."""
    children = ChildCounter(monkeypatch)
    deep = profile_model_file(tiny, env={"OPTPLAN_TEST_DEPTH": "3"})
    assert not deep.from_cache and deep.params == 3 * (16 * 16 + 16) and children.runs == 1
    assert "OPTPLAN_TEST_DEPTH" not in os.environ
    plain = profile_model_file(tiny)
    assert not plain.from_cache and plain.params == 2 * (16 * 16 + 16) and children.runs == 2
    again = profile_model_file(tiny, env={"OPTPLAN_TEST_DEPTH": "3"})
    assert again.from_cache and again.params == deep.params and children.runs == 2
    monkeypatch.setenv("OPTPLAN_TEST_DEPTH", "3")  # the same value from the environment: the same profile
    assert profile_model_file(tiny).from_cache and children.runs == 2
