"""``slurm.sbatch``: a SLURM batch script that starts a plan with torchrun on every node (pure function
ExportPlan -> bash text), and its validator.

Layout (flag names from ``sbatch(1)``/``srun(1)`` and ``torch.distributed.run.get_args_parser``):

- ``#SBATCH --nodes N --ntasks-per-node 1 --gpus-per-node G --cpus-per-task C`` (plus ``--exclusive``
  when the plan fills whole nodes, and ``--job-name``/``--time``/``--partition``): one SLURM task per
  node, which runs torchrun, which starts G worker processes. sbatch reads ``#SBATCH`` lines only before
  the first command, so they come right after the shebang.
- Rendezvous on the allocation's first node: ``head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" |
  head -n1)`` and ``torchrun --nnodes "$SLURM_NNODES" --nproc-per-node G --rdzv-id "$SLURM_JOB_ID"
  --rdzv-backend c10d --rdzv-endpoint "$head:$MASTER_PORT"`` (c10d assigns node ranks, so every task runs
  the same command).
- ``srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_PER_TASK"``: srun no longer inherits
  ``--cpus-per-task`` from sbatch (Slurm >= 22.05), and without it each torchrun and its workers would be
  bound to one CPU.
- The launched program is the one launch.sh starts (:func:`optplan.planner.export.launch.launched_command`,
  same code). ``SCRIPT_DIR`` is ``$SLURM_SUBMIT_DIR``: SLURM runs a copy of the script from its spool
  folder, so files next to it (ds_config.json) are found in the folder ``sbatch`` was run from; submit
  from the export folder, or set ``DS_CONFIG``.

The launcher command is the machine-readable ``LAUNCH=( ... )`` array described in launch.py.
"""

from __future__ import annotations

import argparse
import re
import shlex

from optplan.estimators.errors import OptplanError
from optplan.planner.export.context import ExportPlan
from optplan.planner.export.launch import (
    DEFAULT_MASTER_PORT,
    RUNTIME_PLACEHOLDERS,
    bash_comment,
    default_rdzv_id,
    header_comments,
    launch_block,
    launched_command,
)
from optplan.planner.export.launch_check import check_bash_syntax, check_torchrun_argv, launch_argv
from optplan.planner.validate import ExportValidationError

DEFAULT_CPUS_PER_GPU = 8
"""CPUs requested per GPU when ``cpus_per_task`` is not given (data-loader workers plus the rank itself)."""

_JOB_NAME = re.compile(r"[A-Za-z0-9_.+-]{1,128}")
_PARTITION = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")
_TIME = re.compile(r"(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}"
                   r"|UNLIMITED|INFINITE)")
_SRUN = re.compile(r'^\s*(exec\s+)?srun\s.*"\$\{LAUNCH\[@\]\}"')

NCCL_HINTS: tuple[str, ...] = (
    "NCCL hints (uncomment what the cluster needs):",
    "  export NCCL_DEBUG=WARN                    # INFO when debugging hangs or slow collectives",
    "  export NCCL_SOCKET_IFNAME=ib0             # interface for NCCL's bootstrap/socket traffic",
    "  export NCCL_IB_HCA=mlx5                   # InfiniBand adapters to use (ibstat lists them)",
    "  export TORCH_NCCL_ASYNC_ERROR_HANDLING=1  # fail fast when a rank dies instead of hanging",
    "  export NCCL_CROSS_NIC=0                   # keep rings on one NIC per rail (rail-optimised fabrics)",
)


def _check_option(label: str, value: str | None, pattern: re.Pattern[str], fix: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise OptplanError(f"SLURM {label} {value!r} is not valid: {fix}")
    return value


def render_slurm_sbatch(plan: ExportPlan, *, job_name: str | None = None, time_limit: str | None = None,
                        partition: str | None = None, train_script: str = "train.py",
                        ds_config_name: str = "ds_config.json", cpus_per_task: int | None = None) -> str:
    """The slurm.sbatch text for ``plan`` (see the module docstring).

    ``job_name`` defaults to ``optplan-<model>``; ``time_limit`` is a SLURM time (``MM``, ``HH:MM:SS``,
    ``D-HH:MM``...); ``cpus_per_task`` defaults to :data:`DEFAULT_CPUS_PER_GPU` per GPU. Raises OptplanError
    for a bad job name, time, partition or CPU count, and NotExportable when the launched program refuses
    the plan (see ``launched_command``).
    """
    job_name = _check_option("job name", default_rdzv_id(plan) if job_name is None else job_name, _JOB_NAME,
                             "use letters, digits and . _ + - (at most 128)")
    time_limit = _check_option("time limit", time_limit, _TIME, "use MM, HH:MM:SS or D-HH:MM:SS")
    partition = _check_option("partition", partition, _PARTITION, "use the partition's name (sinfo lists them)")
    procs = plan.procs_per_node
    if cpus_per_task is None:
        cpus_per_task = DEFAULT_CPUS_PER_GPU * procs
    if isinstance(cpus_per_task, bool) or not isinstance(cpus_per_task, int) or cpus_per_task < procs:
        raise OptplanError(f"cpus per task must be an integer >= the {procs} processes per node (got "
                           f"{cpus_per_task!r}): pass at least {procs}")
    command = launched_command(plan, train_script=train_script, ds_config_name=ds_config_name)

    directives = [f"--job-name={job_name}", f"--nodes={plan.nodes}", "--ntasks-per-node=1",
                  f"--gpus-per-node={procs}", f"--cpus-per-task={cpus_per_task}"]
    if procs == plan.gpus_per_node:
        directives.append("--exclusive")
    if time_limit:
        directives.append(f"--time={time_limit}")
    if partition:
        directives.append(f"--partition={partition}")
    overrides = [*command.overrides, f"MASTER_PORT (default {DEFAULT_MASTER_PORT})"]

    lines = ["#!/usr/bin/env bash", *(f"#SBATCH {d}" for d in directives)]
    lines += header_comments(plan, "slurm.sbatch", f"srun + torchrun, {plan.nodes} node(s) x {procs} GPU(s)")
    lines += [
        bash_comment("Submit from the folder holding the exported files: sbatch slurm.sbatch [program arguments...]"),
        bash_comment(f"  one task per node runs torchrun, which starts {procs} process(es); the allocation's first node "
                 "hosts the c10d rendezvous."),
        bash_comment("Environment overrides: " + "; ".join(overrides) + "."),
        bash_comment("SCRIPT_DIR is the folder sbatch was run from ($SLURM_SUBMIT_DIR): SLURM runs a copy of this "
                     "script, so the files next to it are looked up there."),
    ]
    lines += [bash_comment(f"NOTE: {note}") for note in command.notes]
    lines += [bash_comment(hint) for hint in NCCL_HINTS]
    lines += [
        "set -euo pipefail",
        "",
        'SCRIPT_DIR="${SLURM_SUBMIT_DIR:-$PWD}"',
        *command.assignments,
        f'MASTER_PORT="${{MASTER_PORT:-{DEFAULT_MASTER_PORT}}}"',
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) || true  # SIGPIPE-safe under pipefail',
        'if [[ -z "$head" ]]; then',
        '  echo "slurm.sbatch: scontrol named no node in SLURM_JOB_NODELIST; submit with sbatch" >&2',
        "  exit 2",
        "fi",
        *command.checks,
        *command.exports,
        "",
    ]
    words = ["torchrun", '--nnodes "$SLURM_NNODES"', f"--nproc-per-node {procs}", '--rdzv-id "$SLURM_JOB_ID"',
             "--rdzv-backend c10d", '--rdzv-endpoint "$head:$MASTER_PORT"']
    lines += launch_block(words, command,
                          run='srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 ')
    return "\n".join(lines) + "\n"


class _DirectiveParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ExportValidationError(f"sbatch would reject the #SBATCH directives: {message}")


def _directive_parser() -> _DirectiveParser:
    """The sbatch options the validator reads (names and short forms as in sbatch(1))."""
    p = _DirectiveParser(prog="sbatch", add_help=False, allow_abbrev=False)
    p.add_argument("-N", "--nodes")
    p.add_argument("--ntasks-per-node", type=int)
    p.add_argument("--gpus-per-node")
    p.add_argument("--gres")
    p.add_argument("-c", "--cpus-per-task", type=int)
    p.add_argument("--exclusive", nargs="?", const="exclusive")
    p.add_argument("-J", "--job-name")
    p.add_argument("-t", "--time")
    p.add_argument("-p", "--partition")
    return p


def parse_sbatch_directives(text: str) -> tuple[argparse.Namespace, list[str]]:
    """The ``#SBATCH`` options sbatch would read from ``text`` (known ones parsed, the rest returned).

    sbatch reads ``#SBATCH`` lines from the top until the first line that is neither blank nor a comment;
    a directive after that is ignored by sbatch and reported here as an ExportValidationError.
    """
    options: list[str] = []
    in_header = True
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            if not in_header:
                raise ExportValidationError(f"line {number}: #SBATCH after the first command is ignored by sbatch: "
                                            "move it to the top of the script")
            try:
                options += shlex.split(stripped[len("#SBATCH"):], comments=True)
            except ValueError as exc:
                raise ExportValidationError(f"line {number}: cannot read the #SBATCH directive: {exc}") from None
        elif stripped and not stripped.startswith("#"):
            in_header = False
    return _directive_parser().parse_known_args(options)


def _count(label: str, value: str | None) -> int:
    """A SLURM count: ``N``, ``N-N`` (a fixed range) or ``type:N`` (gpus)."""
    if value is None:
        raise ExportValidationError(f"slurm.sbatch has no #SBATCH {label}: add it")
    text = value.rsplit(":", 1)[-1]
    lo, _, hi = text.partition("-")
    if not lo.isdigit() or (hi and hi != lo):
        raise ExportValidationError(f"#SBATCH {label}={value} is not a fixed count: state one number")
    return int(lo)


def validate_slurm_sbatch(text: str, plan: ExportPlan) -> None:
    """Check a slurm.sbatch text for ``plan``.

    1. ``bash -n`` (skipped with a RuntimeWarning when bash is missing).
    2. The ``#SBATCH`` directives as sbatch reads them (:func:`parse_sbatch_directives`): ``--nodes`` =
       the plan's nodes, ``--ntasks-per-node=1`` (torchrun starts the workers), GPUs per node
       (``--gpus-per-node`` or ``--gres=gpu:N``) = the plan's processes per node, ``--cpus-per-task`` at
       least one per process.
    3. An ``srun ... "${LAUNCH[@]}"`` line runs the LAUNCH array, which is read back with
       ``SLURM_NNODES`` = the ``--nodes`` directive and parsed by torch's own parser
       (``check_torchrun_argv``: nodes x processes = world size, c10d rendezvous, the launched program
       fits the engine, Megatron arguments through ``validate_megatron_args``).

    Raises ExportValidationError with one line naming the problem and the fix.
    """
    if not isinstance(text, str) or not text.strip():
        raise ExportValidationError("slurm.sbatch is empty: re-export the plan")
    check_bash_syntax(text, "slurm.sbatch")
    directives, _unknown = parse_sbatch_directives(text)
    nodes = _count("--nodes", directives.nodes)
    if nodes != plan.nodes:
        raise ExportValidationError(f"#SBATCH --nodes={directives.nodes} but the plan needs {plan.nodes} node(s): "
                                    f"set --nodes={plan.nodes}")
    if directives.ntasks_per_node != 1:
        raise ExportValidationError(f"#SBATCH --ntasks-per-node is {directives.ntasks_per_node} but torchrun starts "
                                    "the workers itself, one task per node: set --ntasks-per-node=1")
    if directives.gpus_per_node is not None:
        gpus = _count("--gpus-per-node", directives.gpus_per_node)
    elif directives.gres and "gpu" in directives.gres:
        gpus = _count("--gres", directives.gres)
    else:
        raise ExportValidationError("slurm.sbatch requests no GPUs per node: add #SBATCH "
                                    f"--gpus-per-node={plan.procs_per_node}")
    if gpus != plan.procs_per_node:
        raise ExportValidationError(f"slurm.sbatch requests {gpus} GPU(s) per node but the plan starts "
                                    f"{plan.procs_per_node} process(es) per node: set --gpus-per-node="
                                    f"{plan.procs_per_node}")
    cpus = directives.cpus_per_task
    if cpus is None or cpus < plan.procs_per_node:
        raise ExportValidationError(f"#SBATCH --cpus-per-task is {cpus}, fewer than the {plan.procs_per_node} "
                                    f"processes per node: set --cpus-per-task to at least {plan.procs_per_node}")
    if not any(_SRUN.match(line) for line in text.splitlines()):
        raise ExportValidationError('slurm.sbatch never runs the LAUNCH array with srun: end it with srun '
                                    '--ntasks-per-node=1 ... "${LAUNCH[@]}" "$@"')
    env = dict(RUNTIME_PLACEHOLDERS, SLURM_NNODES=str(nodes), SLURM_CPUS_PER_TASK=str(cpus))
    check_torchrun_argv(launch_argv(text, env=env), plan, what="slurm.sbatch")
