"""Reading ``launch.sh`` back and checking it with the launchers' own parsers (``validate_launch_sh``).

:func:`launch_argv` recovers the launcher's argument vector from the ``LAUNCH=( ... )`` array that
:func:`optplan.planner.export.launch.render_launch_sh` writes, without running anything (the format is
described there); :func:`validate_launch_sh` checks the bash syntax (``bash -n``) and feeds the vector to
``torch.distributed.run.get_args_parser`` / ``config_from_args`` or ``deepspeed.launcher.runner.parse_args``
and its hostfile reader, then compares what the launcher would run with the plan. Shared with the SLURM
export (:mod:`optplan.planner.export.slurm`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from optplan.planner.export.context import ExportPlan
from optplan.planner.export.launch import RUNTIME_PLACEHOLDERS, render_hostfile
from optplan.planner.export.megatron import PRETRAIN_SCRIPT, validate_megatron_args
from optplan.planner.validate import ExportValidationError

# --------------------------------------------------------------------------------------------------
# Reading the launcher line back
# --------------------------------------------------------------------------------------------------


class _Unresolved(Exception):
    """A variable reference with no value (internal)."""


_DQ_PART = re.compile(r"\\(.)|\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)|(\$)|([^\\$`]+)|(`)", re.S)
_SEGMENT = re.compile(r"""'(?P<sq>[^']*)'|"(?P<dq>(?:[^"\\]|\\.)*)"|(?P<other>[^'"]+)|(?P<bad>['"])""", re.S)
_BASH_SPECIAL = set(";|&<>(){}*?[]~`$\\#!")


def _expand_dq(content: str, env: Mapping[str, str]) -> str:
    out: list[str] = []
    for m in _DQ_PART.finditer(content):
        esc, braced, plain, lone_dollar, text, backtick = m.groups()
        if esc is not None:
            out.append(esc if esc in '"\\$`' else "\\" + esc)  # bash keeps other backslashes inside "..."
        elif braced or plain:
            name = braced or plain
            if name not in env:
                raise _Unresolved(name)
            out.append(env[name])
        elif lone_dollar or backtick:
            raise ExportValidationError("the LAUNCH array uses shell expansion optplan does not read back "
                                        f"({content!r}): use plain \"$NAME\" references")
        else:
            out.append(text)
    return "".join(out)


def _words(text: str, env: Mapping[str, str]) -> list[str]:
    """Shell words of ``text`` (literals and double-quoted ``$NAME`` references only), expanded.

    Double-quoted parts are replaced by the ``shlex.quote`` of their expansion, single-quoted parts are
    kept, and the result is split with ``shlex.split`` (POSIX rules, as bash reads quotes).
    """
    rebuilt: list[str] = []
    for m in _SEGMENT.finditer(text):
        if m.group("bad") is not None:
            raise ExportValidationError(f"unterminated quote in {text.strip()!r}")
        if m.group("sq") is not None:
            rebuilt.append(m.group(0))
        elif m.group("dq") is not None:
            rebuilt.append(shlex.quote(_expand_dq(m.group("dq"), env)))
        else:
            other = m.group("other")
            bad = sorted(set(other) & _BASH_SPECIAL)
            if bad:
                raise ExportValidationError(f"unquoted shell syntax {''.join(bad)!r} in {text.strip()!r}: the "
                                            "LAUNCH array holds literal words and \"$NAME\" references only")
            rebuilt.append(other)
    return shlex.split("".join(rebuilt), comments=False, posix=True)


_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)")
_DEFAULTED = re.compile(r'"\$\{([A-Za-z_][A-Za-z0-9_]*):-(.*)\}"')
_DEFAULT_REF = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
_DEFAULT_LITERAL = re.compile(r"[A-Za-z0-9_.:/@%+=,-]*")


def _assignments(lines: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """The variables as the script would set them, given ``env`` (environment and run-time values).

    Reads unindented ``NAME=WORD`` and ``NAME="${NAME:-DEFAULT}"`` lines (DEFAULT a ``$REF`` or a plain
    literal); anything else (command substitution, conditionals) leaves the variable as ``env`` has it.
    """
    values = dict(env)
    for line in lines:
        m = _ASSIGN.fullmatch(line.rstrip())
        if not m:
            continue
        name, value = m.groups()
        d = _DEFAULTED.fullmatch(value)
        if d and d.group(1) == name:
            if values.get(name):
                continue  # set and non-empty: ${NAME:-...} keeps it
            ref = _DEFAULT_REF.fullmatch(d.group(2))
            if ref and ref.group(1) in values:
                values[name] = values[ref.group(1)]
            elif _DEFAULT_LITERAL.fullmatch(d.group(2)):
                values[name] = d.group(2)
            continue
        try:
            words = _words(value, values)
        except (_Unresolved, ExportValidationError, ValueError):
            continue  # computed at run time ($(...), conditionals): the caller's value (if any) stands
        if len(words) == 1:
            values[name] = words[0]
    return values


def launch_argv(text: str, *, env: Mapping[str, str] | None = None) -> list[str]:
    """The launcher's argument vector in a launch.sh/slurm.sbatch text, without running it.

    ``env`` gives the environment of the simulated run and the run-time values (default
    :data:`RUNTIME_PLACEHOLDERS`); variables with a default in the script take it unless ``env`` sets
    them. The extra ``"$@"`` arguments are not included. Raises ExportValidationError when the text has
    no single ``LAUNCH=(`` ... ``)`` array, uses shell syntax beyond literals and ``"$NAME"``, or refers to
    a variable that has no value.
    """
    env = RUNTIME_PLACEHOLDERS if env is None else env
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "LAUNCH=("]
    if len(starts) != 1:
        raise ExportValidationError(f"expected one 'LAUNCH=(' line holding the launcher command, found "
                                    f"{len(starts)}: re-export the script")
    start = starts[0]
    ends = [i for i in range(start + 1, len(lines)) if lines[i].strip() == ")"]
    if not ends:
        raise ExportValidationError("the LAUNCH=( array is not closed by a ')' line: re-export the script")
    body = [line for line in lines[start + 1:ends[0]] if line.strip() and not line.lstrip().startswith("#")]
    values = _assignments(lines[:start], env)
    argv: list[str] = []
    for line in body:
        try:
            argv += _words(line, values)
        except _Unresolved as exc:
            raise ExportValidationError(f"the LAUNCH array uses ${exc.args[0]}, which has no default in the script "
                                        "and no run-time value: assign it before the array") from None
        except ValueError as exc:
            raise ExportValidationError(f"cannot read LAUNCH line {line.strip()!r}: {exc}") from None
    if not argv:
        raise ExportValidationError("the LAUNCH array is empty: re-export the script")
    return argv


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _bash_path() -> str | None:
    return shutil.which("bash")


def check_bash_syntax(text: str, name: str) -> None:
    """``bash -n`` on ``text`` (ExportValidationError with bash's message); when bash is not installed,
    a RuntimeWarning says the syntax check was skipped and why."""
    bash = _bash_path()
    if bash is None:
        warnings.warn(f"bash is not installed: skipped the 'bash -n' syntax check of {name}", RuntimeWarning,
                      stacklevel=3)
        return
    result = subprocess.run([bash, "-n"], input=text, capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        message = " ".join(result.stderr.split()) or f"exit status {result.returncode}"
        raise ExportValidationError(f"bash -n rejects {name}: {message}")


class _QuietFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextlib.contextmanager
def _quiet(*loggers: str) -> Iterator[None]:
    """Hold back INFO/WARNING records of ``loggers`` for the duration (the filters are removed after)."""
    quiet = _QuietFilter()
    for name in loggers:
        logging.getLogger(name).addFilter(quiet)
    try:
        yield
    finally:
        for name in loggers:
            logging.getLogger(name).removeFilter(quiet)


def _parse_with(parse: Any, argv: list[str], what: str) -> argparse.Namespace:
    """Run a launcher's argparse-based parser; its usage error becomes one ExportValidationError line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(argv)
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        message = lines[-1] if lines else "usage error"
        raise ExportValidationError(f"{what} rejects the launch arguments: {message}") from None


@contextlib.contextmanager
def _torchrun_side_effects() -> Iterator[str]:
    """``config_from_args`` sets OMP_NUM_THREADS in os.environ and makes a log folder: undo both after."""
    saved = os.environ.get("OMP_NUM_THREADS")
    with tempfile.TemporaryDirectory(prefix="optplan-torchrun-") as log_dir, _quiet("torch.distributed.run"):
        try:
            yield log_dir
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved


def check_torchrun_argv(argv: Sequence[str], plan: ExportPlan, *, what: str = "launch.sh") -> argparse.Namespace:
    """Parse ``argv`` (``torchrun ...``) with ``torch.distributed.run.get_args_parser`` and check it
    against ``plan``; returns torch's namespace.

    Checks: nnodes is exactly ``plan.nodes`` (no elastic range), nproc-per-node ``plan.procs_per_node`` and
    their product the world size; one node uses ``--standalone`` or a rendezvous endpoint; several nodes
    use a non-static rendezvous with an endpoint and an explicit id and not ``--standalone`` (which would
    give every node its own localhost rendezvous). Then ``torch.distributed.run.config_from_args`` resolves
    the arguments as torchrun would (no GPU needed for an integer nproc-per-node) and its LaunchConfig is
    checked again. Raises ExportValidationError (one line).
    """
    argv = list(argv)
    if not argv or os.path.basename(argv[0]) != "torchrun":
        raise ExportValidationError(f"{what} does not launch with torchrun (LAUNCH starts with "
                                    f"{argv[0] if argv else 'nothing'!r}): re-export with launcher torchrun")
    import torch.distributed.run as torchrun

    args = _parse_with(torchrun.get_args_parser().parse_args, argv[1:], "torchrun's parser")
    try:
        lo, hi = torchrun.parse_min_max_nnodes(args.nnodes)
        nproc = int(args.nproc_per_node)
    except (ValueError, RuntimeError) as exc:
        raise ExportValidationError(f"{what}: torchrun cannot read --nnodes {args.nnodes!r} / --nproc-per-node "
                                    f"{args.nproc_per_node!r} as fixed numbers ({exc}): state both as integers") from None
    if lo != hi:
        raise ExportValidationError(f"{what} asks torchrun for an elastic node range {args.nnodes}: the plan needs "
                                    f"exactly {plan.nodes} node(s), pass --nnodes {plan.nodes}")
    if (lo, nproc) != (plan.nodes, plan.procs_per_node):
        raise ExportValidationError(
            f"{what} starts {lo} node(s) x {nproc} process(es) = {lo * nproc} ranks but the plan needs "
            f"{plan.nodes} x {plan.procs_per_node} = {plan.world_size}: re-export the plan"
        )
    if lo > 1:  # one node needs nothing more: torchrun falls back to a local c10d rendezvous
        if args.standalone:
            raise ExportValidationError(f"{what} uses --standalone on {lo} nodes, which gives every node its own "
                                        "local rendezvous: use --rdzv-backend c10d --rdzv-endpoint HOST:PORT")
        if args.rdzv_backend == "static":
            raise ExportValidationError(f"{what} uses the static rendezvous on {lo} nodes, which needs a different "
                                        "--node-rank per node: use --rdzv-backend c10d")
        if not args.rdzv_endpoint:
            raise ExportValidationError(f"{what} gives torchrun no --rdzv-endpoint for {lo} nodes: add "
                                        "--rdzv-endpoint FIRST_NODE:PORT")
        if args.rdzv_id in ("", "none"):
            raise ExportValidationError(f"{what} leaves torchrun's --rdzv-id at its default: pass an id shared by "
                                        "the job's nodes (e.g. the SLURM job id)")
    with _torchrun_side_effects() as log_dir:
        resolved = argparse.Namespace(**vars(args))
        if resolved.log_dir is None:
            resolved.log_dir = log_dir  # torchrun would mkdtemp() one; keep it inside our temporary folder
        try:
            config, _cmd, _cmd_args = torchrun.config_from_args(resolved)
        except Exception as exc:  # torchrun raises AssertionError, ValueError, RuntimeError...
            raise ExportValidationError(f"torchrun cannot resolve {what}'s arguments: {type(exc).__name__}: "
                                        f"{' '.join(str(exc).split())}") from None
    if (config.min_nodes, config.max_nodes, config.nproc_per_node) != (plan.nodes, plan.nodes, plan.procs_per_node):
        raise ExportValidationError(f"torchrun resolves {what} to {config.min_nodes}-{config.max_nodes} node(s) x "
                                    f"{config.nproc_per_node} but the plan needs {plan.nodes} x {plan.procs_per_node}")
    check_launched_program(args.training_script, list(args.training_script_args), plan, what=what)
    return args


def check_launched_program(program: str, program_args: list[str], plan: ExportPlan, *, what: str) -> None:
    """The program a launcher starts fits the plan's engine: ``--deepspeed CONFIG`` for DeepSpeed,
    ``pretrain_gpt.py`` with :func:`validate_megatron_args` for Megatron, no ``--deepspeed`` for torch."""
    engine = plan.strategy.engine
    if engine == "deepspeed":
        if len(program_args) < 2 or program_args[0] != "--deepspeed" or not program_args[1]:
            raise ExportValidationError(f"{what} starts {program!r} without '--deepspeed CONFIG' for a DeepSpeed "
                                        "plan: re-export the plan")
    elif engine == "megatron":
        if os.path.basename(program) != PRETRAIN_SCRIPT:
            raise ExportValidationError(f"{what} starts {program!r} for a Megatron plan, not Megatron-LM's "
                                        f"{PRETRAIN_SCRIPT}: re-export the plan")
        validate_megatron_args(program_args, plan)
    elif "--deepspeed" in program_args:
        raise ExportValidationError(f"{what} passes --deepspeed to a torch-engine plan's script: re-export the plan, "
                                    "or plan with --engine deepspeed")


def _import_ds_runner() -> Any:
    with _quiet("DeepSpeed"), contextlib.redirect_stdout(io.StringIO()):
        try:
            import deepspeed.launcher.runner as runner
        except Exception as exc:  # pragma: no cover - depends on the environment
            raise ExportValidationError(f"cannot import deepspeed to validate the DeepSpeed launcher line "
                                        f"({type(exc).__name__}: {exc}): pip install deepspeed") from exc
    return runner


def _check_hostfile(runner: Any, hostfile_text: str, args: argparse.Namespace, plan: ExportPlan) -> None:
    """DeepSpeed's own hostfile reader and resource filters on ``hostfile_text``."""
    with tempfile.TemporaryDirectory(prefix="optplan-hostfile-") as folder:
        path = os.path.join(folder, "hostfile")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(hostfile_text)
        with _quiet("DeepSpeed"):
            try:
                pool = runner.fetch_hostfile(path)
            except ValueError as exc:
                raise ExportValidationError(f"DeepSpeed rejects the hostfile: {' '.join(str(exc).split())}") from None
    if len(pool) != plan.nodes:
        raise ExportValidationError(f"the hostfile lists {len(pool)} host(s) but the plan needs {plan.nodes}: list "
                                    "one line per node")
    wrong = {host: slots for host, slots in pool.items() if slots != plan.procs_per_node}
    if wrong:
        host, slots = next(iter(wrong.items()))
        raise ExportValidationError(f"hostfile host {host} has slots={slots} but the plan starts "
                                    f"{plan.procs_per_node} process(es) per node: set slots={plan.procs_per_node}")
    try:
        active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
        if hasattr(runner, "apply_num_nodes_and_gpus"):  # deepspeed >= 0.19: main()'s own trimming
            active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    except ValueError as exc:
        raise ExportValidationError(f"DeepSpeed cannot apply the launch arguments to the hostfile: {exc}") from None
    ranks = sum(len(slots) for slots in active.values())
    if ranks != plan.world_size:
        raise ExportValidationError(f"DeepSpeed would start {ranks} ranks from the hostfile and the launch arguments "
                                    f"but the plan needs {plan.world_size}: fix --num_nodes/--num_gpus or the hostfile")


def _check_deepspeed_argv(argv: list[str], plan: ExportPlan, hostfile_text: str | None) -> None:
    if plan.strategy.engine != "deepspeed":
        raise ExportValidationError(f"launch.sh uses DeepSpeed's launcher for a {plan.strategy.engine}-engine plan "
                                    "(it appends --local_rank to the script's arguments): re-export with launcher "
                                    "torchrun")
    runner = _import_ds_runner()
    args = _parse_with(runner.parse_args, argv[1:], "DeepSpeed's launcher parser")
    if args.num_gpus != plan.procs_per_node:
        raise ExportValidationError(f"launch.sh passes --num_gpus {args.num_gpus} but the plan starts "
                                    f"{plan.procs_per_node} process(es) per node: pass --num_gpus {plan.procs_per_node}")
    if args.include or args.exclude:
        raise ExportValidationError("launch.sh passes --include/--exclude, which DeepSpeed forbids together with "
                                    "--num_nodes/--num_gpus: drop them")
    if plan.nodes == 1:
        if args.num_nodes not in (-1, 1):
            raise ExportValidationError(f"launch.sh passes --num_nodes {args.num_nodes} for a one-node plan: pass "
                                        "--num_nodes 1")
    else:
        if args.num_nodes != plan.nodes:
            raise ExportValidationError(f"launch.sh passes --num_nodes {args.num_nodes} but the plan needs "
                                        f"{plan.nodes}: pass --num_nodes {plan.nodes}")
        if args.hostfile == getattr(runner, "DLTS_HOSTFILE", "/job/hostfile"):
            raise ExportValidationError("launch.sh gives DeepSpeed no --hostfile for a multi-node plan: pass "
                                        "--hostfile hostfile")
        _check_hostfile(runner, render_hostfile(plan) if hostfile_text is None else hostfile_text, args, plan)
    check_launched_program(args.user_script, list(args.user_args), plan, what="launch.sh")


def validate_launch_sh(text: str, plan: ExportPlan, *, hostfile_text: str | None = None) -> None:
    """Check a launch.sh text for ``plan`` with bash and with its launcher's own parser.

    1. ``bash -n`` (skipped with a RuntimeWarning when bash is missing).
    2. The LAUNCH array is read back (:func:`launch_argv`, run-time values from
       :data:`RUNTIME_PLACEHOLDERS`, every overridable variable at its default).
    3. torchrun: :func:`check_torchrun_argv` (``torch.distributed.run.get_args_parser`` and
       ``config_from_args``; nodes x processes = the plan's world size).
       deepspeed: ``deepspeed.launcher.runner.parse_args``; ``--num_gpus`` = processes per node,
       ``--num_nodes`` = nodes; on several nodes the hostfile (``hostfile_text``, else
       :func:`render_hostfile` of the plan) goes through ``fetch_hostfile`` (slots = processes per node,
       hosts = nodes) and DeepSpeed's resource filters, which must give the world size.
    4. The launched program fits the engine (:func:`check_launched_program`; Megatron arguments through
       :func:`validate_megatron_args`).

    Raises ExportValidationError with one line naming the problem and the fix.
    """
    if not isinstance(text, str) or not text.strip():
        raise ExportValidationError("launch.sh is empty: re-export the plan")
    check_bash_syntax(text, "launch.sh")
    argv = launch_argv(text)
    program = os.path.basename(argv[0])
    if program == "torchrun":
        check_torchrun_argv(argv, plan, what="launch.sh")
    elif program == "deepspeed":
        _check_deepspeed_argv(argv, plan, hostfile_text)
    else:
        raise ExportValidationError(f"launch.sh starts {argv[0]!r}, not torchrun or deepspeed: re-export the plan")


__all__ = [
    "check_bash_syntax",
    "check_launched_program",
    "check_torchrun_argv",
    "launch_argv",
    "validate_launch_sh",
]
