"""Issue 7, property-based tests (hypothesis) over the real command line: ``optplan estimate`` and ``optplan
recommend`` given generated option combinations (valid, zero, negative, huge, NaN, infinite, non-numeric,
empty) through ``optplan.tui.cli.main``, the console-script entry point, as a user runs them.

- every run ends with code 0, 1 or 2, never a traceback; code 2 is one ``error:`` line on stderr and nothing
  written (no stdout, no file in the working folder or the cache);
- every number of a ``--json`` document is finite and >= 0 (the one signed figure: ``headroom_bytes``);
- per-GPU peak memory never falls when the micro-batch grows (``estimate --json``);
- sharding (ZeRO 1-3, FSDP) over dp >= 2 never increases the per-GPU model states (``estimate --json``).

The estimator-level versions of the last two are in tests/estimators/test_memory_properties.py; these go
through option parsing, derivation and the JSON document.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from optplan.estimators.hardware import gpu_catalogue
from optplan.estimators.optimizers import ADAFACTOR_FLAT_NOTE
from optplan.tui.cli import main

GPU_NAMES = tuple(gpu_catalogue())
BAD_TEXT = ("", " ", "abc", "nan", "NaN", "inf", "-inf", "1.5", "1e3", "0x10", "4 4", "-x")
HUGE_INTS = ("2147483648", "9223372036854775808", "1" + "0" * 30)
BAD_FLOATS = ("0", "-0", "-1", "nan", "inf", "-inf", "1e400", "-1e400", "1e-320", "", "abc", "1e9x")


@dataclass(frozen=True)
class Run:
    """One ``optplan ARGV``: exit code, stdout, stderr and the files left behind."""

    code: int
    stdout: str
    stderr: str
    written: tuple[str, ...]

    def json(self) -> Any:
        """The stdout JSON document; NaN/Infinity literals fail (json.loads would accept them)."""

        def reject(literal: str) -> Any:
            raise AssertionError(f"non-finite literal {literal} in the JSON document")

        return json.loads(self.stdout, parse_constant=reject)


@contextlib.contextmanager
def _chdir(folder: Path) -> Iterator[None]:
    """``contextlib.chdir`` (Python 3.11+) for Python 3.10 too."""
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def run_cli(argv: list[str]) -> Run:
    """Run ``optplan ARGV`` in-process through ``main`` in a fresh working folder with an empty cache."""
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        work = root / "work"
        work.mkdir()
        env = {"OPTPLAN_CACHE_DIR": str(root / "cache"), "XDG_CACHE_HOME": str(root / "xdg")}
        code: Any = 0
        with _chdir(work), mock.patch.dict(os.environ, env), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(argv)
            except SystemExit as exc:
                code = exc.code
        written = tuple(sorted(str(p.relative_to(root)) for p in root.rglob("*") if p != work))
    assert code is None or isinstance(code, int), f"exit code {code!r} for {argv}"
    return Run(int(code or 0), out.getvalue(), err.getvalue(), written)


def check_outcome(run: Run, argv: list[str]) -> None:
    """Property 1: code 0/1/2, no traceback, no file written; code 2 is exactly one ``error:`` line and no
    stdout."""
    where = f"optplan {' '.join(argv)}\nstdout: {run.stdout[-2000:]}\nstderr: {run.stderr[-2000:]}"
    assert run.code in (0, 1, 2), where
    assert "Traceback" not in run.stdout + run.stderr, where
    if run.code == 2:
        lines = run.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) > len("error: "), where
        assert run.stdout == "", where
    assert run.written == (), where  # no --out here: no file at all (study journal, calibration cache)


# --- option values --------------------------------------------------------------------------------------


ARCH_BAD_VALUES = ("0", "-4", "1.5", "nan", "inf", "", "x", "1e30", "1e100", "1e400")
ARCH_EXTREMES = {  # the largest sizes --arch takes (estimators.arch.MAX_*), and one past them
    "layers": ("10000", "10001", "1e9"), "hidden": ("16777216", "33554432"), "ffn": ("16777216", "1e12"),
    "vocab": ("1073741824", "1e15"), "seq": ("1073741824", "1e12"),
}


@st.composite
def arch_text(draw: st.DrawFn, *, valid_only: bool = False, seq: bool = True, extremes: bool = True) -> str:
    """``layers=..,hidden=..,heads=..[,kv_heads,ffn,vocab,seq,gated,tied]``: a valid shape (with
    ``extremes``, sometimes one size at or past its bound), or unless ``valid_only`` a broken one."""
    heads = draw(st.sampled_from([1, 2, 4, 8, 16]))
    fields: dict[str, str] = {
        "layers": str(draw(st.integers(1, 32))),
        "hidden": str(heads * draw(st.sampled_from([16, 32, 64, 128]))),
        "heads": str(heads),
    }
    if draw(st.booleans()):
        fields["kv_heads"] = str(draw(st.sampled_from([k for k in (1, 2, 4, 8, 16) if heads % k == 0])))
    if draw(st.booleans()):
        fields["ffn"] = str(draw(st.integers(1, 8192)))
    if draw(st.booleans()):
        fields["vocab"] = str(draw(st.sampled_from([256, 32000, 50257, 128256])))
    if seq:
        fields["seq"] = str(draw(st.sampled_from([128, 512, 1024, 2048, 4096])))
    for key in ("gated", "tied"):
        if draw(st.booleans()):
            fields[key] = str(draw(st.integers(0, 1)))
    if extremes and draw(st.integers(0, 7)) == 0:
        key = draw(st.sampled_from(sorted(ARCH_EXTREMES)))
        if key != "seq" or seq:
            fields[key] = draw(st.sampled_from(ARCH_EXTREMES[key]))
    if not valid_only:
        for _ in range(draw(st.integers(1, 3))):
            mutation = draw(st.sampled_from(["value", "value", "drop", "unknown", "bare", "twice"]))
            key = draw(st.sampled_from(sorted(fields) or ["layers"]))
            if mutation == "value":
                fields[key] = draw(st.sampled_from(ARCH_BAD_VALUES))
            elif mutation == "drop":
                fields.pop(key, None)
            elif mutation == "unknown":
                fields["experts"] = "8"
            elif mutation == "twice":
                fields[key + "!"] = f"{key}={fields.get(key, '1')}"
            else:
                fields[key + "!"] = key
    parts = [v if k.endswith("!") else f"{k}={v}" for k, v in fields.items()]
    if not valid_only and draw(st.integers(0, 4)) == 0:
        parts.insert(draw(st.integers(0, len(parts))), draw(st.sampled_from(["", " ", "=4", "layers", "a=b=c"])))
    return ",".join(parts)


class Options:
    """Draws option values for one command line: valid ones, and bad ones for the flags in ``corrupt``.

    A third of the lines are all valid, a third have one bad value, a third any number of them, so that
    both the figures (code 0/1) and every kind of mistake (code 2) are well covered."""

    def __init__(self, draw: st.DrawFn, flags: tuple[str, ...]) -> None:
        self.draw = draw
        mode = draw(st.sampled_from(["valid", "one", "many"]))
        if mode == "valid":
            self.corrupt: frozenset[str] = frozenset()
        elif mode == "one":
            self.corrupt = frozenset({draw(st.sampled_from(flags))})
        else:
            self.corrupt = frozenset(draw(st.sets(st.sampled_from(flags), min_size=1)))
        self.argv: list[str] = []

    def bad(self, flag: str) -> bool:
        return flag in self.corrupt

    def add(self, flag: str, value: str | None) -> None:
        if value is not None:
            self.argv += [flag, value]

    def maybe(self, flag: str, valid: st.SearchStrategy[str], bad: st.SearchStrategy[str]) -> None:
        """``flag`` with a bad value when corrupted, else a valid one or none."""
        self.add(flag, self.draw(bad) if self.bad(flag) else self.draw(st.none() | valid))


def bad_int() -> st.SearchStrategy[str]:
    """Zero or negative, huge, or not an integer at all."""
    return st.one_of(st.integers(-16, 0).map(str), st.sampled_from(HUGE_INTS), st.sampled_from(BAD_TEXT))


def bad_float() -> st.SearchStrategy[str]:
    """Zero, negative, NaN, infinite, tiny, huge or non-numeric."""
    odd = st.floats(min_value=1e-300, max_value=1e308).map(repr)
    return st.one_of(st.sampled_from(BAD_FLOATS), odd)


def ints(*values: int) -> st.SearchStrategy[str]:
    return st.sampled_from([str(v) for v in values])


def bad_choice(*values: str) -> st.SearchStrategy[str]:
    return st.sampled_from(values)


MODEL_FLAGS = ("--arch", "--params", "--seq-len", "model")
CLUSTER_FLAGS = ("--gpu", "--gpus", "--gpus-per-node")
BUDGET_FLAGS = ("--global-batch", "--tokens", "--price")


def model_options(o: Options) -> None:
    """--arch (mostly) or --params; both or neither when "model" is corrupted (never a model FILE: no child
    process)."""
    kind = o.draw(st.sampled_from(["both", "none"]) if o.bad("model") else st.sampled_from(["arch"] * 3 + ["params"]))
    seq_in_arch = o.draw(st.integers(0, 4)) > 0
    if kind in ("arch", "both"):
        o.add("--arch", o.draw(arch_text(valid_only=not o.bad("--arch"), seq=seq_in_arch)))
    if kind in ("params", "both"):
        o.add("--params", o.draw(bad_float() if o.bad("--params") else st.sampled_from(["1e6", "1.2e8", "7e9", "7e10"])))
    if o.bad("--seq-len"):
        o.add("--seq-len", o.draw(bad_int()))
    elif not seq_in_arch and kind == "arch":
        o.add("--seq-len", o.draw(ints(128, 1024, 2048)))


def cluster_options(o: Options, counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 1024)) -> int:
    """--gpu, --gpus, --gpus-per-node; the GPU count planned for (8 when not given)."""
    o.maybe("--gpu", st.sampled_from(GPU_NAMES) | st.sampled_from(["h100", "a100-80gb"]),
            bad_choice("TPUv5", "", "?", "H1000"))
    gpus = 8
    if o.bad("--gpus"):
        o.add("--gpus", o.draw(bad_int()))
    elif o.draw(st.booleans()):
        gpus = o.draw(st.sampled_from(counts))
        o.add("--gpus", str(gpus))
    if o.bad("--gpus-per-node"):
        o.add("--gpus-per-node", o.draw(bad_int()))
    elif o.draw(st.booleans()):
        o.add("--gpus-per-node", str(o.draw(st.sampled_from([g for g in (1, 2, 4, 8) if gpus % g == 0 or g > gpus]))))
    return gpus


def budget_options(o: Options, *, batch: st.SearchStrategy[str]) -> None:
    o.maybe("--global-batch", batch, bad_int())
    o.maybe("--tokens", st.sampled_from(["1e9", "3e11"]), bad_float())
    if "--tokens" in o.argv:
        o.maybe("--price", st.sampled_from(["0", "2.5"]), bad_float())
    elif o.bad("--price"):
        o.add("--price", o.draw(st.sampled_from(["2.5", *BAD_FLOATS])))  # a price without --tokens is bad too


PRECISIONS = ("fp32", "amp-bf16", "amp-fp16", "bf16", "fp16", "bf16-pure", "fp8")
OPTIMIZERS = ("adamw", "adamw8bit", "adamw-8bit", "adafactor", "sgd")
ENGINES = ("torch", "deepspeed", "megatron")
BAD_PRECISION = bad_choice("int4", "", "BF16 ", "fp64")
BAD_OPTIMIZER = bad_choice("lion", "", "adam w")
BAD_ENGINE = bad_choice("jax", "", "fsdp")

ESTIMATE_FLAGS = (*MODEL_FLAGS, *CLUSTER_FLAGS, *BUDGET_FLAGS, "--dp", "--tp", "--pp", "--vpp", "--cp", "--zero",
                  "--mbs", "--gas", "--fsdp", "--offload", "--offload-optimizer", "--offload-params", "--precision",
                  "--optimizer", "--engine", "--checkpointing", "--checkpoint-layers")


@st.composite
def estimate_argv(draw: st.DrawFn) -> list[str]:
    """A coherent strategy (degrees dividing the GPUs, sharding of the engine, batch of mbs·dp) unless
    corrupted, where a flag gets a bad value (or, for the combinations, a clashing one)."""
    o = Options(draw, ESTIMATE_FLAGS)
    model_options(o)
    gpus = cluster_options(o, (1, 2, 4, 8, 16, 32, 1024, 2**31))
    dp, degrees = gpus, {"--tp": 1, "--pp": 1, "--cp": 1}
    for flag in degrees:
        if o.bad(flag):
            o.add(flag, draw(bad_int()))
        elif draw(st.booleans()):
            degrees[flag] = draw(st.sampled_from([d for d in (1, 2, 4) if dp % d == 0]))
            dp //= degrees[flag]
            o.add(flag, str(degrees[flag]))
    if o.bad("--dp"):
        o.add("--dp", draw(bad_int() | ints(3, dp + 1)))
    elif draw(st.booleans()):
        o.add("--dp", str(dp))
    o.maybe("--vpp", ints(1, 2) if degrees["--pp"] > 1 else ints(1), bad_int() | ints(2))
    engine = draw(st.sampled_from([None, "deepspeed", "torch", "megatron"]))
    o.add("--engine", draw(BAD_ENGINE) if o.bad("--engine") else engine)
    if engine == "torch":
        o.maybe("--fsdp", bad_choice("full", "grad_op", "hybrid"), bad_choice("none", "FULL", ""))
        o.maybe("--zero", ints(0), bad_int() | ints(4, 7))
    else:
        o.maybe("--zero", ints(0, 1) if engine == "megatron" else ints(0, 1, 2, 3), bad_int() | ints(4, 7))
        if o.bad("--fsdp"):
            o.add("--fsdp", draw(bad_choice("none", "FULL", "", "full")))
    offload = draw(st.sampled_from(["--offload", "per-state", None, None, None, None]))
    if offload == "--offload" or o.bad("--offload"):
        o.add("--offload", draw(bad_choice("gpu", "") if o.bad("--offload") else bad_choice("none", "optimizer", "params")))
    for flag in ("--offload-optimizer", "--offload-params"):  # the older per-state way (a clash with --offload)
        if o.bad(flag):
            o.add(flag, draw(bad_choice("disk", "", "cpu")))
        elif offload == "per-state":
            o.maybe(flag, bad_choice("none", "cpu", "nvme"), st.nothing())
    mbs = draw(st.sampled_from([1, 2, 3, 8]))
    if o.bad("--mbs"):
        o.add("--mbs", draw(bad_int()))
    elif mbs > 1 or draw(st.booleans()):
        o.add("--mbs", str(mbs))
    if draw(st.booleans()):
        budget_options(o, batch=ints(mbs * dp, 4 * mbs * dp))
        if o.bad("--gas"):
            o.add("--gas", draw(bad_int() | ints(3)))
    else:
        o.maybe("--gas", ints(1, 2, 4), bad_int())
        budget_options(o, batch=st.nothing())
    o.maybe("--precision", st.sampled_from(PRECISIONS), BAD_PRECISION)
    o.maybe("--optimizer", st.sampled_from(OPTIMIZERS), BAD_OPTIMIZER)
    o.maybe("--checkpointing", bad_choice("none", "selective", "full"), bad_choice("some", ""))
    o.maybe("--checkpoint-layers", ints(1, 2, 3), bad_int())  # without full, or >= the blocks: a one-line refusal
    switches = ["--no-sp", "--flash", "--no-flash", *(["--sp"] if degrees["--tp"] > 1 else [])]
    o.argv += draw(st.lists(st.sampled_from(switches), max_size=2))
    return ["estimate", *o.argv, *(["--json"] if draw(st.integers(0, 3)) else [])]


RECOMMEND_FLAGS = (*MODEL_FLAGS, *CLUSTER_FLAGS, *BUDGET_FLAGS, "--precision", "--optimizer", "--engine",
                   "--objective", "--deadline", "--global-batch-tokens")


@st.composite
def recommend_argv(draw: st.DrawFn) -> list[str]:
    o = Options(draw, RECOMMEND_FLAGS)
    model_options(o)
    gpus = cluster_options(o)
    budget_options(o, batch=ints(gpus, 8 * gpus, 64 * gpus, 512))
    for flag, good, bad in (("--precision", PRECISIONS, BAD_PRECISION), ("--optimizer", OPTIMIZERS, BAD_OPTIMIZER),
                            ("--engine", ENGINES, BAD_ENGINE)):
        values = draw(st.lists(st.sampled_from(good), max_size=2))
        if o.bad(flag):
            values.insert(draw(st.integers(0, len(values))), draw(bad))
        for value in values:
            o.add(flag, value)
    objective = draw(st.sampled_from(["throughput", "time", "cost"]))
    o.maybe("--objective", st.just(objective), bad_choice("speed", ""))
    o.maybe("--deadline", bad_choice("30d", "720h", "45", "90m"), bad_choice("0d", "-1h", "abc", "", "1e400d", "nand", "infh", "1e306d"))
    if "--global-batch" not in o.argv or o.bad("--global-batch-tokens"):
        o.maybe("--global-batch-tokens", bad_choice("1048576", "4194304"), bad_float())
    return ["recommend", *o.argv, "--no-probe", *(["--json"] if draw(st.integers(0, 3)) else [])]


# --- property 2: every figure finite and >= 0 ----------------------------------------------------------

SIGNED = {"headroom_bytes"}  # capacity - total: negative exactly when the plan does not fit (checked below)


def numbers(doc: Any, path: str = "") -> list[tuple[str, float]]:
    """(path, value) of every number in a JSON document (booleans are not numbers here)."""
    if isinstance(doc, dict):
        return [item for key, value in doc.items() for item in numbers(value, f"{path}.{key}")]
    if isinstance(doc, list):
        return [item for i, value in enumerate(doc) for item in numbers(value, f"{path}[{i}]")]
    if isinstance(doc, (int, float)) and not isinstance(doc, bool):
        return [(path, doc)]
    return []


def check_figures(doc: Any, argv: list[str]) -> None:
    for path, value in numbers(doc):
        assert math.isfinite(value), f"{path} = {value} for {argv}"
        if path.rsplit(".", 1)[-1] not in SIGNED:
            assert value >= 0, f"{path} = {value} for {argv}"
    for memory in memories(doc):
        assert memory["headroom_bytes"] == memory["capacity_bytes"] - memory["total_bytes"], argv
        assert (memory["headroom_bytes"] >= 0) == memory["fits"], argv


def nulls(doc: Any, path: str = "") -> list[str]:
    """Paths of every null in a JSON document."""
    if isinstance(doc, dict):
        return [p for key, value in doc.items() for p in nulls(value, f"{path}.{key}")]
    if isinstance(doc, list):
        return [p for i, value in enumerate(doc) for p in nulls(value, f"{path}[{i}]")]
    return [path] if doc is None else []


def check_estimate_nulls(doc: Any, argv: list[str]) -> None:
    """``estimate --json`` is written by pydantic, which writes NaN and infinity as null: a null is only
    where a figure is legitimately absent (no --tokens: no cost; no --price: no money and no price; --params: no
    time) or a
    setting is left at its engine's default (``strategy.etp``: the expert tensor-parallel degree, tp unless set;
    ``strategy.checkpoint_layers``: every block, unless a count is given; ``strategy.compile_loss``: as ``compile``,
    unless --compile-loss or --eager-loss says)."""
    if "--params" in argv:  # model states only: no time, and no cost (--tokens is refused)
        expected = {".time"}
    elif "--tokens" not in argv:
        expected = {".cost"}
    else:
        # no --price: no money, neither the nominal figure nor its ends over the step's band
        expected = ({".cost.cost_usd", ".cost.cost_usd_low", ".cost.cost_usd_high", ".cost.price_per_gpu_hour"}
                    if "--price" not in argv else set())
    if "--etp" not in argv:
        expected |= {".strategy.etp"}
    if "--checkpoint-layers" not in argv:  # every block checkpointed (or none): no count
        expected |= {".strategy.checkpoint_layers"}
    if "--compile-loss" not in argv and "--eager-loss" not in argv:  # the loss compiled as the blocks are
        expected |= {".strategy.compile_loss"}
    assert set(nulls(doc)) == expected, argv


def memories(doc: Any) -> list[dict[str, Any]]:
    """Every memory breakdown (a dict with headroom_bytes) in a document."""
    if isinstance(doc, dict):
        found = [doc] if "headroom_bytes" in doc else []
        return found + [m for value in doc.values() for m in memories(value)]
    if isinstance(doc, list):
        return [m for value in doc for m in memories(value)]
    return []


# --- properties 1 and 2 -----------------------------------------------------------------------------------


TINY = "layers=2,hidden=64,heads=2,seq=256"


@settings(max_examples=200, deadline=None)
@given(estimate_argv())
# found by these properties (a traceback, exhausted memory, a non-finite figure or a bad line before the fix):
@example(["estimate", "--arch", "layers=1e30,hidden=64,heads=2,seq=256", "--json"])  # OverflowError
@example(["estimate", "--arch", "layers=1e9,hidden=64,heads=2,seq=256", "--json"])  # a 16e9-entry tuple
@example(["estimate", "--arch", "layers=2,hidden=1e200,heads=2,seq=256", "--json"])  # named no flag of the CLI
@example(["estimate", "--arch", TINY, "--gpus", "2147483648", "--zero", "1", "--json"])  # 17 GB list per rank
@example(["estimate", "--arch", TINY, "--tokens", "1e300", "--price", "1e300", "--json"])  # cost inf -> null
def test_estimate_never_a_traceback_nor_a_bad_figure(argv: list[str]) -> None:
    run = run_cli(argv)
    check_outcome(run, argv)
    assert run.code in (0, 2), f"estimate exits 0 (figures) or 2 (bad input), got {run.code} for {argv}"
    if run.code == 0 and "--json" in argv:
        doc = run.json()
        check_figures(doc, argv)
        check_estimate_nulls(doc, argv)


@settings(max_examples=40, deadline=None)
@given(recommend_argv())
@example(["recommend", "--arch", TINY, "--gpus", "1" + "0" * 21, "--no-probe", "--json"])  # OverflowError
@example(["recommend", "--arch", TINY, "--tokens", "1e300", "--price", "1e300", "--no-probe", "--json"])  # Infinity
def test_recommend_never_a_traceback_nor_a_bad_figure(argv: list[str]) -> None:
    run = run_cli(argv)
    check_outcome(run, argv)
    if run.code in (0, 1) and "--json" in argv:
        doc = run.json()
        assert doc["fits"] is (run.code == 0), argv
        check_figures(doc, argv)


# --- properties 3 and 4: a valid configuration, varied in one flag ----------------------------------------

BF16_GPUS = tuple(name for name, spec in gpu_catalogue().items() if spec.supports_bf16)


@st.composite
def valid_config(draw: st.DrawFn, *, min_dp: int = 1) -> tuple[list[str], int]:
    """(argv without the engine's sharding and --mbs, dp) of a configuration ``estimate`` accepts."""
    heads = draw(st.sampled_from([2, 4, 8, 16]))
    layers = draw(st.sampled_from([2, 4, 6, 12, 24]))
    tp = draw(st.sampled_from([1, 2]))
    pp = draw(st.sampled_from([1, 1, 2]))
    dp = draw(st.sampled_from([d for d in (1, 2, 3, 4, 8) if d >= min_dp]))
    arch = f"layers={layers},hidden={heads * draw(st.sampled_from([32, 64, 128]))},heads={heads}," \
           f"seq={draw(st.sampled_from([256, 1024, 2048]))},vocab={draw(st.sampled_from([512, 32000, 50257]))}"
    if draw(st.booleans()):  # a Llama block with grouped-query attention (tp divides the key-value heads)
        arch += f",kv_heads={draw(st.sampled_from([k for k in (2, 4, 8) if heads % k == 0]))},gated=1,tied=0"
    gpus = dp * tp * pp
    gpn = draw(st.sampled_from([g for g in (2, 4, 8) if g >= tp and (gpus <= g or gpus % g == 0)]))
    argv = ["estimate", "--arch", arch, "--gpu", draw(st.sampled_from(BF16_GPUS)), "--gpus", str(gpus),
            "--gpus-per-node", str(gpn), "--tp", str(tp), "--pp", str(pp),
            "--gas", str(pp * draw(st.integers(1, 4))),
            "--precision", draw(st.sampled_from(["bf16", "amp-bf16", "fp32", "amp-fp16", "fp16"])),
            "--optimizer", draw(st.sampled_from(["adamw", "adamw8bit", "adafactor", "sgd"])),
            "--checkpointing", draw(st.sampled_from(["none", "selective", "full"])),
            draw(st.sampled_from(["--flash", "--no-flash"])), "--json"]
    return argv, dp


def figures(argv: list[str]) -> dict[str, Any]:
    """``estimate --json``'s document for a configuration that must be accepted."""
    run = run_cli(argv)
    assert run.code == 0, f"optplan {' '.join(argv)}\n{run.stderr}"
    return run.json()


@settings(max_examples=60, deadline=None)
@given(valid_config(), st.sampled_from([[], ["--zero", "1"], ["--zero", "2"], ["--zero", "3"], ["--fsdp", "full"],
                                        ["--fsdp", "grad_op"], ["--fsdp", "hybrid"], ["--offload", "optimizer"]]),
       st.integers(1, 7))
def test_peak_memory_never_falls_when_the_micro_batch_grows(config: tuple[list[str], int], sharding: list[str],
                                                           mbs: int) -> None:
    argv, _ = config
    first = run_cli([*argv, *sharding, "--mbs", str(mbs)])
    check_outcome(first, argv)
    assume(first.code == 0)  # ZeRO-3 or offload with pp > 1 and the like are refused: a valid refusal
    smaller = first.json()["memory"]
    larger = figures([*argv, *sharding, "--mbs", str(mbs + 1)])["memory"]
    assert larger["total_bytes"] >= smaller["total_bytes"], (argv, sharding, mbs, smaller, larger)
    assert larger["activations_bytes"] >= smaller["activations_bytes"] or larger["moment"] != smaller["moment"], \
        (argv, sharding, mbs, smaller, larger)


def states(doc: dict[str, Any]) -> int:
    """Per-GPU model states of an ``estimate --json`` document: weights, gradients and optimizer state."""
    m = doc["memory"]
    return int(m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"])


SHARDING_LADDERS: dict[str, list[list[str]]] = {  # each rung shards at least as much as the one before
    "deepspeed": [["--zero", "0"], ["--zero", "1"], ["--zero", "2"], ["--zero", "3"]],
    "torch-grad-op": [[], ["--fsdp", "grad_op"], ["--fsdp", "full"]],
    "torch-hybrid": [[], ["--fsdp", "hybrid"], ["--fsdp", "full"]],
    "megatron": [["--zero", "0"], ["--zero", "1"]],
}


@settings(max_examples=60, deadline=None)
@given(valid_config(min_dp=2), st.sampled_from(sorted(SHARDING_LADDERS)), st.integers(1, 4))
def test_sharding_never_increases_per_gpu_model_states(config: tuple[list[str], int], ladder: str,
                                                       mbs: int) -> None:
    argv, dp = config
    engine = ladder.split("-")[0]
    rungs = SHARDING_LADDERS[ladder]
    if argv[argv.index("--pp") + 1] != "1" and engine == "deepspeed":
        rungs = rungs[:2]  # DeepSpeed's pipeline engine takes ZeRO-1 at most
    optimizer, gas = argv[argv.index("--optimizer") + 1], int(argv[argv.index("--gas") + 1])
    flattens = optimizer == "adafactor" and engine in ("deepspeed", "megatron")
    # DeepSpeed ZeRO-1 shards the optimizer state only, and adds buffers of its own (estimators/memory.py,
    # as stage_1_and_2.py does): grads_in_partition sized to the WHOLE tensors overlapping the rank's
    # partition (one big embedding: almost every gradient), the accumulated partition across gradient
    # accumulation steps, and an fp32 partition of the weights even for fp32 models. Over few ranks and with
    # a small state (SGD, 8-bit AdamW) they can outweigh what it shards, so the ZeRO-0 -> 1 step is compared
    # where the saving provably wins: AdamW's 8 bytes/param without accumulation, or >= 8 ranks
    zero1_pays = engine != "deepspeed" or dp >= 8 or (optimizer == "adamw" and gas == 1)
    previous: int | None = None
    for rung in rungs:
        doc = figures([*argv, "--engine", engine, *rung, "--mbs", str(mbs)])
        current = states(doc)
        if flattens and rung != ["--zero", "0"]:
            # DeepSpeed ZeRO >= 1 and Megatron's distributed optimizer hand Adafactor flat 1-D partitions, so
            # its second moment is no longer factored (a full moment per parameter, as the engines do): the
            # estimate says so, and the step from ZeRO-0 may rise; from there on sharding only lowers
            assert ADAFACTOR_FLAT_NOTE in doc["notes"], (rung, doc["notes"])
        if previous is not None and (rung != ["--zero", "1"] or (zero1_pays and not flattens)):
            assert current <= previous, (argv, rung, dp, current, previous)
        previous = current


@pytest.mark.parametrize(("arch", "seq_len", "named"), [
    ("layers=1e30,hidden=64,heads=2,seq=256", None, "--arch layers=1e30"),
    ("layers=2,hidden=1e200,heads=2,seq=256", None, "--arch hidden=1e200"),
    ("layers=2,hidden=64,heads=2", "99999999999", "--seq-len 99999999999"),
])
def test_an_oversized_shape_is_named_as_written(arch: str, seq_len: str | None, named: str) -> None:
    """The bound's line names the flag and the value as the user wrote them (not a 100-digit integer, not
    a profile field like fwd_flops_per_sample)."""
    argv = ["estimate", "--arch", arch, *(["--seq-len", seq_len] if seq_len else [])]
    run = run_cli(argv)
    check_outcome(run, argv)
    assert run.code == 2 and f"invalid {named}:" in run.stderr and "less than or equal" in run.stderr, run.stderr
