"""``launch.sh`` and ``hostfile``: starting a plan with torchrun or DeepSpeed's launcher (pure functions
ExportPlan -> bash text); their validator is :mod:`optplan.planner.export.launch_check`.

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
:data:`RUNTIME_PLACEHOLDERS`). :func:`optplan.planner.export.launch_check.launch_argv` recovers the vector
without running anything and :func:`optplan.planner.export.launch_check.validate_launch_sh` feeds it to the
launcher's own parser.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from optplan.estimators.errors import OptplanError
from optplan.planner.export.context import (
    ASYNC_TP_HOWTO,
    SELECTIVE_CHECKPOINTING_HOWTO,
    ExportPlan,
    NotExportable,
)
from optplan.planner.export.megatron import (
    PRETRAIN_SCRIPT,
    megatron_args,
    megatron_env,
    megatron_notes,
)

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
                "DDP or one GPU: model.to(torch.bfloat16) and fp32 master copies that the optimizer steps, copied back "
                "into the bf16 parameters after each step, as train.py's MasterWeights does; not autocast, which "
                "holds other activations than the plan priced).",
        "fp16": "precision fp16: MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32) with "
                "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler (DDP or one GPU: model.to(torch.float16) "
                "with fp32 master copies and a dynamic loss scale, as train.py's MasterWeights does).",
        "amp-bf16": "precision amp-bf16: fp32 model, forward under torch.autocast('cuda', dtype=torch.bfloat16); "
                    "no FSDP MixedPrecision.",
        "amp-fp16": "precision amp-fp16: fp32 model, forward under torch.autocast('cuda', dtype=torch.float16) "
                    "with a GradScaler (ShardedGradScaler under FSDP).",
        "bf16-pure": "precision bf16-pure: model.to(torch.bfloat16) before wrapping; parameters, gradients and "
                     "optimizer states stay bf16 (no fp32 master copy).",
        "fp8": "precision fp8: bf16 mixed precision as above plus fp8 linear layers (Transformer Engine "
               "te.fp8_autocast, or torchao.float8.convert_to_float8_training) before wrapping.",
    }[s.precision]
    if s.fsdp != "none" and s.fsdp_reduce_dtype != "auto":
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[s.fsdp_reduce_dtype]
        precision = precision.replace("reduce_dtype=torch.float32", f"reduce_dtype=torch.{dtype}")
        precision += (f" FSDP gradient reduction in {s.fsdp_reduce_dtype}: reduce_dtype=torch.{dtype} in FSDP's "
                      "MixedPrecision(Policy), as the plan's communication and memory count it.")
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
    if s.async_tp:
        notes.append(ASYNC_TP_HOWTO)
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
    missing: tuple[str, str] | None = None  # (why optplan wrote no script for the plan, what TRAIN_SCRIPT must be)
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
        from optplan.planner.export.finetune import hf_model_folder  # light: no transformers import

        if hf_model_folder(plan.model_path) is None:  # a LoRA plan of a model file: finetune.py needs a HF model
            missing = ("this LoRA plan is of a model file, so optplan wrote no finetune.py (it loads a Hugging Face "
                       "model: plan with --hf for one) and train.py trains every parameter",
                       "your training script, which adds the plan's adapters (plan.json export.adapter: rank, alpha, "
                       "targets; peft's LoraConfig)")
    else:
        notes = _torch_notes(plan)
    checks: tuple[str, ...] = (  # the train.py exported beside this script, when the working folder has none
        'if [[ ! -e "$TRAIN_SCRIPT" && -e "$SCRIPT_DIR/$TRAIN_SCRIPT" ]]; then',
        '  TRAIN_SCRIPT="$SCRIPT_DIR/$TRAIN_SCRIPT"',
        "fi",
    )
    if not plan.model_path and train_script == "train.py":
        # a plan of a shape (--arch/--params): no train.py was exported (it builds the model from a model file)
        missing = ("this plan was made from --arch/--params, so optplan wrote no train.py",
                   "your training script, which builds this shape (or plan with a model file to get a train.py)")
    if missing is not None:  # the launch stops unless TRAIN_SCRIPT names a script that exists
        why, script = missing
        notes.append(f"{why}: set TRAIN_SCRIPT to {script}, and it applies the settings here.")
        checks += (
            'if [[ ! -e "$TRAIN_SCRIPT" ]]; then',
            f'  echo "no $TRAIN_SCRIPT: {why}: set TRAIN_SCRIPT to your training script" >&2',
            "  exit 2",
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


__all__ = [
    "DEFAULT_MASTER_PORT",
    "bash_comment",
    "LAUNCHERS",
    "RUNTIME_PLACEHOLDERS",
    "LaunchedCommand",
    "Launcher",
    "default_rdzv_id",
    "header_comments",
    "launch_block",
    "launched_command",
    "render_hostfile",
    "render_launch_sh",
]
