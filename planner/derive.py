"""Turn ``optplan estimate``'s strategy flags into one consistent Strategy for a cluster.

Unspecified degrees are derived: tp, pp, cp and vpp default to 1 and dp = gpus / (tp·pp·cp); the
gradient-accumulation steps follow from ``--global-batch`` when given (global = mbs · gas · dp). An
inconsistent set is one OptplanError line naming the numbers and the fix.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import Cluster
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.planner.sparse_grads import check_sparse_optimizers


class StrategyFlags(BaseModel):
    """The strategy flags as given (None = not given)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    cp: int | None = None
    ep: int | None = None
    etp: int | None = None
    dispatcher: str = "alltoall"
    ep_overlap: bool = False
    comm_overlap: bool = False
    async_tp: bool = False
    fsdp_grad_sync: str = "micro_batch"
    fsdp_reduce_dtype: str = "auto"
    pp_schedule: str = "1f1b"
    sp: bool | None = None
    zero: int | None = None
    fsdp: str | None = None
    offload: str | None = None
    offload_optimizer: str | None = None
    offload_params: str | None = None
    precision: str = "bf16"
    optimizer: str | None = None
    mbs: int = 1
    gas: int | None = None
    global_batch: int | None = None
    checkpointing: str = "none"
    checkpoint_layers: int | None = None
    flash: bool = True
    compile: bool = False
    compile_loss: bool | None = None
    engine: str | None = None
    quant: str = "none"


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise OptplanError(f"--{name} must be >= 1 (got {value})")


def _offload_targets(flags: StrategyFlags, engine: str) -> tuple[str, str]:
    """(offload_optimizer, offload_params) from --offload or the older per-state flags."""
    legacy = (flags.offload_optimizer or "none", flags.offload_params or "none")
    if flags.offload is None or flags.offload == "none":
        if flags.offload == "none" and legacy != ("none", "none"):
            raise OptplanError("--offload none contradicts --offload-optimizer/--offload-params: drop one")
        return legacy
    if flags.offload_optimizer is not None or flags.offload_params is not None:  # even when given as none
        raise OptplanError("give --offload or --offload-optimizer/--offload-params, not both")
    if flags.offload == "optimizer":
        return "cpu", "none"
    if flags.offload == "params":
        return ("none", "cpu") if engine == "torch" else ("cpu", "cpu")
    raise OptplanError(f"unknown --offload {flags.offload!r}: use none, optimizer or params")


def _engine(flags: StrategyFlags, model_parallel: bool) -> str:
    if flags.engine is not None:
        return flags.engine
    if flags.fsdp not in (None, "none"):
        return "torch"
    offloads = flags.offload not in (None, "none") or flags.offload_optimizer not in (None, "none") \
        or flags.offload_params not in (None, "none")
    if model_parallel and (flags.zero or 0) <= 1 and not offloads:
        return "megatron"
    return "deepspeed"


def derive_strategy(flags: StrategyFlags, cluster: Cluster, *, gpus_given: bool = True) -> Strategy:
    """The Strategy for ``flags`` on ``cluster`` (degrees and accumulation derived), or OptplanError.

    ``gpus_given`` False says the GPU count is a default (no --gpus), which the messages then say."""
    for name in ("dp", "tp", "pp", "vpp", "cp", "ep", "etp", "mbs", "gas", "global_batch"):
        _positive(name.replace("_", "-"), getattr(flags, name))
    tp, pp, cp = flags.tp or 1, flags.pp or 1, flags.cp or 1
    model = tp * pp * cp
    gpus = cluster.gpus
    which = "" if gpus_given else " (the detected or default count: pass --gpus)"
    if flags.dp is None:
        if gpus % model:
            raise OptplanError(f"--gpus {gpus}{which} is not divisible by tp·pp·cp = {tp}·{pp}·{cp} = {model}: "
                               f"change the degrees or use a multiple of {model} GPUs")
        dp = gpus // model
    else:
        dp = flags.dp
        if dp * model != gpus:
            raise OptplanError(f"dp·tp·pp·cp = {dp}·{tp}·{pp}·{cp} = {dp * model} does not match --gpus {gpus}{which}: "
                               "drop --dp to derive it, or change the degrees")
    gas = flags.gas
    if flags.global_batch is not None:
        per_step = flags.mbs * dp
        if flags.global_batch % per_step:
            raise OptplanError(f"--global-batch {flags.global_batch} is not divisible by mbs x dp = "
                               f"{flags.mbs} x {dp} = {per_step}: use a multiple of {per_step}")
        derived = flags.global_batch // per_step
        if gas is not None and gas != derived:
            raise OptplanError(f"--gas {gas} contradicts --global-batch {flags.global_batch} = mbs {flags.mbs} x "
                               f"dp {dp} x gas {derived}: drop one of them")
        gas = derived
    engine = _engine(flags, model > 1 or (flags.ep or 1) > 1 or flags.etp is not None)
    offload_optimizer, offload_params = _offload_targets(flags, engine)
    data: dict[str, object] = {
        "precision": flags.precision, "optimizer": flags.optimizer or "adamw", "zero": flags.zero or 0,
        "fsdp": flags.fsdp or "none", "mbs": flags.mbs, "grad_accum": gas or 1,
        "checkpointing": flags.checkpointing, "checkpoint_layers": flags.checkpoint_layers, "dp": dp, "tp": tp, "pp": pp, "vpp": flags.vpp or 1, "cp": cp, "ep": flags.ep or 1,
        "etp": flags.etp, "dispatcher": flags.dispatcher, "ep_overlap": flags.ep_overlap, "comm_overlap": flags.comm_overlap,
        "async_tp": flags.async_tp,
        "fsdp_grad_sync": flags.fsdp_grad_sync, "fsdp_reduce_dtype": flags.fsdp_reduce_dtype, "pp_schedule": flags.pp_schedule, "sp": flags.sp, "flash": flags.flash, "compile": flags.compile,
        "compile_loss": flags.compile_loss, "offload_optimizer": offload_optimizer,
        "offload_params": offload_params, "engine": engine, "quant": flags.quant,
    }
    return Strategy.model_validate(data)


def file_precision(profile: ModelProfile, cluster: Cluster) -> tuple[str | None, str | None]:
    """The model file's ``OPTPLAN["precision"]`` where the cluster's GPU has math for it, else None with the note
    that says why it is not taken; (None, None) without one or for a LoRA profile (its precisions are the
    adapters')."""
    from optplan.estimators.precision import require_precision

    name = profile.defaults.precision
    if name is None or profile.adapter is not None:
        return None, None
    try:
        require_precision(cluster.gpu, name)
    except OptplanError as exc:
        return None, f"the model file's OPTPLAN precision {name} is not taken: {exc}"
    return name, None


def file_defaults(profile: ModelProfile, cluster: Cluster, flags: StrategyFlags, strategy: Strategy, *,
                  precision_given: bool) -> tuple[dict[str, object], list[str]]:
    """The model file's ``OPTPLAN`` values ``optplan estimate`` takes where its flags leave them open, as updates to
    ``flags``, and the notes that say so: the optimizer (SGD for a model with sparse gradients when none is named,
    planner/sparse_grads.py; a named dense one is an OptplanError); the precision (unless one is given, or the GPU has no math
    for it); the global batch when neither ``--gas`` nor ``--global-batch`` is given and mbs x dp of ``strategy``
    (the flags' own plan) divides it (else a note says it was not taken)."""
    d = profile.defaults
    updates: dict[str, object] = {}
    notes: list[str] = []
    if flags.optimizer is None and d.optimizer and d.optimizer != strategy.optimizer:
        updates["optimizer"] = d.optimizer

    if not precision_given:
        precision, refused = file_precision(profile, cluster)
        if precision is not None and precision != strategy.precision:
            updates["precision"] = precision
        notes.extend([refused] if refused else [])
    if flags.gas is None and flags.global_batch is None and d.global_batch:
        per_step = strategy.mbs * strategy.dp
        if d.global_batch % per_step == 0:
            updates["global_batch"] = d.global_batch
        else:
            notes.append(f"the model file's OPTPLAN global batch {d.global_batch} is not divisible by mbs x dp = "
                         f"{strategy.mbs} x {strategy.dp}: estimated at --gas 1 (pass --global-batch or --gas)")
    notes[:0] = [f"{key.replace('_', ' ')} {value} from the model file's OPTPLAN" for key, value in updates.items()]
    wanted = str(updates.get("optimizer", strategy.optimizer))
    sparse_ok = check_sparse_optimizers(profile, (wanted,), named=flags.optimizer is not None or bool(d.optimizer))
    if sparse_ok != (wanted,):  # sparse gradients: SGD in place of the default AdamW (planner/sparse_grads.py)
        updates["optimizer"] = sparse_ok[0]
    return updates, notes
