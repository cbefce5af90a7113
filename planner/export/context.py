"""ExportPlan: everything an exporter needs to know about a plan, and nothing it must recompute.

Every exporter is a pure function ``ExportPlan -> text`` plus a validator ``(text, ExportPlan) -> None``.
An ExportPlan is built from a recommendation (``from_recommendation``) and stored under the ``export`` key
of ``plan.json``, so ``optplan export plan.json`` re-renders launch files without profiling the model again.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.buckets import DeepSpeedBuckets, deepspeed_buckets
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import Estimate
from optplan.estimators.finetune import AdapterProfile
from optplan.estimators.fsdp_grad_sync import fsdp_reduce_bytes
from optplan.estimators.hardware import Cluster
from optplan.estimators.profile import ModelProfile, TransformerShape
from optplan.estimators.strategy import SIXTEEN_BIT_WEIGHTS, Strategy

SELECTIVE_CHECKPOINTING_HOWTO = (
    "selective activation checkpointing is done in the model, as optplan priced it: wrap each repeated block in "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...) with torch's "
    "create_selective_checkpoint_contexts and torchtitan's per-op policy (save the attention outputs and every other "
    "matmul's output, recompute the rest), which optplan's train.py applies"
)
"""What every exporter says of a selective plan (the policy estimators/selective.py prices; the trainers'
configuration files have no switch for it)."""

FILE_NAMES: dict[str, str] = {
    "plan": "plan.json",
    "report": "PLAN.md",
    "deepspeed": "ds_config.json",
    "accelerate": "accelerate.yaml",
    "torchrun": "launch.sh",
    "hostfile": "hostfile",
    "slurm": "slurm.sbatch",
    "hf": "hf_training_args.json",
    "lightning": "lightning.json",
    "train": "train.py",
    "finetune": "finetune.json",
    "finetune_script": "finetune.py",
}
"""The file each target writes (stable names: users' scripts refer to them)."""


class NotExportable(OptplanError):
    """The plan cannot be expressed by this target (the message names the target that can, or the fix)."""


class TrainPrediction(BaseModel):
    """What the plan predicts for one optimizer step, carried into train.py (which prints its measurements
    beside these) and back through measurements.json into ``optplan calibrate``. Shown figures are the
    plan's (calibrated when a calibration was used); ``uncalibrated_*`` and the byte figures are the plain
    model's, which calibrations scale."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step_s: float = Field(gt=0, description="predicted optimizer step (s)")
    step_s_low: float = Field(ge=0, description="fast end of its band (s)")
    step_s_high: float = Field(ge=0, description="slow end of its band (s)")
    band_basis: str = ""
    outside_measured: tuple[str, ...] = ()
    samples_per_s: float = Field(gt=0, description="global samples per second")
    tokens_per_s: float | None = Field(default=None, description="global tokens per second")
    mfu: float = Field(ge=0)
    model_flops_per_step: float = Field(ge=0, description="model FLOPs of one optimizer step, all GPUs")
    mfu_peak_flops_per_gpu: float = Field(gt=0, description="the MFU reference peak of one GPU (FLOP/s)")
    total_bytes: int = Field(ge=0, description="predicted peak per GPU incl. allocator/context overhead (bytes)")
    allocated_bytes: int = Field(ge=0, description="predicted peak allocated per GPU (bytes)")
    cpu_allocated_bytes: int = Field(ge=0, description="the same run on CPU ranks: peak live tensor bytes (bytes)")
    uncalibrated_step_s: float = Field(gt=0)
    uncalibrated_on_device_s: float = Field(ge=0, description="compute + memory-bound + optimizer + host + bubble (s)")
    uncalibrated_exposed_comm_s: float = Field(ge=0)
    model_hash: str = Field(description="calibrate.profile_hash of the model's profile (the calibration key)")
    torch_version: str = ""


class ExportPlan(BaseModel):
    """A plan plus the model and cluster facts the launch files need.

    ``gpus_per_node`` is the cluster's; the plan occupies ``strategy.world_size`` GPUs, i.e. ``nodes``
    nodes of ``procs_per_node`` processes each.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Strategy
    model: str = Field(description="the model's name (file stem or --arch)")
    model_path: str = Field(description="the model file as given ('' for --arch/--params)")
    model_class: str = ""
    block_class: str | None = Field(default=None, description="the repeated block's class name (FSDP wrap unit)")
    params: int = Field(ge=0, description="unique parameters")
    transformer: TransformerShape | None = None
    seq_len: int | None = None
    buckets: DeepSpeedBuckets
    gpu: str
    gpus_per_node: int = Field(ge=1)
    tokens_per_sample: int | None = None
    prediction: TrainPrediction | None = Field(default=None, description="what the plan predicts (train.py "
                                               "prints its measurements beside it); None for --params plans")
    adapter: AdapterProfile | None = Field(default=None, description="the LoRA adapters of a --finetune lora|qlora "
                                                                     "plan; None for full training")

    @property
    def world_size(self) -> int:
        """GPUs (processes) the plan occupies."""
        return self.strategy.world_size

    @property
    def procs_per_node(self) -> int:
        """Processes (GPUs) started on each node."""
        return min(self.gpus_per_node, self.world_size)

    @property
    def nodes(self) -> int:
        """Nodes the plan occupies."""
        return -(-self.world_size // self.gpus_per_node)

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


ASYNC_TP_HOWTO = (
    "async TP (as the plan prices it, estimators/async_tp.py): with a sequence-parallel tensor-parallel plan (the "
    "all-gather -> matmul and matmul -> reduce-scatter patterns Inductor fuses; all-reduces are not) and compiled "
    "blocks, set torch._inductor.config._micro_pipeline_tp = True and call torch.distributed._symmetric_memory."
    "enable_symm_mem_for_group(tp_mesh.get_group().group_name) before compiling, as torchtitan's parallelize_llama "
    "does"
)
"""How a script turns on the async TP a plan priced (torchtitan 820504e ``parallelize_llama.py``)."""


def refuse_autocast_for_16bit_weights(plan: ExportPlan, switch: str) -> None:
    """Raise NotExportable when ``switch`` (a trainer's 16-bit setting, e.g. accelerate's ``mixed_precision: bf16``)
    would run this plan as autocast over fp32 weights although the plan priced 16-bit weights with fp32 masters.

    On the torch engine without FSDP (DDP, one GPU) the trainers' 16-bit switches are autocast: fp32 parameters,
    each matmul's weight cast per use, autocast's saved casts (the ``amp-bf16``/``amp-fp16`` recipes). The
    ``bf16``/``fp16`` recipes hold 16-bit weights and gradients and step fp32 master copies (what train.py runs,
    probes/trainloop.py ``MasterWeights``): the same 16 bytes of model state per parameter with AdamW, but other
    activations, profiled separately (``bf16-weights`` vs ``bf16`` autocast: a small GPT-2 at micro-batch 256 held
    19.4 GiB of activations as planned and 31.9 GiB under autocast). Under FSDP the same switches set FSDP's
    MixedPrecision(param_dtype=16-bit) over fp32 shards: 16-bit weights in compute, as planned."""
    s = plan.strategy
    if s.engine == "torch" and s.fsdp == "none" and s.precision in ("bf16", "fp16"):
        amp = f"amp-{s.precision}"
        raise NotExportable(
            f"{switch} runs autocast over fp32 weights without FSDP (the {amp} recipe), not this plan's {s.precision} "
            f"weights with fp32 master copies, and autocast holds other activations than the plan priced: launch "
            f"the plan's train.py (launch.sh), or plan with --precision {amp}"
        )


def sixteen_bit_reduce_note(strategy: Strategy, trainer: str, *, amp_gathers_16bit: bool) -> str | None:
    """The note for a trainer whose FSDP reduces gradients in its 16-bit dtype when the plan reduces in fp32
    (estimators/fsdp_grad_sync.py); None when the plan already reduces as the trainer does.

    ``trainer`` names it: accelerate's ``FullyShardedDataParallelPlugin.set_mixed_precision`` (which the Hugging
    Face Trainer uses) sets ``param_dtype = reduce_dtype`` = the 16-bit dtype under ``bf16``/``fp16``, also for
    the AMP recipes (``amp_gathers_16bit=True``: the run is the 16-bit recipe); Lightning's
    ``FSDPPrecision.mixed_precision_config`` reduces in bf16/fp16 under ``bf16-mixed``/``16-mixed`` but gathers
    fp32 parameters (``amp_gathers_16bit=False``: autocast over fp32 weights with a 16-bit reduction, a mix no
    optplan recipe prices)."""
    if strategy.engine != "torch" or strategy.fsdp == "none":
        return None
    amp_low = {"amp-bf16": "bf16", "amp-fp16": "fp16"}.get(strategy.precision)
    low = SIXTEEN_BIT_WEIGHTS.get(strategy.precision, amp_low)
    if low is None or fsdp_reduce_bytes(strategy.precision, strategy.fsdp_reduce_dtype) != 4:
        return None
    head = (f"FSDP under {trainer} reduces gradients in {low}, where the plan counts fp32 (its reduce-scatters "
            "move half the bytes the plan counts)")
    if amp_low is None:
        fix = f"plan with --fsdp-reduce-dtype {low} to price the run as it goes"
    elif amp_gathers_16bit:
        fix = (f"it also gathers {low} weights, which is the {low} recipe: plan with --precision {low} "
               f"--fsdp-reduce-dtype {low} to price the run as it goes")
    else:
        fix = "no optplan recipe prices autocast over fp32 weights with a 16-bit reduction"
    return f"{head}: {fix}, or launch the plan's train.py (launch.sh), which reduces in fp32"


def export_plan_for(strategy: Strategy, profile: ModelProfile, cluster: Cluster, *,
                    shown: Estimate | None = None) -> ExportPlan:
    """The ExportPlan of ``strategy`` for ``profile`` on ``cluster``.

    Raises OptplanError when the plan spans nodes but does not fill whole nodes (launchers start the same
    number of processes on every node).
    """
    world = strategy.world_size
    if world > cluster.gpus_per_node and world % cluster.gpus_per_node:
        raise OptplanError(f"the plan uses {world} GPUs, not a whole number of {cluster.gpus_per_node}-GPU nodes: "
                           "re-plan with a GPU count that fills whole nodes")
    block = profile.repeated_block
    prediction = train_prediction(strategy, profile, cluster, shown) if shown is not None else None
    return ExportPlan(
        strategy=strategy, model=profile.name, model_path=profile.model_file, model_class=profile.model_class,
        block_class=block.class_name if block is not None else None, params=profile.params,
        transformer=profile.transformer, seq_len=profile.seq_len, buckets=deepspeed_buckets(profile),
        gpu=cluster.gpu.name, gpus_per_node=cluster.gpus_per_node, tokens_per_sample=profile.tokens_per_sample,
        prediction=prediction, adapter=profile.adapter,
    )


def train_prediction(strategy: Strategy, profile: ModelProfile, cluster: Cluster, shown: Estimate) -> TrainPrediction:
    """The :class:`TrainPrediction` of ``strategy``: ``shown`` (the estimate the user saw) for the printed
    figures, a fresh uncalibrated estimate for the parts a calibration scales (as ``probe_stage.compare_spec``
    predicts probes), and the CPU accounting of the same run (``memory.memory_breakdown(device="cpu")``, its loss
    eager: the CPU's tracked steps run eagerly)."""
    from optplan.estimators.compiled_loss import eager_loss_on
    from optplan.estimators.estimate import estimate
    from optplan.estimators.memory import memory_breakdown
    from optplan.estimators.timing import mfu_peak_flops
    from optplan.planner.calibrate import profile_hash, torch_version

    plain = estimate(profile, cluster, strategy)
    cpu = memory_breakdown(profile, eager_loss_on(strategy, "cpu"), plain.memory.capacity_bytes,
                           gpus_per_node=cluster.gpus_per_node, device="cpu")
    t = shown.time
    return TrainPrediction(
        step_s=t.step_s, step_s_low=t.step_s_low, step_s_high=t.step_s_high, band_basis=t.band_basis,
        outside_measured=t.outside_measured, samples_per_s=t.samples_per_s, tokens_per_s=t.tokens_per_s,
        mfu=t.mfu, model_flops_per_step=profile.train_flops_per_sample * strategy.global_batch,
        mfu_peak_flops_per_gpu=mfu_peak_flops(cluster.gpu), total_bytes=shown.memory.total_bytes,
        allocated_bytes=plain.memory.total_bytes - plain.memory.overhead_bytes,
        cpu_allocated_bytes=cpu.total_bytes - cpu.overhead_bytes, uncalibrated_step_s=plain.time.step_s,
        uncalibrated_on_device_s=plain.time.step_s - plain.time.exposed_comm_s,
        uncalibrated_exposed_comm_s=plain.time.exposed_comm_s, model_hash=profile_hash(profile),
        torch_version=torch_version())
