"""Parent side of model-file loading: profile a user's model file in a child process.

A model file runs user code, so it is imported only in a child (``python -m
optplan.probes._child``); this module never imports torch. The child resolves the model-file
contract, profiles the model on the meta/fake device and prints one JSON document, which is
validated here into a :class:`~optplan.estimators.profile.ModelProfile`.

Every problem a user can fix (no such file, a syntax error, a missing package, no model found, an
example batch the model rejects, a child that crashes or hangs...) is raised as
:class:`ModelFileError`, whose message is one line: ``"<file>: <problem> — <fix>"``. ModelFileError,
``check_model_path`` and ``one_line`` live in the pydantic-free :mod:`optplan.probes.model_errors` and are
re-exported here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from optplan.estimators.finetune import LoraRequest
from optplan.estimators.profile import ModelProfile
from optplan.probes._pdeathsig import guarded
from optplan.probes.host_quiet import group_from_env, wait_while_quiet
from optplan.probes.input_record import INPUTS_KEY
from optplan.probes.model_errors import ModelFileError, check_model_path, one_line
from optplan.probes.profile_cache import RecordedInputs, lookup, profile_cache_dir, request_key, store
from optplan.probes.waiting import communicate_until

CHILD_MODULE = "optplan.probes._child"
EXIT_OK = 0
EXIT_MODEL_ERROR = 3
KILL_WAIT_S = 5.0
"""How long the output of a killed profiler child is waited for (s)."""

__all__ = [
    "ModelFileError", "check_model_path", "one_line", "child_command", "child_options", "parse_child_output",
    "profile_model_file",
]


def child_command(path: str | os.PathLike[str], *, seq_len: int | None = None,
                  model_name: str | None = None, lora: LoraRequest | None = None) -> list[str]:
    """The command line that profiles ``path`` in a child process (``sys.executable -m ...``)."""
    return [sys.executable, "-m", CHILD_MODULE, str(path),
            *child_options(seq_len=seq_len, model_name=model_name, lora=lora)]


def child_options(*, seq_len: int | None = None, model_name: str | None = None,
                  lora: LoraRequest | None = None) -> list[str]:
    """The profiler child's options after the file (what a profile depends on besides the file: the cache keys on
    them)."""
    cmd: list[str] = []
    if seq_len is not None:
        cmd += ["--seq-len", str(int(seq_len))]
    if model_name is not None:
        cmd += ["--model-name", model_name]
    if lora is not None:
        cmd += ["--lora", "--lora-rank", str(int(lora.rank))]
        if lora.alpha is not None:
            cmd += ["--lora-alpha", repr(float(lora.alpha))]
        if lora.targets:
            cmd += ["--lora-targets", ",".join(lora.targets)]
        if lora.dropout:
            cmd += ["--lora-dropout", repr(float(lora.dropout))]
    return cmd


def child_process_env() -> dict[str, str]:
    """This process's environment plus ``PYTHONSAFEPATH=1``: ``python -m`` then leaves the working folder off
    ``sys.path`` (Python >= 3.11), so an ``optplan/`` folder or a stray ``numpy.py`` there is never imported
    (``_child`` drops that entry itself on older Pythons, after ``-m`` has found it)."""
    return {**os.environ, "PYTHONSAFEPATH": "1"}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _parse_json(stdout: str) -> Any:
    text = stdout.strip()
    if not text:
        raise ValueError("no output")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(_last_line(text))


def parse_child_output(path: str | os.PathLike[str], returncode: int, stdout: str, stderr: str) -> ModelProfile:
    """Turn the child's exit code and output into a ModelProfile or a ModelFileError."""
    doc = _child_document(path, returncode, stdout, stderr)
    doc.pop(INPUTS_KEY, None)
    return _validated(path, doc)


def _child_document(path: str | os.PathLike[str], returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    """The child's JSON profile document, or the ModelFileError its exit code and output say."""
    last_err = one_line(_last_line(stderr), 300)
    said = f" (last stderr line: {last_err})" if last_err else ""
    try:
        doc = _parse_json(stdout)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        err = doc["error"]
        raise ModelFileError(path, str(err.get("problem", "the profiler failed")),
                             str(err.get("fix", "run the file with python to see the error")), detail=stderr)
    if returncode != EXIT_OK or not isinstance(doc, dict):
        how = (f"killed by signal {-returncode}" if returncode < 0 else f"exit code {returncode}")
        what = "crashed" if returncode != EXIT_OK else "printed no JSON profile"
        raise ModelFileError(path, f"the profiler child process {what} ({how}){said}",
                             f"run `{sys.executable} -m {CHILD_MODULE} {path}` to see the full error", detail=stderr)
    return doc


def _validated(path: str | os.PathLike[str], doc: dict[str, Any]) -> ModelProfile:
    try:
        return ModelProfile.model_validate(doc)
    except ValidationError as exc:
        raise ModelFileError(path, f"the profiler returned an invalid profile: {one_line(exc, 200)}",
                             "this is an optplan bug; please report it with the model file") from exc


def profile_model_file(path: str | os.PathLike[str], *, seq_len: int | None = None,
                       model_name: str | None = None, timeout_s: float = 600.0,
                       cancelled: Callable[[], bool] | None = None, lora: LoraRequest | None = None,
                       use_cache: bool = True, env: Mapping[str, str] | None = None) -> ModelProfile:
    """Profile the model file at ``path`` in a child process and return its ModelProfile.

    ``seq_len`` overrides the file's ``OPTPLAN["seq_len"]`` and the model's own maximum length;
    ``model_name`` picks one model when the file defines several. The child runs with
    ``sys.executable`` and the current environment (so ``OPTPLAN_*`` variables reach the file).
    ``lora`` profiles the model with LoRA adapters (:mod:`optplan.probes.adapters`).
    Raises :class:`ModelFileError` (one line: file, problem, fix) for anything that goes wrong,
    including a crash or a timeout of the child. ``cancelled`` is asked every ``POLL_S`` s while the child
    runs: when it turns true the child is killed and :class:`~optplan.estimators.errors.Cancelled` raised;
    so is it on Ctrl-C (KeyboardInterrupt): no profiling child outlives this call. ``env``: variables the child
    gets on top of this process's environment (and the cache keys by), without touching ``os.environ`` (so
    threads may profile different files with different variables at once).

    With ``use_cache`` (and unless ``OPTPLAN_PROFILE_CACHE=off``), a profile made before from the same file,
    options and software, whose recorded inputs all still hold, is returned without a child
    (:mod:`optplan.probes.profile_cache`; its ``from_cache`` is True), and a new one is stored.
    """
    check_model_path(path)
    if seq_len is not None and int(seq_len) < 1:
        raise ModelFileError(path, f"sequence length must be >= 1 (got {seq_len})", "pass --seq-len 1 or more")
    cmd = child_command(path, seq_len=seq_len, model_name=model_name, lora=lora)
    environ = {**os.environ, **(env or {})}
    options = child_options(seq_len=seq_len, model_name=model_name, lora=lora)
    cached = _cache_slot(path, options, environ) if use_cache else None
    if cached is not None and (hit := _cache_lookup(*cached, environ)) is not None:
        return hit
    cache = tempfile.mkdtemp(prefix="optplan-profile-")  # torch's compile cache: removed here, whatever happens
    try:
        child_env = {**child_process_env(), **(env or {})}
        child_env.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
        stdout, stderr, code = _run_child(path, cmd, child_env, timeout_s, cancelled)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    doc = _child_document(path, code, stdout, stderr)
    inputs = doc.pop(INPUTS_KEY, None)
    profile = _validated(path, doc)
    if cached is not None:
        _cache_store(*cached, inputs, doc)
    return profile


# The profile cache is an accelerator: any failure of it (an unwritable or unknown home folder, a damaged entry)
# is a miss, never an error of the command.

def _cache_slot(path: str | os.PathLike[str], options: list[str],
                environ: Mapping[str, str]) -> tuple[Path, str] | None:
    """(folder, request key) of this profile in the cache, or None: cache off, file unreadable, or no usable folder."""
    try:
        folder = profile_cache_dir()
        key = request_key(path, options, environ) if folder is not None else None
    except Exception:  # noqa: BLE001 - e.g. RuntimeError from Path.home() with no HOME and no passwd entry
        return None
    return (folder, key) if folder is not None and key is not None else None


def _cache_lookup(folder: Path, key: str, environ: Mapping[str, str]) -> ModelProfile | None:
    try:
        hit = lookup(folder, key, environ)
        return None if hit is None else ModelProfile.model_validate({**hit, "from_cache": True})
    except Exception:  # noqa: BLE001 - an entry this optplan cannot read: profiled again and replaced
        return None


def _cache_store(folder: Path, key: str, inputs: object, doc: dict[str, Any]) -> None:
    try:
        store(folder, key, RecordedInputs.model_validate(inputs), doc)
    except Exception:  # noqa: BLE001 - no record from the child (it could not make one), or an unwritable folder
        return


def _run_child(path: str | os.PathLike[str], cmd: list[str], env: dict[str, str], timeout_s: float,
               cancelled: Callable[[], bool] | None) -> tuple[str, str, int]:
    """(stdout, stderr, exit code) of the profiler child; killed on a timeout, a cancel or Ctrl-C. In a quiet group
    it starts after any probe's timed steps (probes/host_quiet.py)."""
    wait_while_quiet(group_from_env(env))
    try:
        proc = subprocess.Popen(guarded(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL, errors="replace", env=env)
    except OSError as exc:
        raise ModelFileError(path, f"could not start the profiler child process ({exc})",
                             f"check that {sys.executable} runs") from exc
    try:
        stdout, stderr = communicate_until(proc, timeout_s=timeout_s, cancelled=cancelled)
    except subprocess.TimeoutExpired:
        _, err = _kill(proc)
        last = one_line(_last_line(err or ""), 300)
        said = f" (last stderr line: {last})" if last else ""
        raise ModelFileError(path, f"profiling did not finish within {timeout_s:g} s{said}",
                             "check that build_model() and forward finish quickly on the meta device, "
                             "or raise the timeout") from None
    except BaseException:  # cancelled, Ctrl-C: the child (user code) must not outlive the call
        _kill(proc)
        raise
    return stdout, stderr, proc.returncode


def _kill(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGKILL the child and collect what it wrote; a grandchild still holding its pipes is not waited for."""
    proc.kill()
    try:
        return proc.communicate(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.wait()
        return "", ""
