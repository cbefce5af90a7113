"""The planner's public API for faces: load a profile, resolve the cluster, estimate, export.

No printing here; faces render what these return.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.cost import training_cost
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import Estimate, StatesEstimate, estimate, estimate_states
from optplan.estimators.finetune import LoraRequest
from optplan.estimators.hardware import Cluster
from optplan.estimators.params_only import is_params_only, profile_from_params
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.planner.cluster_file import load_cluster_file
from optplan.planner.export.context import FILE_NAMES
from optplan.planner.export.registry import TARGETS, ExportOptions
from optplan.planner.goal import band_factor
from optplan.planner.recommend import Recommendation
from optplan.planner.space import check_global_batch, check_precisions
from optplan.probes.hardware import (
    HardwareReport,
    LiveReport,
    NvmlApi,
    cluster_from,
    detect_gpus,
    sample_gpus,
)
from optplan.probes.loader import profile_model_file
from optplan.probes.model_errors import ModelFileError

EXPORT_NAMES = tuple(FILE_NAMES.values())
EXPORT_TARGETS: tuple[str, ...] = tuple(TARGETS)
"""The targets ``render_exports`` knows (``all`` is each of them)."""


def load_profile(path: Path | str, *, seq_len: int | None = None, model_name: str | None = None,
                 cancelled: Callable[[], bool] | None = None, lora: LoraRequest | None = None) -> ModelProfile:
    """Profile a model file in a child process (the file is user code: it never runs in this process);
    ``cancelled()`` turning true kills the child and raises Cancelled; ``lora``: with LoRA adapters."""
    if seq_len is not None and seq_len < 1:
        raise OptplanError(f"--seq-len must be >= 1 (got {seq_len})")
    return profile_model_file(path, seq_len=seq_len, model_name=model_name, cancelled=cancelled, lora=lora)


def resolve_model(path: Path | str | None, *, arch: str | None = None, seq_len: int | None = None,
                  model_name: str | None = None, params: float | None = None, hf: str | None = None,
                  hf_class: str | None = None, cancelled: Callable[[], bool] | None = None,
                  lora: LoraRequest | None = None) -> ModelProfile:
    """The profile of a model file (profiled in a child process), of a Hugging Face config (``hf``: the model file
    :mod:`optplan.planner.hf_source` writes for it, profiled the same way), of an ``--arch`` shape (by formula),
    or of a bare parameter count (``--params``: model states only). ``cancelled``: see :func:`load_profile`;
    ``lora``: profile the model with LoRA adapters (a model file or ``--hf`` only)."""
    given = [name for name, v in (("a model FILE", path), ("--hf", hf), ("--arch", arch), ("--params", params))
             if v is not None]
    if len(given) != 1:
        what = f"not both: got {' and '.join(given)}" if given else "got none"
        raise OptplanError(f"give exactly one of a model FILE, --hf CONFIG, --arch layers=L,hidden=H,heads=A or "
                           f"--params N ({what})")
    if hf_class is not None and hf is None:
        raise OptplanError("--hf-class picks the class of an --hf model: add --hf CONFIG or drop --hf-class")
    if lora is not None and (params is not None or arch is not None):
        raise OptplanError("--finetune lora|qlora adds adapters to a real model: give a model FILE or --hf "
                           "(not --arch/--params)")
    if params is not None:
        return profile_from_params(params)
    if arch is not None:
        return profile_from_arch(parse_arch(arch, seq_len=seq_len))
    if hf is not None:
        from optplan.planner.hf_source import hf_model_file

        path = hf_model_file(hf, hf_class)
        moe = _hf_moe_profile(hf, hf_class, path, seq_len, model_name, lora)
        if moe is not None:
            return moe
        try:
            return load_profile(path, seq_len=seq_len, model_name=model_name, cancelled=cancelled, lora=lora)
        except ModelFileError as exc:  # named by what the user typed, not by the cache file optplan wrote
            if Path(exc.path).name != path.name:
                raise
            fix, problem = exc.fix, exc.problem
            if problem.startswith(("importing the file raised", "build_model() raised")):
                # optplan's generated file only builds the config's class: the config is what to change
                problem = problem.replace("importing the file raised", "building the config raised", 1).replace(
                    "build_model() raised", "building the model from the config raised", 1)
                fix = (f"the config is what transformers refused: fix its values in {hf}'s config.json (optplan only "
                       "builds the config's class from it), or pass --hf-class for another class")
            raise ModelFileError(f"--hf {hf}", problem, fix, detail=exc.detail) from None
    return load_profile(path, seq_len=seq_len, model_name=model_name, cancelled=cancelled,  # type: ignore[arg-type]
                        lora=lora)


def _hf_moe_profile(hf: str, hf_class: str | None, path: Path, seq_len: int | None, model_name: str | None,
                    lora: LoraRequest | None) -> ModelProfile | None:
    """The formula profile of an MoE config (planner/hf_moe.py), or None for a dense model."""
    from optplan.planner.hf_moe import is_moe_config, moe_arch, read_config
    from optplan.planner.hf_source import DEFAULT_HF_SEQ_LEN, find_hf_config

    source = find_hf_config(hf, hf_class)
    doc = read_config(source.config_path)
    if not is_moe_config(doc):
        return None
    if lora is not None:
        raise OptplanError(f"--hf {hf} is a Mixture-of-Experts model, and LoRA on MoE models is not planned yet: "
                           "plan full training (drop --finetune)")
    seq = seq_len or min(source.max_positions or DEFAULT_HF_SEQ_LEN, DEFAULT_HF_SEQ_LEN)
    prof = profile_from_arch(moe_arch(doc, seq, hf), name=model_name or source.name)
    note = (f"{source.model_class} is a Mixture-of-Experts model: profiled by formula from its config (its expert "
            "kernels run in 16-bit only and route by data, which a fake-tensor run cannot measure)")
    return prof.model_copy(update={"path": str(path), "model_class": source.model_class,
                                   "notes": (*prof.notes, note)})


def detect_hardware() -> HardwareReport:
    """What NVML sees (a clean 'no GPU detected' report when nothing is there)."""
    return detect_gpus()


def sample_hardware(nvml: NvmlApi | None = None) -> LiveReport:
    """Live utilisation, memory, temperature and power of each GPU (NVML; ``nvml`` an adapter, e.g. the
    fake in ``optplan.probes.hardware_fake``). Never raises: ``available=False`` says why."""
    return sample_gpus(nvml)


def resolve_cluster(*, gpu: str | None, gpus: int | None, gpus_per_node: int | None,
                    cluster_file: Path | str | None = None) -> tuple[Cluster, list[str]]:
    """The cluster to plan for and notes for the user (``--cluster FILE.yaml``, else explicit --gpu, else
    what NVML detects)."""
    if cluster_file is not None:
        clash = [f for f, v in (("--gpu", gpu), ("--gpus", gpus), ("--gpus-per-node", gpus_per_node)) if v is not None]
        if clash:
            raise OptplanError(f"--cluster describes the GPUs already: drop {', '.join(clash)} or drop --cluster")
        cluster = load_cluster_file(cluster_file)
        return cluster, [f"cluster from {cluster_file}: {cluster.gpus} x {cluster.gpu.name} "
                         f"({cluster.nodes} node(s) of {cluster.gpus_per_node})"]
    report = detect_gpus() if gpu is None else None
    cluster, notes = cluster_from(report, gpu=gpu, gpus=gpus, gpus_per_node=gpus_per_node)
    if cluster.gpus > cluster.gpus_per_node and cluster.gpus % cluster.gpus_per_node:
        fix = "change --gpus-per-node" if gpus_per_node is not None else "set --gpus-per-node"
        raise OptplanError(f"--gpus {cluster.gpus} is not a whole number of nodes of {cluster.gpus_per_node} GPUs: "
                           f"use a multiple of {cluster.gpus_per_node} or {fix}")
    return cluster, notes


def check_search_options(cluster: Cluster, *, global_batch: int | None, precisions: Sequence[str] | None) -> None:
    """Validate recommend's options against the cluster before the model is profiled."""
    check_global_batch(global_batch, cluster.gpus)
    check_precisions(cluster, precisions or ())


def estimate_strategy(profile: ModelProfile, cluster: Cluster, strategy: Strategy, *,
                      tokens: float | None = None,
                      price_per_gpu_hour: float | None = None) -> Estimate | StatesEstimate:
    """Estimate one strategy (the ``optplan estimate`` command), with the cost of ``tokens`` if given.

    The price defaults to the cluster file's ``price_per_gpu_hour``; energy uses its ``gpu_power_w``
    (else the datasheet TDP). A ``--params`` profile gets model states, buffers and overhead only. The profile's
    notes come first in the estimate's.
    """
    price = price_per_gpu_hour if price_per_gpu_hour is not None else cluster.price_per_gpu_hour
    if is_params_only(profile):
        if tokens is not None:
            raise OptplanError("--tokens needs a step time, and --params gives model states only: give a model "
                               "FILE or --arch")
        return estimate_states(profile, cluster, strategy)
    est = estimate(profile, cluster, strategy)
    # what the profile noticed (an OPTPLAN typo, a default loss, a real-run fallback) heads the estimate's own notes,
    # as recommend puts it in the plan's
    est = est.model_copy(update={"notes": tuple(dict.fromkeys((*profile.notes, *est.notes)))})
    if tokens is None:
        if price_per_gpu_hour is not None:
            raise OptplanError("--price needs --tokens (the token budget to price)")
        return est
    if est.tokens_per_s is None:
        raise OptplanError(f"--tokens needs a token model; {profile.name} takes {profile.input_kind} inputs")
    cost = training_cost(tokens=tokens, tokens_per_s=est.tokens_per_s, gpus=strategy.world_size,
                         gpu_power_w=cluster.power_w_per_gpu, price_per_gpu_hour=price,
                         step_band=(band_factor(est, "fast"), band_factor(est, "slow")))
    return est.model_copy(update={"cost": cost})


def check_out_dir(out_dir: Path, *, force: bool, names: Sequence[str] = EXPORT_NAMES) -> None:
    """Fail early, before any work, when exports would overwrite files without --force."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OptplanError(f"--out {out_dir} is a file, not a directory: choose a directory")
    existing = [n for n in names if (out_dir / n).exists()]
    if existing and not force:
        raise OptplanError(f"{out_dir} already has {', '.join(existing)}: pass --force to overwrite "
                           "or choose another --out")
    probe = out_dir if out_dir.exists() else next((p for p in out_dir.parents if p.exists()), Path("."))
    if not probe.is_dir():
        raise OptplanError(f"cannot create --out {out_dir}: {probe} is a file, not a directory; choose another --out")
    if not os.access(probe, os.W_OK):
        raise OptplanError(f"cannot write to {probe}: choose a writable --out directory")


def render_exports(rec: Recommendation, targets: Sequence[str] = ("all",),
                   options: ExportOptions | None = None) -> tuple[dict[str, str], list[str]]:
    """plan.json, PLAN.md and the launch files of a fitting recommendation, each validated by its target's
    own loader; also the targets skipped because they cannot express the plan (with the reason)."""
    from optplan.planner.export.registry import render_targets
    from optplan.planner.export.report import plan_json_text, render_plan_md

    if rec.plan is None or rec.export is None:
        raise OptplanError("no plan fits, so there is nothing to export: follow the suggestions first")
    files, skipped = render_targets(rec.export, targets, options=options)
    if FILE_NAMES["train"] in files:  # an --hf model's generated file travels with the train.py that builds it
        from optplan.planner.hf_source import generated_model_file

        generated = generated_model_file(rec.export.model_path)
        if generated is not None:
            files[generated[0]] = generated[1]
    return {FILE_NAMES["plan"]: plan_json_text(rec), FILE_NAMES["report"]: render_plan_md(rec), **files}, skipped


def export_plan(rec: Recommendation, out_dir: Path, *, force: bool, targets: Sequence[str] = ("all",),
                options: ExportOptions | None = None) -> tuple[list[Path], list[str]]:
    """Render, validate and atomically write the exports; nothing is written if validation fails."""
    from optplan.planner.export.files import write_files

    files, skipped = render_exports(rec, targets, options)
    written = write_files(out_dir, files, force=force)
    if "all" in targets:  # the whole set: an export file of another plan left in the folder would launch that plan
        stale = stale_exports(out_dir, files)
        if stale:
            skipped = [*skipped, f"left in {out_dir} from an earlier plan, not this one's: {', '.join(stale)} (remove "
                                 f"{'it' if len(stale) == 1 else 'them'}: launched, {'it' if len(stale) == 1 else 'they'} "
                                 "would run that plan)"]
    return written, skipped


def stale_exports(out_dir: Path, files: dict[str, str]) -> list[str]:
    """Export file names (``FILE_NAMES``) in ``out_dir`` that ``files`` (a whole export set) does not hold."""
    return sorted(n for n in FILE_NAMES.values() if n not in files and (Path(out_dir) / n).is_file())


def write_exports(out_dir: Path, files: dict[str, str], *, force: bool) -> list[Path]:
    """Write rendered exports (``render_exports``' files) atomically, all or nothing; without ``force``
    an existing file is an OptplanError and nothing is written."""
    from optplan.planner.export.files import write_files

    return write_files(out_dir, files, force=force)


def existing_exports(out_dir: Path, names: Sequence[str]) -> list[str]:
    """Which of ``names`` already exist in ``out_dir`` (what writing them would overwrite)."""
    return [n for n in names if (Path(out_dir) / n).exists()]


def export_plan_file(plan_file: Path, targets: Sequence[str], out_dir: Path, *, force: bool,
                     options: ExportOptions | None = None) -> tuple[list[Path], list[str]]:
    """``optplan export plan.json --to ...``: re-render launch files from a saved plan (no profiling), with a copy of
    the plan.json beside them (what ``optplan validate`` reads) unless the folder already holds it."""
    from optplan.planner.export.files import write_files
    from optplan.planner.export.registry import render_targets, targets_for
    from optplan.planner.export.report import load_plan_json

    targets_for(targets)  # a bad --to fails before the file is read
    try:
        text = Path(plan_file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise OptplanError(f"plan file {plan_file} does not exist: give the plan.json that recommend --out "
                           "wrote") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OptplanError(f"cannot read plan file {plan_file} ({exc}): give a readable plan.json") from None
    _rec, export = load_plan_json(text, str(plan_file))
    files, skipped = render_targets(export, targets, options=options)
    if not files:
        raise OptplanError(f"no target can express this plan ({'; '.join(skipped)})")
    beside = Path(out_dir) / "plan.json"  # validate reads the plan beside the files it launches
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if beside.exists() and (beside.resolve() == Path(plan_file).resolve() or beside.read_text("utf-8") == text):
            return write_files(out_dir, files, force=force), skipped
    return write_files(out_dir, {**files, "plan.json": text}, force=force), skipped
