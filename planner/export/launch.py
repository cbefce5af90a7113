"""``launch.sh`` and ``hostfile``: starting a plan with torchrun or DeepSpeed's launcher (pure functions
ExportPlan -> bash text), and their validator.

What runs on every rank depends on the plan's engine (:func:`launched_command`, shared with the SLURM
export): DeepSpeed plans start ``"$TRAIN_SCRIPT" --deepspeed "$DS_CONFIG"`` (the flag the Hugging Face
Trainer reads; a plain DeepSpeed script passes it to ``deepspeed.initialize(config=...)``), torch plans
(DDP/FSDP) start ``"$TRAIN_SCRIPT"`` with comments stating the FSDP settings the script must apply, and
Megatron plans start ``"$MEGATRON_LM/pretrain_gpt.py"`` with :func:`megatron_args`. Extra arguments to
the script go through to the program (``"$@"``); ``TRAIN_SCRIPT``, ``DS_CONFIG``, ``MEGATRON_LM``,
``MASTER_PORT``, ``RDZV_ID`` and ``HOSTFILE`` in the environment override the defaults. Every value that
comes from the caller is quoted with ``shlex.quote``.

Launchers (flags as defined by ``torch.distributed.run.get_args_parser`` and
``deepspeed.launcher.runner.parse_args``):

- ``torchrun`` on one node: ``--standalone --nnodes 1 --nproc-per-node N`` (a local c10d rendezvous on a
  free port). On several nodes: ``--nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint
  "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"``: the same script runs on every node, the c10d
  rendezvous assigns node ranks, and ``MASTER_ADDR`` (required) names the first node.
- ``deepspeed`` (DeepSpeed plans only; it appends ``--local_rank=N`` to the script's arguments): on one
  node ``deepspeed --num_nodes 1 --num_gpus N``; on several ``deepspeed --hostfile "$HOSTFILE" --num_nodes
  N --num_gpus G --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"``, run once on the first node
  (it reaches the others over ssh with pdsh). ``MASTER_ADDR`` defaults to the first host of the hostfile.

Machine-readable launcher line: the launcher's argument vector is the bash array ``LAUNCH=( ... )``, one
or more words per line between a line ``LAUNCH=(`` and a line ``)``, then ``exec "${LAUNCH[@]}" "$@"``.
Its words are literals (``shlex.quote``) and double-quoted references to variables that are assigned
earlier as ``NAME=WORD`` or ``NAME="${NAME:-WORD}"`` (an environment override with a default), or that
are only known at run time (``SCRIPT_DIR``, ``MASTER_ADDR``, SLURM's variables: see
:data:`RUNTIME_PLACEHOLDERS`). :func:`launch_argv` recovers the vector without running anything and
:func:`validate_launch_sh` feeds it to the launcher's own parser.
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
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from optplan.estimators.errors import OptplanError
from optplan.planner.export.context import SELECTIVE_CHECKPOINTING_HOWTO, ExportPlan, NotExportable
from optplan.planner.export.megatron import (
    PRETRAIN_SCRIPT,
    megatron_args,
    megatron_env,
    megatron_notes,
    validate_megatron_args,
)
from optplan.planner.validate import ExportValidationError

Launcher = Literal["torchrun", "deepspeed"]
LAUNCHERS: tuple[str, ...] = ("torchrun", "deepspeed")
DEFAULT_MASTER_PORT = 29500
DEFAULT_MEGATRON_LM = "Megatron-LM"
"""Default Megatron-LM checkout (relative to the folder the script is run from); MEGATRON_LM overrides it."""

RUNTIME_PLACEHOLDERS: Mapping[str, str] = MappingProxyType({
    "SCRIPT_DIR": "/path/to/export",
    "MASTER_ADDR": "node0",
    "SLURM_JOB_ID": "1",
    "head": "node0",
})
"""Values the validators give variables that are known only when the script runs (the export folder,
the first node's address, SLURM's job id and head node); the launchers' parsers do not look at them
beyond their syntax. Every other variable is taken from its default in the script."""

_HOST = re.compile(r"[A-Za-z0-9_.:@\[\]-]+")


def bash_comment(text: str) -> str:
    """One bash comment line (newlines and control characters flattened)."""
    flat = "".join(ch if ch.isprintable() else " " for ch in text)
    return f"# {flat}".rstrip()


def _check_text_arg(label: str, value: object, *, plain_name: bool = False) -> str:
    """A caller-supplied name: non-empty, no control characters; ``plain_name``: no folders either."""
    if not isinstance(value, str) or not value.strip():
        raise OptplanError(f"{label} must be a non-empty string (got {value!r}): pass a file name")
    if any(not ch.isprintable() for ch in value):
        raise OptplanError(f"{label} {value!r} contains control characters: pass a plain file name")
    if plain_name and ("/" in value or value in (".", "..")):
        raise OptplanError(f"{label} {value!r} must be a plain file name (it lies next to the script): drop "
                           "the folder")
    return value


def _check_launcher(launcher: object) -> str:
    if launcher not in LAUNCHERS:
        raise OptplanError(f"unknown launcher {launcher!r}: use one of {', '.join(LAUNCHERS)}")
    return str(launcher)


def default_rdzv_id(plan: ExportPlan) -> str:
    """The rendezvous id launch.sh uses unless RDZV_ID is set: ``optplan-<model>`` (shell-safe)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", plan.model).strip("-.")[:48]
    return f"optplan-{stem or 'run'}"


# --------------------------------------------------------------------------------------------------
# What runs on every rank (shared with slurm.py)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchedCommand:
    """The program each rank runs, as pieces of bash that launch.sh and slurm.sbatch assemble.

    ``assignments`` define the variables ``words`` use (they may refer to ``$SCRIPT_DIR``, which the
    enclosing script defines); ``checks`` run before launching; ``exports`` set the environment the
    program needs; ``words`` are LAUNCH array lines (program first); ``notes`` are plain-text lines for
    the header comments; ``overrides`` documents the environment variables and their defaults.
    """

    assignments: tuple[str, ...]
    checks: tuple[str, ...]
    exports: tuple[str, ...]
    words: tuple[str, ...]
    notes: tuple[str, ...]
    overrides: tuple[str, ...]


def _override(name: str, default_word: str) -> tuple[str, ...]:
    """``DEFAULT_NAME=<word>`` then ``NAME="${NAME:-$DEFAULT_NAME}"`` (the environment wins)."""
    return (f"DEFAULT_{name}={default_word}", f'{name}="${{{name}:-$DEFAULT_{name}}}"')


_FSDP_SHARDING: Mapping[str, tuple[str, str]] = MappingProxyType({
    "full": ("FULL_SHARD", "fully_shard(module, reshard_after_forward=True)"),
    "grad_op": ("SHARD_GRAD_OP", "fully_shard(module, reshard_after_forward=False)"),
    "hybrid": ("HYBRID_SHARD", "fully_shard(module, mesh=init_device_mesh('cuda', (nodes, gpus_per_node), "
                               "mesh_dim_names=('replicate', 'shard')))"),
})


def _torch_notes(plan: ExportPlan) -> list[str]:
    """The settings a torch (DDP/FSDP) training script must apply for this plan."""
    s = plan.strategy
    block = plan.block_class or "the repeated transformer block"
    notes = ["torch engine: the training script sets up the parallelism itself; this script only starts it "
             "(or use `accelerate launch --config_file accelerate.yaml` when that file was exported). The train.py "
             "optplan exports (--to train) applies every setting below; a script of your own must do the same."]
    if s.fsdp == "none":
        notes.append("DDP: DistributedDataParallel(model.cuda(local_rank), device_ids=[local_rank]); use "
                     "model.no_sync() on the accumulation steps that do not step the optimizer.")
    else:
        fsdp1, fsdp2 = _FSDP_SHARDING[s.fsdp]
        notes.append(f"FSDP: sharding_strategy=ShardingStrategy.{fsdp1}, auto_wrap_policy="
                     f"functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={{{block}}}), "
                     "use_orig_params=True, device_id=local_rank; FSDP2 equivalent: "
                     f"{fsdp2} on each {block}, then on the root module.")
        if s.fsdp_grad_sync == "step" and s.grad_accum > 1:
            notes.append("FSDP gradient sync once per step: model.no_sync() (FSDP2: model.set_requires_gradient_"
                         "sync(False)) on the accumulation steps that do not step the optimizer; the unsharded "
                         "gradients accumulate until the last micro-batch, as the plan's memory holds them.")
        if s.offload_params == "cpu":
            notes.append("FSDP CPU offload: cpu_offload=CPUOffload(offload_params=True) (FSDP2: "
                         "offload_policy=CPUOffloadPolicy()); the optimizer then steps on the CPU.")
    precision = {
        "fp32": "precision fp32: no mixed precision.",
        "bf16": "precision bf16: keep fp32 parameters (the sharded master copy) and set mixed_precision="
                "MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) (FSDP2: "
                "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32); "
                "DDP: torch.autocast('cuda', torch.bfloat16)).",
        "fp16": "precision fp16: MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32) with "
                "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler (DDP: torch.amp.GradScaler).",
        "amp-bf16": "precision amp-bf16: fp32 model, forward under torch.autocast('cuda', dtype=torch.bfloat16); "
                    "no FSDP MixedPrecision.",
        "amp-fp16": "precision amp-fp16: fp32 model, forward under torch.autocast('cuda', dtype=torch.float16) "
                    "with a GradScaler (ShardedGradScaler under FSDP).",
        "bf16-pure": "precision bf16-pure: model.to(torch.bfloat16) before wrapping; parameters, gradients and "
                     "optimizer states stay bf16 (no fp32 master copy).",
        "fp8": "precision fp8: bf16 mixed precision as above plus fp8 linear layers (Transformer Engine "
               "te.fp8_autocast, or torchao.float8.convert_to_float8_training) before wrapping.",
    }[s.precision]
    notes.append(precision)
    if s.checkpointing == "full":
        notes.append(f"activation checkpointing: apply_activation_checkpointing(model, checkpoint_wrapper_fn="
                     f"checkpoint_wrapper, check_fn=lambda m: isinstance(m, {block})) after wrapping.")
    elif s.checkpointing == "selective":
        notes.append(f"{SELECTIVE_CHECKPOINTING_HOWTO}.")
    optimizer = {
        "adamw": "torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)",
        "adamw8bit": "bitsandbytes.optim.AdamW8bit(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)",
        "adafactor": "torch.optim.Adafactor(params, lr=1e-2)",
        "sgd": "torch.optim.SGD(params, lr=3e-4, momentum=0.9)",
        "paged_adamw": "bitsandbytes.optim.PagedAdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)",
        "paged_adamw8bit": "bitsandbytes.optim.PagedAdamW8bit(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, "
                           "weight_decay=0.1)",
    }[s.optimizer]
    notes.append(f"optimizer: {optimizer}, built after wrapping; micro-batch {s.mbs} per rank, step every "
                 f"{s.grad_accum} micro-batch(es).")
    if s.model_parallel:
        notes.append(f"tp {s.tp} / pp {s.pp} / cp {s.cp}: build a DeviceMesh with these dimensions and apply "
                     "torch.distributed.tensor.parallel, torch.distributed.pipelining and context_parallel to it.")
    return notes


DEEPSPEED_ARCH_LIST_FIX = (
    "# DeepSpeed's JIT op builder reads TORCH_CUDA_ARCH_LIST as X.Y[+PTX]; an arch-specific entry such as 9.0a",
    "# (set by some CUDA images) stops it: \"invalid literal for int() with base 10: '0a'\" (deepspeedai/DeepSpeed#7589)",
    'if [[ -n "${TORCH_CUDA_ARCH_LIST:-}" ]]; then',
    '  TORCH_CUDA_ARCH_LIST="$(printf \'%s\' "$TORCH_CUDA_ARCH_LIST" | sed -E \'s/([0-9]+[.][0-9]+)[A-Za-z]+/\\1/g\')"',
    "  export TORCH_CUDA_ARCH_LIST",
    "fi",
)
"""launch.sh lines for DeepSpeed plans: the arch list without suffixes (the exported train.py does the same)."""


def launched_command(plan: ExportPlan, *, train_script: str = "train.py",
                     ds_config_name: str = "ds_config.json") -> LaunchedCommand:
    """What every rank runs for ``plan``'s engine (see the module docstring); shared by launch.sh and
    slurm.sbatch. ``train_script`` is not used for megatron plans (they run ``pretrain_gpt.py`` from the
    ``MEGATRON_LM`` checkout). Raises NotExportable when megatron_args refuses the plan."""
    s = plan.strategy
    if s.engine == "megatron":
        argv = megatron_args(plan)
        words = ['"$MEGATRON_LM"/' + PRETRAIN_SCRIPT]
        i = 0
        while i < len(argv):  # a flag and its value on one line
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                words.append(f"{shlex.quote(argv[i])} {shlex.quote(argv[i + 1])}")
                i += 2
            else:
                words.append(shlex.quote(argv[i]))
                i += 1
        env = megatron_env(plan)
        exports = tuple(f"export {name}={shlex.quote(value)}" for name, value in env.items())
        notes = [f"Megatron-LM: runs pretrain_gpt.py from the Megatron-LM checkout in $MEGATRON_LM (default "
                 f"./{DEFAULT_MEGATRON_LM}); the arguments below come from the plan."]
        if env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            notes.append("CUDA_DEVICE_MAX_CONNECTIONS=1 is exported: Megatron-LM asserts it with tensor or "
                         "context parallelism on GPUs before Blackwell.")
        elif env:
            notes.append("CUDA_DEVICE_MAX_CONNECTIONS=32 is exported: the expert-parallel all-to-all overlap runs "
                         "concurrent streams (Megatron-LM's MoE guide asks for more than 1; with tensor or context "
                         "parallelism it warns instead of asserting 1).")
        notes += megatron_notes(plan)
        checks = (
            'if [[ ! -f "$MEGATRON_LM/' + PRETRAIN_SCRIPT + '" ]]; then',
            '  echo "no ' + PRETRAIN_SCRIPT + ' in $MEGATRON_LM: set MEGATRON_LM to a Megatron-LM checkout" >&2',
            "  exit 2",
            "fi",
        )
        return LaunchedCommand(
            assignments=_override("MEGATRON_LM", shlex.quote(DEFAULT_MEGATRON_LM)), checks=checks,
            exports=exports, words=tuple(words), notes=tuple(notes),
            overrides=(f"MEGATRON_LM (default ./{DEFAULT_MEGATRON_LM})",),
        )

    train_script = _check_text_arg("training script", train_script)
    assignments = list(_override("TRAIN_SCRIPT", shlex.quote(train_script)))
    overrides = [f"TRAIN_SCRIPT (default {train_script})"]
    words = ['"$TRAIN_SCRIPT"']
    if s.engine == "deepspeed":
        ds_config_name = _check_text_arg("DeepSpeed config name", ds_config_name, plain_name=True)
        assignments += _override("DS_CONFIG", '"$SCRIPT_DIR"/' + shlex.quote(ds_config_name))
        overrides.append(f"DS_CONFIG (default $SCRIPT_DIR/{ds_config_name})")
        words.append('--deepspeed "$DS_CONFIG"')
        from optplan.planner.export.deepspeed import deepspeed_notes  # light: no deepspeed import

        notes = [f"DeepSpeed: the training script must accept --deepspeed PATH (Hugging Face Trainer convention, "
                 f"or deepspeed.initialize(config=args.deepspeed); the train.py optplan exports does); ZeRO stage {s.zero}, offload optimizer "
                 f"{s.offload_optimizer} / params {s.offload_params}."]
        notes += deepspeed_notes(s)
        if s.model_parallel:
            notes.append(f"tp {s.tp} / pp {s.pp} / cp {s.cp} on the deepspeed engine: the training script builds "
                         "the model-parallel groups itself (Megatron-DeepSpeed); ds_config.json covers ZeRO only.")
    elif train_script == "finetune.py":
        notes = ["finetune.py (--to finetune) applies every setting of the plan from finetune.json beside it; the "
                 "arguments given to this script go to it: --dataset DATA (and --dry-run to check the fit first)."]
    else:
        notes = _torch_notes(plan)
    checks: tuple[str, ...] = (  # the train.py exported beside this script, when the working folder has none
        'if [[ ! -e "$TRAIN_SCRIPT" && -e "$SCRIPT_DIR/$TRAIN_SCRIPT" ]]; then',
        '  TRAIN_SCRIPT="$SCRIPT_DIR/$TRAIN_SCRIPT"',
        "fi",
    )
    if s.engine == "deepspeed":
        checks += DEEPSPEED_ARCH_LIST_FIX
    return LaunchedCommand(assignments=tuple(assignments), checks=checks, exports=(), words=tuple(words),
                           notes=tuple(notes), overrides=tuple(overrides))


def header_comments(plan: ExportPlan, title: str, launcher_line: str) -> list[str]:
    """The comment lines at the top of launch.sh/slurm.sbatch: plan label, batch arithmetic, layout."""
    s = plan.strategy
    return [
        bash_comment(f"{title} generated by optplan for {plan.model} on {plan.gpu}: {launcher_line}"),
        bash_comment(f"Plan: {s.label()}"),
        bash_comment(f"GPUs: {plan.nodes} node(s) x {plan.procs_per_node} process(es) = {plan.world_size} = "
                 f"dp {s.dp} x tp {s.tp} x pp {s.pp} x cp {s.cp}" + (f" (vpp {s.vpp})" if s.vpp > 1 else "")),
        bash_comment(f"Global batch {s.global_batch} samples = micro-batch {s.mbs} x accumulation {s.grad_accum} x "
                 f"dp {s.dp}"),
        bash_comment(f"Precision {s.precision}, optimizer {s.optimizer}, activation checkpointing {s.checkpointing}, "
                 f"engine {s.engine}"),
    ]


def launch_block(launcher_words: Sequence[str], command: LaunchedCommand, *, run: str) -> list[str]:
    """The ``LAUNCH=( ... )`` array (launcher words, then the program) and the line that runs it."""
    lines = ["LAUNCH=("]
    lines += [f"  {w}" for w in launcher_words]
    lines += [f"  {w}" for w in command.words]
    lines += [")", f'{run}"${{LAUNCH[@]}}" "$@"']
    return lines


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------


def render_launch_sh(plan: ExportPlan, *, launcher: Launcher = "torchrun", train_script: str = "train.py",
                     ds_config_name: str = "ds_config.json") -> str:
    """The launch.sh text for ``plan`` (see the module docstring for the layout).

    ``ds_config_name`` is a file next to launch.sh; ``train_script`` is relative to the folder the script
    is run from. Raises NotExportable for the deepspeed launcher with a non-DeepSpeed plan (it appends
    ``--local_rank`` to the script's arguments, which Megatron's and torch scripts reject) and when
    :func:`megatron_args` refuses a megatron plan; OptplanError for an unknown launcher or a bad name.
    """
    launcher = _check_launcher(launcher)  # type: ignore[assignment]
    s = plan.strategy
    if launcher == "deepspeed" and s.engine != "deepspeed":
        raise NotExportable(f"DeepSpeed's launcher is for deepspeed-engine plans and this plan runs on the "
                            f"{s.engine} engine: use launcher torchrun")
    command = launched_command(plan, train_script=train_script, ds_config_name=ds_config_name)
    nodes, procs = plan.nodes, plan.procs_per_node

    vars_: list[str] = ['SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"', *command.assignments]
    overrides = list(command.overrides)
    if launcher == "torchrun":
        if nodes == 1:
            summary = f"torchrun, 1 node x {procs} GPU(s)"
            run_lines = [bash_comment("Run: bash launch.sh [training-script arguments...]")]
            words = ["torchrun", "--standalone", "--nnodes 1", f"--nproc-per-node {procs}"]
        else:
            summary = f"torchrun, {nodes} nodes x {procs} GPUs"
            run_lines = [
                bash_comment(f"Run: the same command on each of the {nodes} nodes, e.g. "
                         "MASTER_ADDR=<first node> bash launch.sh [training-script arguments...];"),
                bash_comment("  torchrun's c10d rendezvous on MASTER_ADDR:MASTER_PORT assigns the node ranks."),
            ]
            vars_ += [f'MASTER_PORT="${{MASTER_PORT:-{DEFAULT_MASTER_PORT}}}"',
                      f'RDZV_ID="${{RDZV_ID:-{default_rdzv_id(plan)}}}"']
            overrides += ["MASTER_ADDR (required: the first node's address)",
                          f"MASTER_PORT (default {DEFAULT_MASTER_PORT})", f"RDZV_ID (default {default_rdzv_id(plan)})"]
            words = ["torchrun", f"--nnodes {nodes}", f"--nproc-per-node {procs}", "--rdzv-backend c10d",
                     '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"', '--rdzv-id "$RDZV_ID"']
    else:
        if nodes == 1:
            summary = f"DeepSpeed launcher, 1 node x {procs} GPU(s)"
            run_lines = [bash_comment("Run: bash launch.sh [training-script arguments...]")]
            vars_.append(f'MASTER_PORT="${{MASTER_PORT:-{DEFAULT_MASTER_PORT}}}"')
            overrides.append(f"MASTER_PORT (default {DEFAULT_MASTER_PORT})")
            words = ["deepspeed", "--num_nodes 1", f"--num_gpus {procs}", '--master_port "$MASTER_PORT"']
        else:
            summary = f"DeepSpeed launcher, {nodes} nodes x {procs} GPUs"
            run_lines = [
                bash_comment("Run: once, on the first node: bash launch.sh [training-script arguments...]; DeepSpeed "
                         "starts the other nodes over ssh"),
                bash_comment("  (pdsh and passwordless ssh to every host in the hostfile; replace its placeholder "
                         "host names first); the files must lie at the same paths on every node."),
            ]
            vars_ += [*_override("HOSTFILE", '"$SCRIPT_DIR"/hostfile'),
                      'if [[ ! -f "$HOSTFILE" ]]; then',
                      '  echo "launch.sh: no hostfile at $HOSTFILE: write one (host slots=N per node) or set HOSTFILE" >&2',
                      "  exit 2",
                      "fi",
                      'MASTER_ADDR="${MASTER_ADDR:-$(awk \'NF && $1 !~ /^#/ {print $1; exit}\' "$HOSTFILE")}"',
                      f'MASTER_PORT="${{MASTER_PORT:-{DEFAULT_MASTER_PORT}}}"']
            overrides += ["HOSTFILE (default $SCRIPT_DIR/hostfile)",
                          "MASTER_ADDR (default the hostfile's first host)", f"MASTER_PORT (default {DEFAULT_MASTER_PORT})"]
            words = ["deepspeed", '--hostfile "$HOSTFILE"', f"--num_nodes {nodes}", f"--num_gpus {procs}",
                     '--master_addr "$MASTER_ADDR"', '--master_port "$MASTER_PORT"']

    lines = ["#!/usr/bin/env bash", *header_comments(plan, "launch.sh", summary), *run_lines,
             bash_comment("Environment overrides: " + "; ".join(overrides) + "."),
             bash_comment("SCRIPT_DIR is the folder holding this script.")]
    if launcher == "deepspeed":
        lines.append(bash_comment("DeepSpeed's launcher adds --local_rank=N to the training script's arguments "
                                  "(and sets LOCAL_RANK): the script must accept it."))
    lines += [bash_comment(f"NOTE: {note}") for note in command.notes]
    lines += ["set -euo pipefail", "", *vars_]
    if launcher == "torchrun" and nodes > 1:
        lines += [
            'if [[ -z "${MASTER_ADDR:-}" ]]; then',
            '  echo "launch.sh: set MASTER_ADDR to the first node\'s address (the same on every node)" >&2',
            "  exit 2",
            "fi",
        ]
    lines += [*command.checks, *command.exports, ""]
    lines += launch_block(words, command, run="exec ")
    return "\n".join(lines) + "\n"


def render_hostfile(plan: ExportPlan, *, hosts: Sequence[str] | None = None) -> str:
    """DeepSpeed's hostfile for ``plan``: one ``host slots=N`` line per node (``N`` = processes per node).

    Without ``hosts`` the names are placeholders ``node0`` .. ``node{nodes-1}``: replace them with the
    nodes' ssh host names. ``hosts`` must name exactly ``plan.nodes`` distinct hosts (OptplanError
    otherwise). The format is the one ``deepspeed.launcher.runner._parse_hostfile`` reads (``#`` lines
    are comments).
    """
    if hosts is None:
        names = [f"node{i}" for i in range(plan.nodes)]
        placeholder = True
    else:
        if isinstance(hosts, str):
            raise OptplanError("hosts must be a list of host names, not one string: pass ['host1', 'host2', ...]")
        names = list(hosts)
        placeholder = False
        for host in names:
            if not isinstance(host, str) or not _HOST.fullmatch(host):
                raise OptplanError(f"host name {host!r} is not a plain host name (letters, digits, . _ - :): "
                                   "fix the host list")
        if len(set(names)) != len(names):
            raise OptplanError("the host list names a host twice (DeepSpeed refuses duplicate hostfile entries): "
                               "list each node once")
        if len(names) != plan.nodes:
            raise OptplanError(f"the plan needs {plan.nodes} node(s) but {len(names)} host(s) were given: pass "
                               f"{plan.nodes} host names")
    lines = [bash_comment(f"DeepSpeed hostfile generated by optplan for {plan.model}: {plan.strategy.label()}"),
             bash_comment(f"{plan.nodes} node(s) x {plan.procs_per_node} slot(s) (GPUs) = {plan.world_size} ranks")]
    if placeholder:
        lines.append(bash_comment("node0.. are placeholders: replace them with the nodes' ssh host names"))
    lines += [f"{host} slots={plan.procs_per_node}" for host in names]
    return "\n".join(lines) + "\n"


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
    "DEFAULT_MASTER_PORT",
    "bash_comment",
    "LAUNCHERS",
    "RUNTIME_PLACEHOLDERS",
    "LaunchedCommand",
    "Launcher",
    "check_bash_syntax",
    "check_launched_program",
    "check_torchrun_argv",
    "default_rdzv_id",
    "header_comments",
    "launch_argv",
    "launch_block",
    "launched_command",
    "render_hostfile",
    "render_launch_sh",
    "validate_launch_sh",
]
