"""Issue 7, security, through the real ``optplan`` console script in a subprocess.

- The model file is code: it runs only in a child process, and only when the user names it (no stray
  ``.py`` file in the folder optplan is started from is ever imported).
- ``OPTPLAN`` values, ``--cluster`` YAML files and ``plan.json`` files are parsed as data, never executed.
- Nothing is written outside ``--out`` (HOME, XDG folders, TMPDIR and the working folder stay untouched).
- No secret or environment variable ends up in an export.
- launch.sh, slurm.sbatch and the launch line in accelerate.yaml quote every user-provided value: paths,
  names and arguments with spaces, quotes, ``$(...)``, backticks and ``;`` reach fake launchers intact
  and nothing in them runs.

Every user-provided string below carries ``$(touch PWNED)`` and ```touch PWNED```: commands run from
inside the test folder, so a value that a shell ever executed leaves a ``PWNED`` file there.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import pytest

TOKEN = secrets.token_hex(8)
INJECT = "$(touch PWNED) `touch PWNED`"
WEIRD_DIR = f"we ird {INJECT} 'q' \"d\" ;x"
MODEL_FILE = f"m {INJECT};'q'.py"
OUT_DIR = f"out {INJECT} 'q' \"d\""
MODEL_NAME = f"n{INJECT}\n;'\"x"  # OPTPLAN["name"]: reaches comments and default job/rendezvous names
TRAIN_SCRIPT = f"t {INJECT};'q' \"d\".py"  # export --train-script
PASSTHROUGH = f"arg {INJECT};'q' \"d\""  # an argument given to launch.sh / slurm.sbatch
ARCH = "layers=2,hidden=64,heads=4,seq=128"

SECRETS: dict[str, str] = {
    "HF_TOKEN": f"hf_{secrets.token_hex(12)}",
    "WANDB_API_KEY": f"wandb{secrets.token_hex(12)}",
    "AWS_SECRET_ACCESS_KEY": f"aws{secrets.token_hex(12)}",
    "OPENAI_API_KEY": f"sk-{secrets.token_hex(12)}",
    "MY_PASSWORD": f"pw{secrets.token_hex(12)}",
    "USER": f"user{secrets.token_hex(6)}",
    "LOGNAME": f"logname{secrets.token_hex(6)}",
}

MODEL = """
import os
import torch.nn as nn
with open(PIDS, "a") as fh:  # the model file records which process imports it
    fh.write(f"{os.getpid()} {os.getppid()}\\n")
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.fc = nn.Linear(16, 64)
    def forward(self, x):
        return self.fc(self.emb(x))
def build_model():
    return Net()
"""

STRAY_NAMES = ("numpy.py", "model.py", "train.py", "mlp.py")
"""Python files in the folder optplan is started from: never named, so never imported (numpy.py shadows a
module torch imports)."""

FAKE = """#!/usr/bin/env bash
# a fake launcher: records its name and arguments, NUL-separated, and succeeds
if [[ "$(basename "$0")" == scontrol ]]; then echo node0; echo node1; exit 0; fi
printf '%s\\0' "$(basename "$0")" "$@" > "$FAKE_ARGV"
"""
FAKES = ("torchrun", "deepspeed", "accelerate", "srun", "python", "python3", "scontrol")


def optplan_command() -> list[str]:
    """The ``optplan`` console script of this environment (``python -m`` would put the cwd on sys.path)."""
    script = Path(sys.executable).with_name("optplan")
    return [str(script)] if script.exists() else [sys.executable, "-m", "optplan.tui.cli"]


def run_optplan(args: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*optplan_command(), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL, check=False)


Snapshot = dict[Path, tuple[int, int]]


def snapshot(root: Path) -> Snapshot:
    """Every path under ``root`` with (size, mtime) for files, (-1, 0) for the rest."""
    shot: Snapshot = {}
    for p in root.rglob("*"):
        st = p.lstat()
        shot[p] = (st.st_size, st.st_mtime_ns) if p.is_file() and not p.is_symlink() else (-1, 0)
    return shot


def changed(before: Snapshot, after: Snapshot) -> list[Path]:
    """Paths created, changed or removed between two snapshots."""
    return sorted({p for p in after if before.get(p) != after[p]} | (set(before) - set(after)))


def inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def pwned(root: Path) -> list[Path]:
    return sorted(root.rglob("PWNED*"))


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@dataclass(frozen=True)
class Planned:
    """One ``recommend --out`` of a model file at a hostile path, then one ``export`` of its plan.json."""

    root: Path  # everything the commands may see; PWNED would land in here
    area: Path  # the snapshot root: HOME, XDG folders, TMPDIR, the cwd, the model's folder
    cwd: Path
    home: Path
    out: Path  # recommend --out (deepspeed launcher)
    out2: Path  # export --out (torchrun launcher, hostile --train-script)
    markers: Path  # outside ``area``: what the model file and stray modules record
    fakes: Path
    env: dict[str, str]
    cli_pid: int
    recommend: subprocess.CompletedProcess[str]
    export: subprocess.CompletedProcess[str]
    changed_by_recommend: list[Path]
    changed_by_export: list[Path]


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Planned:
    root = tmp_path_factory.mktemp("security")
    markers = root / "markers"
    markers.mkdir()
    area = root / "area"
    home = area / f"home-{TOKEN}"
    cwd = area / "cwd"
    weird = area / WEIRD_DIR
    for folder in (home, area / "cache", area / "config", area / "data", area / "tmp", cwd, weird):
        folder.mkdir(parents=True)
    for name in STRAY_NAMES:
        (cwd / name).write_text(f"import pathlib\npathlib.Path({str(markers / name)!r}).write_text('imported')\n"
                                "raise ImportError('a stray module: optplan must never import it')\n")
    model = weird / MODEL_FILE
    model.write_text(f"PIDS = {str(markers / 'model-pids')!r}\n" + MODEL
                     + f'OPTPLAN = {{"seq_len": 32, "name": {MODEL_NAME!r}}}\n')
    fakes = root / "fakebin"
    fakes.mkdir()
    for name in FAKES:
        (fakes / name).write_text(FAKE)
        (fakes / name).chmod(0o755)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTPLAN", "XDG_"))}
    env.update(SECRETS, HOME=str(home), XDG_CACHE_HOME=str(area / "cache"), XDG_CONFIG_HOME=str(area / "config"),
               XDG_DATA_HOME=str(area / "data"), TMPDIR=str(area / "tmp"), CUDA_VISIBLE_DEVICES="")
    out, out2 = weird / OUT_DIR, weird / f"{OUT_DIR} 2"

    before = snapshot(area)
    proc = subprocess.Popen([*optplan_command(), "recommend", str(model), "--no-probe", "--gpu", "H100-SXM",
                             "--gpus", "16", "--engine", "deepspeed", "--launcher", "deepspeed", "--out", str(out)],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    stdout, stderr = proc.communicate(timeout=300)
    recommend = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    middle = snapshot(area)
    export = run_optplan(["export", str(out / "plan.json"), "--to", "all", "--out", str(out2),
                          "--launcher", "torchrun", "--train-script", TRAIN_SCRIPT], cwd=cwd, env=env)
    after = snapshot(area)
    return Planned(root=root, area=area, cwd=cwd, home=home, out=out, out2=out2, markers=markers, fakes=fakes,
                   env=env, cli_pid=proc.pid, recommend=recommend, export=export,
                   changed_by_recommend=changed(before, middle), changed_by_export=changed(middle, after))


def test_recommend_and_export_succeed_on_hostile_paths_and_nothing_runs(planned: Planned) -> None:
    assert planned.recommend.returncode == 0, planned.recommend.stderr
    assert planned.export.returncode == 0, planned.export.stderr
    for name in ("plan.json", "ds_config.json", "launch.sh", "hostfile", "slurm.sbatch", "accelerate.yaml"):
        assert (planned.out / name).is_file(), name
    for name in ("launch.sh", "slurm.sbatch", "accelerate.yaml", "ds_config.json"):
        assert (planned.out2 / name).is_file(), name
    assert pwned(planned.root) == []


# --- 1. the model file runs only in a child, only when named -------------------------------------------------


def test_model_file_runs_only_in_a_child_process(planned: Planned) -> None:
    assert planned.recommend.returncode == 0, planned.recommend.stderr
    records = (planned.markers / "model-pids").read_text().split("\n")[:-1]
    assert records, "the model file was never imported"
    for record in records:
        pid, ppid = (int(x) for x in record.split())
        assert pid != planned.cli_pid, "the model file was imported by the optplan process itself"
        assert ppid == planned.cli_pid  # a direct child of the CLI (the profiler), not some other process


def test_stray_python_files_in_the_working_folder_are_never_imported(planned: Planned) -> None:
    """The profiler child runs ``python -m``, which puts the working folder first on sys.path: a stray
    ``numpy.py`` there used to be imported by torch in the child (and broke profiling)."""
    assert planned.recommend.returncode == 0, planned.recommend.stderr
    assert sorted(p.name for p in planned.markers.iterdir() if p.name != "model-pids") == []


@pytest.mark.parametrize("args", [
    ["recommend", "--arch", ARCH, "--gpus", "8", "--no-probe"],
    ["estimate", "--arch", ARCH, "--gpus", "8"],
    ["profile", "--arch", ARCH],
    ["hardware"],
    ["chinchilla", "--params", "1e9"],
    ["export", "{plan}", "--to", "deepspeed", "--out", "{tmp}/export-out"],
], ids=["recommend-arch", "estimate-arch", "profile-arch", "hardware", "chinchilla", "export"])
def test_commands_without_a_model_file_import_none(args: list[str], planned: Planned, tmp_path: Path) -> None:
    """Run from a folder holding model.py, train.py, numpy.py...: a command that names no model file imports
    none of them."""
    markers = tmp_path / "markers"
    markers.mkdir()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for name in STRAY_NAMES:
        (cwd / name).write_text(f"import pathlib\npathlib.Path({str(markers / name)!r}).write_text('imported')\n")
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{plan}", str(planned.out / "plan.json")) for a in args]
    proc = run_optplan(argv, cwd=cwd, env=planned.env)
    assert proc.returncode == 0, proc.stderr
    assert list(markers.iterdir()) == []
    assert sorted(p.name for p in cwd.iterdir()) == sorted(STRAY_NAMES)  # no __pycache__ either


# --- 2. config files and OPTPLAN are parsed, never executed -------------------------------------------------

EVIL_YAML: dict[str, str] = {
    "object-apply": 'gpu: !!python/object/apply:os.system ["touch PWNED"]\ngpus_per_node: 8\nnodes: 1\n',
    "object-new": "gpu: H100-SXM\ngpus_per_node: !!python/object/new:os.system [touch PWNED]\nnodes: 1\n",
    "name": "gpu: H100-SXM\ngpus_per_node: 8\nnodes: !!python/name:os.system\n",
    "top-level": "!!python/object/apply:os.system [touch PWNED]\n",
}


@pytest.mark.parametrize("name", list(EVIL_YAML))
def test_cluster_yaml_tags_are_refused_not_run(name: str, tmp_path: Path) -> None:
    (tmp_path / "cluster.yaml").write_text(EVIL_YAML[name])
    proc = run_optplan(["recommend", "--arch", ARCH, "--cluster", "cluster.yaml", "--no-probe", "--out", "out"],
                       cwd=tmp_path, env=dict(os.environ))
    line = one_error_line(proc)
    assert "cluster.yaml" in line and "tag" in line, line
    assert pwned(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.yaml"]  # nothing written


CODE = "__import__('os').system('touch PWNED')"


@pytest.mark.parametrize(("key", "words"), [
    ("seq_len", ("OPTPLAN['seq_len']", "positive integer")),  # global_batch and tokens: the same check
    ("optimizer", ("OPTPLAN['optimizer']", "adamw")),
    ("precision", ("OPTPLAN['precision']", "bf16")),
])
def test_optplan_values_that_are_code_are_refused_not_run(key: str, words: tuple[str, ...], tmp_path: Path) -> None:
    model = tmp_path / "m.py"
    model.write_text("import torch.nn as nn\ndef build_model():\n"
                     "    return nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))\n"
                     f"OPTPLAN = {{'seq_len': 32, {key!r}: {CODE!r}}}\n")
    proc = run_optplan(["recommend", "m.py", "--no-probe", "--gpus", "1", "--out", "out"], cwd=tmp_path,
                       env=dict(os.environ))
    line = one_error_line(proc)
    for word in words:
        assert word in line, (word, line)
    assert pwned(tmp_path) == []
    assert not (tmp_path / "out").exists()


def test_optplan_names_match_the_strategy_names() -> None:
    """The child checks OPTPLAN names without pydantic: its lists are the strategy's own."""
    from optplan.estimators.strategy import OptimizerName, PrecisionName
    from optplan.probes.contract import OPTPLAN_NAMES

    assert OPTPLAN_NAMES == {"optimizer": get_args(OptimizerName), "precision": get_args(PrecisionName)}


def test_no_eval_exec_pickle_or_unsafe_yaml_in_the_package() -> None:
    """Belt and braces for the above: the package has no way to execute a value as code."""
    import optplan.planner

    package = Path(next(iter(optplan.planner.__path__))).parent
    pattern = re.compile(r"\b(eval|exec)\(|\bpickle\b|yaml\.(load|unsafe_load|full_load)\(|yaml\.(Unsafe|Full)?Loader\b"
                         r"|shell=True|os\.system\(")
    sources = [path for sub in ("estimators", "planner", "probes", "tui") for path in (package / sub).rglob("*.py")]
    assert len(sources) > 50, package
    hits = [f"{path.relative_to(package)}:{number}: {line.strip()}" for path in sorted(sources)
            for number, line in enumerate(path.read_text().splitlines(), start=1) if pattern.search(line)]
    assert hits == []


def test_hand_edited_plan_json_values_are_data(planned: Planned, tmp_path: Path) -> None:
    """Code, shell and ``../`` in a plan.json's names neither run nor move where files are written."""
    doc = json.loads((planned.out / "plan.json").read_text())
    escape = f"../../escape {INJECT}\n{CODE}"
    doc["model"] = doc["model_path"] = escape
    doc["export"].update(model=escape, model_path=escape, model_class=CODE, gpu=f"../../../escape {INJECT}")
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    (work / "plan.json").write_text(json.dumps(doc))
    out = work / "out"
    before = snapshot(tmp_path)
    proc = run_optplan(["export", "plan.json", "--to", "all", "--out", "out", "--launcher", "deepspeed"],
                       cwd=work, env=planned.env)
    assert proc.returncode == 0, proc.stderr
    assert pwned(tmp_path) == []
    assert [p for p in changed(before, snapshot(tmp_path)) if not inside(p, out)] == []
    assert (out / "launch.sh").is_file() and (out / "slurm.sbatch").is_file()
    argv = run_script(out / "launch.sh", planned, cwd=work)
    assert argv[0] == "deepspeed" and argv[-1] == PASSTHROUGH
    assert pwned(tmp_path) == []


# --- 3. nothing is written outside --out ------------------------------------------------------------------


def test_recommend_writes_only_inside_out(planned: Planned) -> None:
    """HOME, XDG_CACHE_HOME/CONFIG/DATA, TMPDIR, the working folder and the model's folder stay as they were, but
    for the profile cache, in its documented folder ($XDG_CACHE_HOME/optplan/profiles) and holding none of the
    environment's secrets (no calibration cache: that is written only after probes on a GPU)."""
    assert planned.recommend.returncode == 0, planned.recommend.stderr
    new = planned.changed_by_recommend
    profiles = planned.area / "cache" / "optplan" / "profiles"
    assert [p for p in new if not inside(p, planned.out) and not inside(p, profiles) and not inside(profiles, p)] == []
    entries = [p for p in new if inside(p, profiles) and p.is_file()]
    assert [p.suffix for p in entries] == [".json"], entries
    text = entries[0].read_text()
    assert not [name for name, value in SECRETS.items() if value in text]
    written = {p.name for p in new if p.parent == planned.out}
    assert {"plan.json", "launch.sh", "optplan-study.log"} <= written  # the study journal and its locks too


def test_export_writes_only_inside_out(planned: Planned) -> None:
    assert planned.export.returncode == 0, planned.export.stderr
    new = planned.changed_by_export
    assert [p for p in new if not inside(p, planned.out2)] == []
    assert planned.out2 / "launch.sh" in new


# --- 4. no secrets or environment variables in exports ---------------------------------------------------


def test_no_secret_or_environment_value_in_any_export(planned: Planned) -> None:
    assert planned.recommend.returncode == 0 and planned.export.returncode == 0
    values = [*SECRETS.values(), str(planned.home), TOKEN]
    files = [p for folder in (planned.out, planned.out2) for p in folder.iterdir() if p.is_file()]
    assert len(files) >= 15
    for path in files:
        data = path.read_bytes()
        for value in values:
            assert value.encode() not in data, (path.name, value)


# --- 5. launch scripts quote every user-provided value ------------------------------------------------------


def run_script(script: Path, planned: Planned, *, cwd: Path, extra_env: dict[str, str] | None = None) -> list[str]:
    """``bash -n`` then ``bash SCRIPT PASSTHROUGH`` with fake launchers first on PATH; the argv the launcher got."""
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr
    argv_file = cwd / ".fake-argv"
    env = {"PATH": f"{planned.fakes}{os.pathsep}{os.environ['PATH']}", "HOME": str(planned.home),
           "FAKE_ARGV": str(argv_file), **(extra_env or {})}
    proc = subprocess.run(["bash", str(script), PASSTHROUGH], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    argv = argv_file.read_text().split("\0")[:-1]
    argv_file.unlink()
    return argv


def value_after(argv: list[str], flag: str) -> str:
    assert flag in argv, (flag, argv)
    return argv[argv.index(flag) + 1]


def same_path(a: str, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


SLURM_ENV = {"SLURM_JOB_NODELIST": "node[0-1]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
             "SLURM_CPUS_PER_TASK": "64"}


@pytest.mark.parametrize("which", ["launch-deepspeed", "launch-torchrun", "slurm", "slurm-train-script"])
def test_launch_scripts_pass_user_values_as_single_arguments(which: str, planned: Planned, tmp_path: Path) -> None:
    assert planned.recommend.returncode == 0 and planned.export.returncode == 0
    out = planned.out2 if which in ("launch-torchrun", "slurm-train-script") else planned.out
    cwd = tmp_path / "run here"
    cwd.mkdir()
    # the exported train.py beside the script is used when the working folder has none
    train = TRAIN_SCRIPT if out == planned.out2 else (
        str(out / "train.py") if (out / "train.py").exists() and not (cwd / "train.py").exists() else "train.py")
    if which.startswith("launch"):
        argv = run_script(out / "launch.sh", planned, cwd=cwd, extra_env={"MASTER_ADDR": "node0"})
        if which == "launch-deepspeed":
            assert argv[0] == "deepspeed"
            assert same_path(value_after(argv, "--hostfile"), out / "hostfile")
        else:
            assert argv[0] == "torchrun"
            assert re.fullmatch(r"optplan-[A-Za-z0-9_.-]+", value_after(argv, "--rdzv-id")), argv
    else:
        argv = run_script(out / "slurm.sbatch", planned, cwd=cwd, extra_env={**SLURM_ENV, "SLURM_SUBMIT_DIR": str(out)})
        assert argv[0] == "srun" and "torchrun" in argv
        assert value_after(argv, "--rdzv-endpoint") == "node0:29500"
        directives = [ln for ln in (out / "slurm.sbatch").read_text().splitlines() if ln.startswith("#SBATCH")]
        job = next(d for d in directives if d.startswith("#SBATCH --job-name="))
        assert re.fullmatch(r"#SBATCH --job-name=[A-Za-z0-9_.+-]+", job), job
    assert value_after(argv, train) == "--deepspeed"  # the training script is one argument
    assert same_path(value_after(argv, "--deepspeed"), out / "ds_config.json")
    assert argv[-1] == PASSTHROUGH
    assert pwned(planned.root) == [] and pwned(tmp_path) == []


def test_accelerate_launch_line_quotes_the_training_script(planned: Planned, tmp_path: Path) -> None:
    """accelerate.yaml's header gives the command to run: pasted into a shell, the script is one argument."""
    assert planned.export.returncode == 0, planned.export.stderr
    lines = [ln[1:].strip() for ln in (planned.out2 / "accelerate.yaml").read_text().splitlines()
             if ln.startswith("#") and ln[1:].strip().startswith("accelerate launch")]
    assert lines
    for line in lines:
        argv_file = tmp_path / "argv"
        env = {"PATH": f"{planned.fakes}{os.pathsep}{os.environ['PATH']}", "FAKE_ARGV": str(argv_file),
               "NODE_RANK": "0", "MAIN_NODE_IP": "node0"}
        proc = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        argv = argv_file.read_text().split("\0")[:-1]
        assert argv[0] == "accelerate" and argv[-1] == TRAIN_SCRIPT, argv
        assert shlex.split(line)[-1] == TRAIN_SCRIPT
    assert pwned(tmp_path) == [] and pwned(planned.root) == []


def test_model_name_reaches_scripts_only_as_comments_or_sanitised(planned: Planned) -> None:
    """OPTPLAN["name"] (with a newline, quotes and shell) is flattened into comments; default job and
    rendezvous names keep only safe characters."""
    for path in (planned.out / "launch.sh", planned.out / "slurm.sbatch", planned.out / "hostfile",
                 planned.out2 / "launch.sh", planned.out2 / "accelerate.yaml"):
        for line in path.read_text().splitlines():
            if "touch PWNED" in line and not line.lstrip().startswith("#"):
                assert line == f"DEFAULT_TRAIN_SCRIPT={shlex.quote(TRAIN_SCRIPT)}", (path.name, line)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11+: on 3.10 an optplan/ "
                    "folder in the working folder shadows the package for `python -m` (README says so)")
def test_probe_children_import_nothing_from_the_working_folder(tmp_path: Path) -> None:
    """The profiler and the real probe run (``python -m`` children, torchrun workers included) start with
    PYTHONSAFEPATH=1: an ``optplan/`` package or a stray ``numpy.py`` in the working folder would be found
    before the real ones; neither is imported and the probe runs the model for real."""
    markers, cwd = tmp_path / "markers", tmp_path / "cwd"
    markers.mkdir()
    (cwd / "optplan").mkdir(parents=True)
    stray = (f"import pathlib\npathlib.Path({str(markers)!r}, __name__).write_text('imported')\n"
             "raise ImportError('a stray module: optplan must never import it')\n")
    (cwd / "optplan" / "__init__.py").write_text(stray)
    (cwd / "numpy.py").write_text(stray)
    model = tmp_path / "net.py"
    model.write_text(f"PIDS = {str(tmp_path / 'pids')!r}\n" + MODEL + 'OPTPLAN = {"seq_len": 32}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTPLAN")}
    env["OPTPLAN_PROFILE_CACHE"] = str(tmp_path / "profiles")  # not the real ~/.cache
    proc = run_optplan(["recommend", str(model), "--gpu", "H100-SXM", "--gpus", "2", "--probe", "--probe-top-k", "1",
                        "--probe-nproc", "2", "--json"], cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr
    probed = json.loads(proc.stdout)["probes"]["probed"]
    assert [p["result"]["status"] for p in probed] == ["ok"], probed
    assert sorted(p.name for p in markers.iterdir()) == []
