"""Issue 7, bad input: every mistake a user can make with a model file, a flag or a file on disk ends the real
CLI (``optplan.tui.cli.main``) with exit code 2, one line on stderr naming the problem and the fix, no
traceback, and nothing written."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from optplan.tui.cli import main

H100 = ["--gpu", "H100-SXM", "--gpus", "8"]

GOOD = """
import torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.fc = nn.Linear(16, 64)
    def forward(self, x):
        return self.fc(self.emb(x))
def build_model():
    return Net()
OPTPLAN = {"seq_len": 32}
"""

LINEAR_BATCH = """
import torch, torch.nn as nn
def example_batch(batch_size, seq_len):
    return torch.zeros(batch_size, 16)
"""

MODEL_FILES: dict[str, str] = {
    "good.py": GOOD,
    "notes.txt": "just some text\n",
    "syntax.py": "def build_model(:\n    pass\n",
    "missing_pkg.py": "import not_a_real_pkg_xyz\n",
    "no_builder.py": "x = 1\n",
    "several.py": "import torch.nn as nn\na = nn.Linear(4, 4)\nb = nn.Linear(8, 8)\n",
    "raises.py": "def build_model():\n    raise RuntimeError('boom in builder')\n",
    # a builder that downloads pretrained weights: a closed local port stands in for the blocked network
    "download.py": "import urllib.request\ndef build_model():\n"
                   "    urllib.request.urlopen('http://127.0.0.1:{port}/weights.bin', timeout=5)\n",
    "bad_shape.py": "import torch, torch.nn as nn\ndef build_model():\n    return nn.Linear(16, 4)\n"
                    "def example_batch(batch_size, seq_len):\n    return torch.zeros(batch_size, 7)\n",
    "bad_dtype.py": "import torch, torch.nn as nn\ndef build_model():\n"
                    "    return nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 4))\n"
                    "def example_batch(batch_size, seq_len):\n    return torch.zeros(batch_size, seq_len)\n",
    "extra_args.py": "import torch.nn as nn\nclass Net(nn.Module):\n    def __init__(self):\n"
                     "        super().__init__()\n        self.fc = nn.Linear(16, 4)\n"
                     "    def forward(self, x, mask):\n        return self.fc(x) * mask\n"
                     "def build_model():\n    return Net()\n" + LINEAR_BATCH,
    # too large for the real CPU run that profiles small data-dependent models (6.4 GB of fp32 weights)
    "data_dependent.py": "import torch.nn as nn\nclass Net(nn.Module):\n    def __init__(self):\n"
                         "        super().__init__()\n        self.fc = nn.Sequential(nn.Linear(16, 40000), "
                         "nn.Linear(40000, 40000), nn.Linear(40000, 4))\n"
                         "    def forward(self, x):\n        if x.sum() > 0:\n            return self.fc(x)\n"
                         "        return self.fc(-x)\ndef build_model():\n    return Net()\n" + LINEAR_BATCH,
    # a builder that allocates real memory (an explicit device='cpu' escapes the meta device)
    "too_large.py": "import torch, torch.nn as nn\ndef build_model():\n    m = nn.Linear(16, 4)\n"
                    "    m.table = torch.empty(2**60, device='cpu')\n    return m\n" + LINEAR_BATCH,
    "frozen_all.py": "import torch.nn as nn\ndef build_model():\n    m = nn.Linear(16, 4)\n"
                     "    m.requires_grad_(False)\n    return m\n" + LINEAR_BATCH,
    "long_seq.py": "import torch.nn as nn\nclass Net(nn.Module):\n    def __init__(self):\n"
                   "        super().__init__()\n        self.block_size = 32\n        self.emb = nn.Embedding(64, 16)\n"
                   "        self.fc = nn.Linear(16, 64)\n    def forward(self, x):\n        return self.fc(self.emb(x))\n"
                   "def build_model():\n    return Net()\n",
}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    port = _closed_port()
    for name, text in MODEL_FILES.items():
        (folder / name).write_text(text.replace("{port}", str(port)))
    return folder


@pytest.fixture(scope="module")
def saved_plan(models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A real plan.json from ``recommend --out`` (to edit into nonsense); a DeepSpeed plan, so that
    ``export --to deepspeed`` gets as far as its --out checks (a torch plan is refused before them)."""
    out = tmp_path_factory.mktemp("plan") / "out"
    code, _stdout, stderr = run_cli(["recommend", str(models / "good.py"), *H100, "--engine", "deepspeed",
                                     "--out", str(out)])
    assert code == 0, stderr
    return json.loads((out / "plan.json").read_text())


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``optplan ARGV`` through the console-script entry point."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code
    return int(code or 0), out.getvalue(), err.getvalue()


@dataclass(frozen=True)
class Case:
    """One bad input: how to set it up (in a fresh folder), the command, and words its line must say."""

    argv: Callable[[Path, Path], list[str]]  # (models folder, work folder) -> argv
    problem: tuple[str, ...]  # words naming the problem (all, case-insensitive)
    fix: tuple[str, ...]  # words naming the fix
    setup: Callable[[Path], None] = field(default=lambda work: None)


def _rec(name: str, *extra: str) -> Callable[[Path, Path], list[str]]:
    return lambda m, w: ["recommend", str(m / name), *H100, "--out", str(w / "out"), *extra]


def _est(name: str, *extra: str) -> Callable[[Path, Path], list[str]]:
    return lambda m, w: ["estimate", str(m / name), *H100, *extra]


def _existing(work: Path) -> None:
    (work / "out").mkdir()
    (work / "out" / "plan.json").write_text("{}")


def _write(name: str, text: str | bytes) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        target = work / name
        target.write_bytes(text if isinstance(text, bytes) else text.encode())
    return setup


CASES: dict[str, Case] = {
    # model files
    "file-missing": Case(_rec("nope.py"), ("not found",), ("check the path",)),
    "not-python": Case(_rec("notes.txt"), ("not a python file",), (".py",)),
    "syntax-error": Case(_rec("syntax.py"), ("syntax error", "line 1"), ("fix the syntax",)),
    "missing-package": Case(_rec("missing_pkg.py"), ("missing package", "not_a_real_pkg_xyz"), ("install",)),
    "no-builder": Case(_rec("no_builder.py"), ("no model found",), ("build_model",)),
    "several-models": Case(_rec("several.py"), ("several models", "a, b"), ("--model-name",)),
    "builder-raises": Case(_rec("raises.py"), ("build_model() raised", "boom in builder"), ("make build_model()",)),
    "builder-downloads": Case(_rec("download.py"), ("network", "download", "refused"), ("download the weights",)),
    "batch-wrong-shape": Case(_est("bad_shape.py"), ("rejected example_batch", "[1, 7]"), ("make example_batch",)),
    "batch-wrong-dtype": Case(_est("bad_dtype.py"), ("rejected example_batch", "float32"), ("make example_batch",)),
    "forward-extra-args": Case(_est("extra_args.py"), ("'mask'",), ("make example_batch",)),
    "data-dependent-forward": Case(_est("data_dependent.py"), ("real tensor values", "a real CPU run instead would "
                                                               "hold 6.0 GiB of weights"),
                                   ("avoid", "branches on tensor values")),
    "too-large-to-build": Case(_est("too_large.py"), ("too large", "memory"), ("meta device",)),
    "no-trainable-params": Case(_rec("frozen_all.py"), ("no trainable parameters",), ("leave at least one",)),
    "seq-longer-than-model": Case(_rec("long_seq.py", "--seq-len", "64"), ("longer than", "32 positions"),
                                  ("--seq-len 32",)),
    # options
    "gpus-and-gpus-range": Case(_rec("good.py", "--gpus-range", "8:16"), ("--gpus-range",), ("not both",)),
    "file-and-params": Case(lambda m, w: ["estimate", str(m / "good.py"), "--params", "1e9", *H100],
                            ("exactly one",), ("--params",)),
    "impossible-tp": Case(_est("good.py", "--tp", "3"), ("not divisible by tp",), ("multiple of 3",)),
    "unknown-gpu": Case(lambda m, w: ["recommend", str(m / "good.py"), "--gpu", "Z80", "--gpus", "8",
                                      "--out", str(w / "out")], ("z80",), ("H100",)),
    "non-numeric-gpus": Case(lambda m, w: ["recommend", str(m / "good.py"), "--gpus", "eight",
                                           "--out", str(w / "out")], ("invalid --gpus 'eight'", "expected a valid integer"), ("--help",)),
    "params-beyond-any-model": Case(lambda m, w: ["estimate", "--params", "1.5e307"], ("beyond any model",),
                                    ("--params 7e9",)),
    "qlora-fp8-estimate": Case(lambda m, w: ["estimate", str(m / "good.py"), "--finetune", "qlora", "--precision",
                                             "fp8", *H100], ("quantised base", "fp8"), ("--precision bf16",)),
    "qlora-fp8-recommend": Case(lambda m, w: ["recommend", str(m / "good.py"), "--finetune", "qlora", "--precision",
                                              "fp8", *H100], ("quantised base", "fp8"), ("drop fp8",)),
    "nvme-optimizer-zero2": Case(lambda m, w: ["estimate", "--params", "1e9", *H100, "--zero", "2",
                                               "--offload-optimizer", "nvme"], ("nvme", "zero stage 3"),
                                 ("--zero 3", "--offload-optimizer cpu")),
    "non-numeric-params": Case(lambda m, w: ["estimate", "--params", "7B"], ("invalid --params '7B'", "expected a valid number"), ("--help",)),
    "global-batch-not-divisible": Case(_rec("good.py", "--global-batch", "12"), ("not divisible",),
                                       ("multiple of 8",)),
    "params-global-batch-not-divisible": Case(
        lambda m, w: ["recommend", "--params", "1e6", "--gpus", "64", "--global-batch", "8", "--no-probe"],
        ("no plan", "global batch 8"), ("--global-batch divisible",)),
    # files
    "out-is-a-file": Case(_rec("good.py"), ("is a file",), ("choose a directory",),
                          setup=_write("out", "x")),
    "out-under-a-file": Case(lambda m, w: ["recommend", str(m / "good.py"), *H100, "--out", str(w / "f" / "out")],
                             ("f/out", "is a file"), ("choose another --out",), setup=_write("f", "x")),
    "out-empty": Case(lambda m, w: ["recommend", str(m / "good.py"), *H100, "--out", ""],  # an unset "$DIR"
                      ("--out", "is empty"), ("--out .",)),
    "out-not-writable": Case(lambda m, w: ["recommend", "--arch", "layers=2,hidden=64,heads=2,seq=64", "--gpus", "2",
                                           "--out", "/proc/self/fdinfo"],  # a pseudo file system: root cannot either
                             ("/proc/self/fdinfo",), ("writable",)),
    "existing-files-without-force": Case(_rec("good.py"), ("already has plan.json",), ("--force",),
                                         setup=_existing),
    "storage-garbage-journal": Case(lambda m, w: [*_rec("good.py")(m, w), "--storage", str(w / "s.log")],
                                    ("s.log", "not an optplan study journal"), ("choose another --storage",),
                                    setup=_write("s.log", "garbage\n")),
    "storage-not-sqlite": Case(lambda m, w: [*_rec("good.py")(m, w), "--storage", str(w / "s.db")],
                               ("s.db", "not an sqlite database"), ("choose another --storage",),
                               setup=_write("s.db", b"\x00not sqlite at all" * 64)),
    "plan-not-json": Case(lambda m, w: ["export", str(w / "plan.json"), "--to", "deepspeed", "--out", str(w / "out")],
                          ("not json",), ("optplan recommend",), setup=_write("plan.json", "nonsense{")),
    "plan-foreign-json": Case(lambda m, w: ["export", str(w / "plan.json"), "--to", "deepspeed", "--out",
                                            str(w / "out")], ("not an optplan plan",), ("optplan recommend",),
                              setup=_write("plan.json", '{"name": "something else"}')),
}


def check_one_line(code: int, stdout: str, stderr: str, case: Case) -> str:
    assert "Traceback" not in stdout + stderr, stderr
    assert code == 2, (code, stdout, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), stderr  # exactly one line, nothing blank around it
    line = lines[0]
    assert line.startswith("error: "), line
    for word in case.problem + case.fix:
        assert word.lower() in line.lower(), (word, line)
    assert stdout == "", stdout
    return line


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_nothing_written(name: str, models: Path, tmp_path: Path) -> None:
    case = CASES[name]
    case.setup(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, stdout, stderr = run_cli(case.argv(models, tmp_path))
    check_one_line(code, stdout, stderr, case)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def _nonsense_plans(plan: dict) -> dict[str, dict]:
    negative = json.loads(json.dumps(plan))
    negative["export"]["strategy"]["mbs"] = -4
    wrong_type = json.loads(json.dumps(plan))
    wrong_type["export"]["strategy"]["dp"] = "eight"
    no_export = {k: v for k, v in plan.items() if k != "export"}
    return {"negative-mbs": negative, "dp-not-a-number": wrong_type, "no-export-section": no_export}


@pytest.mark.parametrize("edit", ["negative-mbs", "dp-not-a-number", "no-export-section"])
def test_hand_edited_plan_json_is_one_line_exit_2(edit: str, saved_plan: dict, tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text(json.dumps(_nonsense_plans(saved_plan)[edit]))
    code, stdout, stderr = run_cli(["export", str(tmp_path / "plan.json"), "--to", "deepspeed",
                                    "--out", str(tmp_path / "out")])
    line = check_one_line(code, stdout, stderr, Case(lambda m, w: [], ("plan.json",), ("optplan recommend",)))
    assert re.search(r"mbs|dp|export", line), line
    assert not (tmp_path / "out").exists()


LORA = """
import torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(512, 128)  # the frozen base: half of the parameters
        self.head = nn.Linear(128, 512, bias=False)  # the trainable half
    def forward(self, x):
        return self.head(self.emb(x))
def build_model():
    m = Net()
    m.emb.requires_grad_({trainable})
    return m
OPTPLAN = {{"seq_len": 64}}
"""


def test_frozen_parts_get_no_gradients_or_optimizer_state(tmp_path: Path) -> None:
    """LoRA-style: frozen weights are stored, but gradients and optimizer state scale with trainable ones."""
    docs = {}
    for trainable in (True, False):
        path = tmp_path / f"lora_{trainable}.py"
        path.write_text(LORA.format(trainable=trainable))
        code, stdout, stderr = run_cli(["estimate", str(path), "--gpu", "H100-SXM", "--gpus", "1", "--json"])
        assert code == 0, stderr
        docs[trainable] = json.loads(stdout)["memory"]
    full, frozen = docs[True], docs[False]
    assert frozen["params_bytes"] == full["params_bytes"] > 0
    for key in ("grads_bytes", "optimizer_bytes"):
        assert full[key] > 0
        assert frozen[key] == pytest.approx(full[key] / 2, rel=0.02), key


def test_data_dependent_control_flow_in_a_small_model_falls_back_to_a_real_cpu_run(tmp_path: Path) -> None:
    """The same branch on a tensor value as the data-dependent case, in a model small enough to build for
    real: recommend plans it, and says it was profiled by a real CPU run."""
    path = tmp_path / "branchy.py"
    path.write_text("import torch.nn as nn\nclass Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                    "        self.fc = nn.Linear(16, 4)\n    def forward(self, x):\n        if x.sum() > 0:\n"
                    "            return self.fc(x)\n        return self.fc(-x)\ndef build_model():\n    return Net()\n"
                    + LINEAR_BATCH)
    code, stdout, stderr = run_cli(["recommend", str(path), *H100, "--no-probe", "--json"])
    assert code == 0, stderr
    rec = json.loads(stdout)
    assert rec["plan"] is not None
    assert any("profiled by a real CPU run of the whole model" in note for note in rec["notes"]), rec["notes"]


@pytest.mark.parametrize("where", ["existing-file", "out-under-a-file"])
def test_export_of_a_good_plan_to_a_bad_out_is_one_line_exit_2(where: str, saved_plan: dict, tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text(json.dumps(saved_plan))
    if where == "existing-file":
        out = tmp_path / "out"
        out.mkdir()
        (out / "ds_config.json").write_text("mine")
        case = Case(lambda m, w: [], ("ds_config.json", "already exist"), ("--force",))
    else:
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "out"
        case = Case(lambda m, w: [], ("f/out",), ("--out",))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, stdout, stderr = run_cli(["export", str(tmp_path / "plan.json"), "--to", "deepspeed", "--out", str(out)])
    check_one_line(code, stdout, stderr, case)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    if where == "existing-file":
        assert (out / "ds_config.json").read_text() == "mine"
