"""The export targets: ``name -> builder`` (each renders its files and checks them with the target's own loader).

``optplan export plan.json --to deepspeed|accelerate|torchrun|slurm|hf|lightning|train|finetune|all`` and
``optplan recommend --out DIR`` both go through ``render_targets``. A target that cannot express a plan
(ds_config.json for a Megatron plan, say) raises an OptplanError naming the target that can; under
``all`` it is skipped and the reason is returned, under an explicit ``--to`` it is the error.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.errors import OptplanError
from optplan.planner.export.context import FILE_NAMES, ExportPlan, NotExportable

Launcher = Literal["torchrun", "deepspeed"]
Builder = Callable[[ExportPlan, "ExportOptions"], dict[str, str]]


class ExportOptions(BaseModel):
    """Per-export choices: the launcher of launch.sh, the FSDP config version, the training script."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    launcher: Launcher = "torchrun"
    fsdp_version: Literal[1, 2] = 2
    train_script: str = Field(default="train.py", min_length=1)


def _ds_config(plan: ExportPlan) -> dict[str, Any]:
    from optplan.planner.export.deepspeed import render_ds_config
    return render_ds_config(plan.strategy, plan.buckets)


def _deepspeed(plan: ExportPlan, opts: ExportOptions) -> dict[str, str]:
    from optplan.planner.validate import validate_ds_config
    config = _ds_config(plan)
    validate_ds_config(config, world_size=plan.world_size)
    return {FILE_NAMES["deepspeed"]: json.dumps(config, indent=2) + "\n"}


def _accelerate(plan: ExportPlan, opts: ExportOptions) -> dict[str, str]:
    from optplan.planner.export.accelerate import render_accelerate_yaml
    from optplan.planner.export.accelerate_check import validate_accelerate_yaml
    text = render_accelerate_yaml(plan, fsdp_version=opts.fsdp_version, train_script=opts.train_script)
    validate_accelerate_yaml(text, plan)
    return {FILE_NAMES["accelerate"]: text}


def _torchrun(plan: ExportPlan, opts: ExportOptions) -> dict[str, str]:
    from optplan.planner.export.launch import render_hostfile, render_launch_sh
    from optplan.planner.export.launch_check import validate_launch_sh
    text = render_launch_sh(plan, launcher=opts.launcher, train_script=opts.train_script)
    validate_launch_sh(text, plan)
    files = {FILE_NAMES["torchrun"]: text}
    if opts.launcher == "deepspeed" and plan.multi_node:
        files[FILE_NAMES["hostfile"]] = render_hostfile(plan)
    return files


def _slurm(plan: ExportPlan, opts: ExportOptions) -> dict[str, str]:
    from optplan.planner.export.slurm import render_slurm_sbatch, validate_slurm_sbatch
    text = render_slurm_sbatch(plan, train_script=opts.train_script)
    validate_slurm_sbatch(text, plan)
    return {FILE_NAMES["slurm"]: text}


def _hf(plan: ExportPlan, opts: ExportOptions) -> dict[str, str]:
    from optplan.planner.export.hf import render_hf_training_args
    from optplan.planner.export.hf_check import validate_hf_training_args
    text = render_hf_training_args(plan)
    ds = _ds_config(plan) if plan.strategy.engine == "deepspeed" else None
    validate_hf_training_args(text, plan, ds_config=ds)
    return {FILE_NAMES["hf"]: text}


def _lightning(plan: ExportPlan, opts: ExportOptions) -> dict[str, str]:
    from optplan.planner.export.lightning import render_lightning_json
    from optplan.planner.export.lightning_check import validate_lightning_json
    text = render_lightning_json(plan)
    validate_lightning_json(text, plan)
    return {FILE_NAMES["lightning"]: text}


def _train(plan: ExportPlan, opts: ExportOptions) -> dict[str, str]:
    from optplan.planner.export.train_script import render_train_py, validate_train_py
    text = render_train_py(plan)
    validate_train_py(text, plan)
    return {FILE_NAMES["train"]: text}


def _finetune(plan: ExportPlan, opts: ExportOptions) -> dict[str, str]:
    from optplan.planner.export.finetune import render_finetune_json, render_finetune_py, validate_finetune
    config, script = render_finetune_json(plan), render_finetune_py(plan)
    validate_finetune(config, script, plan)
    files = {FILE_NAMES["finetune"]: config, FILE_NAMES["finetune_script"]: script}
    if plan.strategy.engine == "deepspeed":  # finetune.json's sft.deepspeed names it
        files.update(_deepspeed(plan, opts))
    return files


def _launches_finetune_py(builder: Builder) -> Builder:
    """``builder`` (launch.sh, slurm.sbatch), starting finetune.py for LoRA plans: train.py trains every parameter."""
    def build(plan: ExportPlan, opts: ExportOptions) -> dict[str, str]:
        if plan.adapter is not None and opts.train_script == ExportOptions().train_script:
            opts = opts.model_copy(update={"train_script": FILE_NAMES["finetune_script"]})
        return builder(plan, opts)
    return build


def _full_training_only(builder: Builder, name: str) -> Builder:
    """``builder``, refusing LoRA plans: its script or config trains every parameter of the model as built."""
    def build(plan: ExportPlan, opts: ExportOptions) -> dict[str, str]:
        if plan.adapter is not None:
            from optplan.planner.export.finetune import hf_model_folder  # light: no transformers import

            if hf_model_folder(plan.model_path) is None:  # finetune.py loads a Hugging Face model
                raise NotExportable(f"the {name} export trains every parameter, and this is a LoRA plan of a model "
                                    "file, which finetune.py cannot load: add the plan's adapters (plan.json "
                                    "export.adapter) with peft in your training script, or plan with --hf")
            raise NotExportable(f"the {name} export trains every parameter, and this is a LoRA plan: use finetune.py "
                                "(--to finetune)")
        return builder(plan, opts)
    return build


TARGETS: dict[str, Builder] = {
    "deepspeed": _full_training_only(_deepspeed, "ds_config.json"),
    "accelerate": _full_training_only(_accelerate, "accelerate.yaml"),
    "torchrun": _launches_finetune_py(_torchrun),
    "slurm": _launches_finetune_py(_slurm),
    "hf": _full_training_only(_hf, "hf_training_args.json"),
    "lightning": _full_training_only(_lightning, "lightning.json"),
    "train": _full_training_only(_train, "train.py"),
    "finetune": _finetune,
}
"""Every export target by its ``--to`` name."""


def targets_for(names: Sequence[str]) -> tuple[str, ...]:
    """Expand ``all`` and check the names (one line naming the choices on a bad one)."""
    out: list[str] = []
    for name in names:
        if name == "all":
            out += list(TARGETS)
        elif name in TARGETS:
            out.append(name)
        else:
            raise OptplanError(f"unknown export target {name!r}: use one of {', '.join(TARGETS)} or all")
    return tuple(dict.fromkeys(out))


@contextlib.contextmanager
def _private_torch_cache() -> Iterator[None]:
    """Validators import transformers/lightning, and their import of ``torch._dynamo`` creates torch's compile
    cache folder (``$TMPDIR/torchinductor_$USER``). Nothing is compiled while validating, so unless the user
    chose a folder (``TORCHINDUCTOR_CACHE_DIR``) it is a private temporary one, removed afterwards: exporting
    writes nothing outside the output folder."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        yield
        return
    folder = tempfile.mkdtemp(prefix="optplan-export-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    try:
        yield
    finally:
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") == folder:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        shutil.rmtree(folder, ignore_errors=True)


def _schedule_exportable(plan: ExportPlan) -> None:
    """DualPipe plans are priced, not exported: no trainer optplan writes for runs DeepSeek's schedule."""
    if plan.strategy.dualpipe:
        raise NotExportable("DualPipe (--pp-schedule dualpipe) is DeepSeek's schedule, which none of the trainers "
                            "optplan exports for runs (Megatron-LM, DeepSpeed, torch): the plan is priced, not "
                            "exported; plan with --pp-schedule 1f1b for a launch config")


def render_targets(plan: ExportPlan, names: Sequence[str], *, options: ExportOptions | None = None,
                   ) -> tuple[dict[str, str], list[str]]:
    """Render and validate the ``names`` targets for ``plan``: (file name -> text, skipped-target reasons).

    With ``all``, a target that cannot express the plan is skipped (its reason returned) and the slurm script
    is written for multi-node plans only; an explicitly named target that cannot is an OptplanError.
    Validation failures are always errors: nothing is returned to write.
    """
    from optplan.planner.export.finetune import hf_model_folder
    from optplan.planner.validate import ExportValidationError

    opts = options or ExportOptions()
    lenient = "all" in names
    files: dict[str, str] = {}
    skipped: list[str] = []
    try:
        with _private_torch_cache():
            for name in targets_for(names):
                if lenient and name == "slurm" and not plan.multi_node and "slurm" not in names:
                    skipped.append("slurm: the plan runs on one node, which needs no batch script (export --to slurm "
                                   "writes one anyway)")
                    continue
                if lenient and name == "finetune" and plan.adapter is None and "finetune" not in names \
                        and hf_model_folder(plan.model_path) is None:
                    continue  # full training of a model file: finetune.py needs a Hugging Face model
                try:
                    _schedule_exportable(plan)
                    files.update(TARGETS[name](plan, opts))
                except ExportValidationError:
                    raise
                except OptplanError as err:
                    if not lenient or name in names:
                        raise
                    skipped.append(f"{name}: {err}")
    except OSError as exc:  # the loaders read temporary copies: a full or read-only temp folder
        what = (f"a temporary file in {tempfile.gettempdir()}" if exc.filename is None
                else f"{exc.filename} (temporary folder {tempfile.gettempdir()})")
        raise OptplanError(f"cannot check the exports with their trainers' loaders: {what} could not be written "
                           f"({exc.strerror or exc}); free space there or point TMPDIR at another folder") from exc
    return files, skipped
