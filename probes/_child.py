"""Profiler child process: ``python -m optplan.probes._child FILE [--seq-len N] [--model-name NAME]``.

Imports the user's model file, resolves the contract, profiles the model on the meta/fake device and
prints ONE JSON document to stdout: the ModelProfile with, under :data:`INPUTS_KEY`, what the profile read
(:mod:`optplan.probes.input_record`, for the parent's profile cache) (exit code 0), or
``{"error": {"problem": ..., "fix": ...}}`` (exit code 3). Anything the user's code prints, even
from C extensions, goes to stderr: file descriptor 1 is pointed at stderr while user code runs and
the JSON is written to the saved original stdout.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

import os  # noqa: E402
import sys  # noqa: E402

from optplan.probes._safe_path import drop_working_folder  # noqa: E402

# before anything else is imported, so that a stray ``numpy.py`` in the working folder never runs; the model
# file's own folder goes on sys.path when the file is imported (as ``python FILE`` does); PYTHONPATH applies
drop_working_folder()

import argparse  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

from optplan.probes.input_record import INPUTS_KEY, InputRecorder  # noqa: E402

EXIT_OK = 0
EXIT_MODEL_ERROR = 3


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m optplan.probes._child",
                                     description="Profile an optplan model file; prints one JSON document.")
    parser.add_argument("path")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--model-name", default=None)
    parser.add_argument("--lora", action="store_true", help="profile with LoRA adapters")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-alpha", type=float, default=None)
    parser.add_argument("--lora-targets", default=None, help="comma-separated module names")
    parser.add_argument("--lora-dropout", type=float, default=0.0, help="peft lora_dropout")
    return parser.parse_args(argv)


def _check_syntax(path: str) -> None:
    """Compile the file (no execution) so that a syntax error is reported before torch loads."""
    from optplan.probes.loader import ModelFileError, check_model_path

    p = check_model_path(path)
    try:
        source = p.read_bytes()
    except OSError as exc:
        raise ModelFileError(path, f"cannot be read ({exc.strerror or exc})", "check the file's permissions") from None
    try:
        compile(source, str(p), "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = f"line {exc.lineno}" if exc.lineno else "unknown line"
        raise ModelFileError(path, f"syntax error at {where}: {exc.msg}",
                             f"fix the syntax at {where} (`python -m py_compile {path}` shows it)") from None
    except ValueError as exc:  # e.g. null bytes
        raise ModelFileError(path, f"is not Python source ({exc})", "pass a .py source file") from None


def _run(args: argparse.Namespace, recorder: InputRecorder) -> tuple[dict[str, Any], int]:
    from optplan.probes.loader import ModelFileError

    try:
        _check_syntax(args.path)  # before importing torch: a syntax error is reported in a blink
        from optplan.probes.adapters import lora_request_from
        from optplan.probes.contract import load_contract
        from optplan.probes.static import profile_contract

        sys.argv = [args.path]  # as if the user ran `python FILE`
        contract = load_contract(args.path, model_name=args.model_name)
        profile = profile_contract(contract, seq_len=args.seq_len, started=_STARTED, lora=lora_request_from(args))
        return {**profile.model_dump(mode="json"), **_inputs(recorder)}, EXIT_OK
    except ModelFileError as exc:
        root: BaseException = exc
        while (nxt := root.__cause__ or root.__context__) is not None:
            root = nxt
        if root is not exc:  # the user's code's own traceback, for `optplan --debug`
            traceback.print_exception(type(root), root, root.__traceback__)
        return {"error": {"problem": exc.problem, "fix": exc.fix}}, EXIT_MODEL_ERROR
    except Exception as exc:  # noqa: BLE001 - report anything as one JSON error, traceback to stderr
        traceback.print_exc()
        return {"error": {"problem": f"profiling failed with {type(exc).__name__}: {exc}",
                          "fix": "run the file with python to check it works; if it does, this is an optplan "
                                 "bug: please report it with the traceback above"}}, EXIT_MODEL_ERROR


def _inputs(recorder: InputRecorder) -> dict[str, Any]:
    """``{INPUTS_KEY: what the profile read}`` for the parent's profile cache; ``{}`` (the parent then keeps
    nothing) if the record cannot be made: the profile itself stands."""
    try:
        from optplan.probes.profile_cache import own_source_roots

        return {INPUTS_KEY: recorder.report(own_roots=own_source_roots())}
    except Exception:  # noqa: BLE001 - e.g. the working folder was removed while the model ran
        traceback.print_exc()
        return {}


def main(argv: list[str] | None = None) -> int:
    # torch's compile cache folder (created by importing torch._dynamo) is a private one the parent made
    # (TORCHINDUCTOR_CACHE_DIR, see optplan.probes.loader) and removes, even when this process is killed
    args = _parse_args(argv)  # first: argparse's own reads (COLUMNS, LANG...) are not the profile's inputs
    recorder = InputRecorder()
    recorder.install()  # before the model file or torch is imported: every file and variable they read is seen
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # user prints (Python and C level) go to stderr
    sys.stdout = sys.stderr
    try:
        doc, code = _run(args, recorder)
    finally:
        sys.stderr.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
        sys.stdout = sys.__stdout__
    text = json.dumps(doc)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
