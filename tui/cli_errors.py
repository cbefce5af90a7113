"""How the command line fails: exit codes, SIGTERM as an interrupt, and the one-line messages that replace
tracebacks (user-fixable errors exit 2, interrupts 130/143, optplan's own bugs 3; ``--debug`` re-raises)."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import TypeVar

import click
import typer
from pydantic import ValidationError
from rich.console import Console

from optplan.estimators.errors import OptplanError

T = TypeVar("T")
EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT, as shells report it)."""
EXIT_TERMINATED = 143
"""Exit code after SIGTERM (128 + SIGTERM): ``kill``, ``scancel``, a container stop."""
EXIT_INTERNAL = 3
"""Exit code after an unexpected error inside optplan (a bug, not bad input): one line, the traceback with --debug."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so that the same clean-up runs (probe trees killed,
    exports rolled back, the study left resumable)."""


def on_sigterm(_signum: int, _frame: object) -> None:
    raise Terminated("terminated")


def interrupted_code(err: KeyboardInterrupt) -> int:
    return EXIT_TERMINATED if isinstance(err, Terminated) else EXIT_INTERRUPTED


def fail(message: str) -> typer.Exit:
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"error: {message}", style="red", markup=False)
    return typer.Exit(code=2)


def validation_message(err: ValidationError) -> str:
    """One line for a pydantic error on flag values: the flag, the problem, the given value."""
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ())]
    msg = str(first.get("msg", err)).removeprefix("Value error, ")
    if not loc:
        return f"invalid combination of options: {msg}"
    given = first.get("input")
    return f"invalid --{loc[-1].replace('_', '-')} {given!r}: {msg} (see --help)"


def guard(ctx: typer.Context, body: Callable[[], T]) -> T:
    """Run a command body; turn user-fixable errors into one line + exit 2, a bug into one line + exit 3 (with
    --debug the traceback comes first; the exit code is the same)."""
    debug = bool(ctx.obj and ctx.obj.get("debug"))
    try:
        return body()
    except OptplanError as err:
        if debug:
            detail = getattr(err, "detail", "")
            if detail:
                sys.stderr.write(f"--- output of the model file's child process ---\n{detail.rstrip()}\n---\n")
            traceback.print_exc(file=sys.stderr)
        raise fail(str(err)) from None
    except ValidationError as err:
        if debug:
            traceback.print_exc(file=sys.stderr)
        raise fail(validation_message(err)) from None
    except KeyboardInterrupt as err:  # Ctrl-C: child processes are already stopped by the layer that started them
        fail(str(err) or "interrupted")
        raise typer.Exit(code=interrupted_code(err)) from None
    except (typer.Exit, typer.Abort, click.exceptions.ClickException):
        raise
    except Exception as err:  # a bug: one line that says so (the traceback with --debug), never a bare traceback
        if debug:
            traceback.print_exc(file=sys.stderr)
        text = " ".join(str(err).split())
        fail(f"internal error in optplan ({type(err).__name__}{': ' + text if text else ''}): this is a bug, not "
              "your input; rerun with --debug for the traceback and report it")
        raise typer.Exit(code=EXIT_INTERNAL) from None


def usage_error_type() -> type[Exception]:
    """click's UsageError as this typer uses it (typer >= 0.20 vendors click as typer._click)."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def usage_message(err: Exception) -> str:
    """click's message, or for a value typer's pydantic coercion refused (``--gpus eight``), one naming the
    flag, the value given and the type expected: ``invalid --gpus 'eight': expected a valid integer``."""
    cause = err.__cause__
    param = getattr(err, "param", None)
    if isinstance(cause, ValidationError) and param is not None and cause.errors():
        first = cause.errors()[0]
        flags = [o for o in getattr(param, "opts", ()) if o.startswith("--")]
        flag = flags[0] if flags else str(getattr(param, "name", "value")).upper()
        reason = str(first.get("msg", "")).split(", unable to")[0]
        reason = reason.replace("Input should be", "expected", 1)
        return f"invalid {flag} {first.get('input')!r}: {reason}"
    return str(err.format_message())  # type: ignore[attr-defined]
