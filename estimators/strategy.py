"""Strategy: one point of the search space (how to train), with the flag names the CLI uses.

Parallel degrees follow Megatron-LM's conventions (Narayanan et al. 2021, arXiv 2104.04473 §2-3;
Korthikanti et al. 2022, arXiv 2205.05198 §4): ``tp`` tensor parallel (optionally with sequence
parallelism ``sp``), ``pp`` pipeline stages with ``vpp`` virtual (interleaved) stages per rank, ``cp``
context parallel (the sequence split over ranks), ``dp`` data parallel; the world size is
dp·tp·pp·cp GPUs. The micro-batches per pipeline flush are the gradient-accumulation steps.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from optplan.estimators.ep_overlap import OVERLAP_EXCLUDED_RECOMPUTE, OVERLAP_PRECISIONS
from optplan.estimators.finetune import QuantName

PrecisionName = Literal["fp32", "amp-bf16", "amp-fp16", "bf16", "fp16", "bf16-pure", "fp8"]
UNTAGGED_ENGINE = "deepspeed"
"""The engine :meth:`Strategy.label` leaves unnamed; every other engine's label ends in ``[engine]``."""
OptimizerName = Literal["adamw", "adamw8bit", "adafactor", "sgd", "paged_adamw", "paged_adamw8bit"]
OffloadTarget = Literal["none", "cpu", "nvme"]
EngineName = Literal["torch", "deepspeed", "megatron"]
FsdpName = Literal["none", "full", "grad_op", "hybrid"]
CheckpointName = Literal["none", "selective", "full", "moe"]
"""Activation recomputation: none; selective (the attention core, Korthikanti et al. 2022 §5); full (every layer
from its input); moe (the MoE layers from their input: router, dispatch, experts, combine; Megatron's
``--recompute-modules moe``, estimators/moe_recompute.py)."""
DispatcherName = Literal["alltoall", "deepep"]
FsdpGradSync = Literal["micro_batch", "step"]
ReduceDtype = Literal["auto", "fp32", "bf16", "fp16"]
"""The dtype torch FSDP reduce-scatters (and accumulates unsharded) gradients in (``MixedPrecisionPolicy.reduce_dtype``):
auto (the recipe's default: fp32 under fp32 masters or fp32 compute, bf16 under bf16-pure), fp32, or the recipe's
16-bit dtype (estimators/fsdp_grad_sync.py)."""
SIXTEEN_BIT_WEIGHTS: dict[str, str] = {"bf16": "bf16", "fp16": "fp16", "bf16-pure": "bf16", "fp8": "bf16"}
"""Recipes whose weights FSDP gathers in 16 bits -> that dtype: the ones whose gradients can be reduced in it."""


def reduce_dtype_fits(precision: str, reduce_dtype: str) -> bool:
    """Whether torch FSDP can reduce ``precision``'s gradients in ``reduce_dtype``: ``auto`` and fp32 always, a
    16-bit dtype only the one the recipe gathers its weights in (:data:`SIXTEEN_BIT_WEIGHTS`)."""
    return reduce_dtype in ("auto", "fp32") or SIXTEEN_BIT_WEIGHTS.get(precision) == reduce_dtype
PipelineSchedule = Literal["1f1b", "dualpipe"]

OPTIMIZER_ALIASES: dict[str, str] = {
    "adamw-8bit": "adamw8bit", "adam8bit": "adamw8bit", "adamw_8bit": "adamw8bit",
    "paged-adamw": "paged_adamw", "paged_adamw_32bit": "paged_adamw", "paged-adamw8bit": "paged_adamw8bit",
    "paged_adamw_8bit": "paged_adamw8bit",
}
PAGED_OPTIMIZERS = ("paged_adamw", "paged_adamw8bit")
"""bitsandbytes' paged optimizers (``PagedAdamW``, ``PagedAdamW8bit``): their state lives in CUDA unified memory
(estimators/optimizers.py)."""
QUANT_FP8_PROBLEM = ("a quantised base (QLoRA) computes in bf16/fp16 (bitsandbytes dequantises its 4-bit weights for "
                     "16-bit GEMMs)")
"""Why a quantised base and fp8 do not go together (Strategy's check, the recommend flags' check)."""
FSDP_STAGE: dict[str, int] = {"none": 0, "grad_op": 2, "full": 3, "hybrid": 3}
"""The ZeRO stage an FSDP sharding strategy equals (PyTorch FSDP docs: SHARD_GRAD_OP shards gradients
and optimizer states like ZeRO-2, FULL_SHARD also parameters like ZeRO-3; HYBRID_SHARD is FULL_SHARD
inside a node and replication across nodes)."""


def sharding_name(engine: str, zero: int, fsdp: str, sep: str = "-") -> str:
    """The data-parallel sharding in words: 'FSDP-full' (``sep`` between), 'DDP' (the torch engine unsharded:
    DistributedDataParallel, never a ZeRO stage) or 'ZeRO-k' (DeepSpeed's stage, Megatron's distributed optimizer)."""
    if fsdp != "none":
        return f"FSDP{sep}{fsdp}"
    return "DDP" if engine == "torch" else f"ZeRO-{zero}"


class Strategy(BaseModel):
    """How to train: precision, optimizer, batch split, checkpointing, sharding, offload, parallel degrees.

    Field names are the ``optplan estimate`` flag names (``--zero``, ``--mbs``, ``--tp``...) and the keys
    of ``plan`` in every ``--json`` document; they are a stable interface.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    precision: PrecisionName = "bf16"
    optimizer: OptimizerName = "adamw"
    zero: int = Field(default=0, ge=0, le=3, description="DeepSpeed ZeRO stage 0-3 (0 = plain data parallel)")
    fsdp: FsdpName = Field(default="none", description="torch FSDP sharding: full, grad_op or hybrid (HSDP)")
    mbs: int = Field(default=1, ge=1, description="micro-batch per GPU (samples)")
    grad_accum: int = Field(default=1, ge=1, description="gradient-accumulation steps (= pipeline micro-batches)")
    checkpointing: CheckpointName = "none"
    checkpoint_layers: int | None = Field(
        default=None, ge=1,
        description="with checkpointing full: how many repeated blocks of each pipeline stage are checkpointed, "
                    "the first ones (Megatron-LM --recompute-method block --recompute-num-layers); the others keep "
                    "their activations. None = every block (estimators/partial_checkpointing.py)")
    dp: int = Field(default=1, ge=1, description="data-parallel degree (GPUs)")
    tp: int = Field(default=1, ge=1, description="tensor-parallel degree")
    pp: int = Field(default=1, ge=1, description="pipeline-parallel stages")
    vpp: int = Field(default=1, ge=1, description="virtual pipeline stages per rank (interleaved 1F1B when > 1)")
    pp_schedule: PipelineSchedule = Field(
        default="1f1b", description="pipeline schedule: 1f1b (Megatron-LM's, interleaved with vpp > 1) or dualpipe "
                                    "(DeepSeek-V3's bidirectional DualPipe: each rank holds two stages, and pairs a "
                                    "forward with a backward chunk to hide their communication; priced, not "
                                    "exported: estimators/pipeline.py)")
    cp: int = Field(default=1, ge=1, description="context-parallel degree (sequence split over ranks)")
    ep: int = Field(default=1, ge=1, description="expert-parallel degree: the routed experts of each MoE layer split "
                                                 "over ep ranks of the data-parallel (x context) group")
    etp: int | None = Field(default=None, ge=1,
                            description="expert tensor-parallel degree: each routed expert split over etp ranks "
                                        "(Megatron-Core --expert-tensor-parallel-size; None = tp, its default). "
                                        "With etp < tp the expert group folds over the tensor-parallel ranks "
                                        "(MoE parallel folding): ep x etp divides tp x dp x cp")
    dispatcher: DispatcherName = Field(
        default="alltoall", description="MoE token dispatcher: alltoall (Megatron-Core's NCCL all-to-all: every "
                                        "routed copy of a token travels) or deepep (DeepEP through Megatron's flex "
                                        "dispatcher: a token crosses to each remote node once, then NVLink)")
    ep_overlap: bool = Field(default=False, description="Megatron-Core's batch-level expert-parallel all-to-all "
                                                        "overlap (--overlap-moe-expert-parallel-comm): one micro-batch's "
                                                        "dispatch/combine hidden behind another's forward or backward "
                                                        "(estimators/ep_overlap.py)")
    comm_overlap: bool = Field(default=False, description="Megatron-Core's tensor- and data-parallel communication "
                                                          "overlap: --tp-comm-overlap (Transformer Engine userbuffers, "
                                                          "with sequence parallelism), --overlap-grad-reduce and, with "
                                                          "the distributed optimizer, --overlap-param-gather "
                                                          "(estimators/tp_overlap.py)")
    fsdp_grad_sync: FsdpGradSync = Field(
        default="micro_batch", description="when torch FSDP reduce-scatters gradients under accumulation: after every "
                                           "micro-batch (FSDP2's default), or once per step with the unsharded "
                                           "gradients held until then (FSDP1 no_sync, FSDP2 "
                                           "set_requires_gradient_sync(False), accelerate without sync_each_batch; "
                                           "estimators/fsdp_grad_sync.py)")
    fsdp_reduce_dtype: ReduceDtype = Field(
        default="auto", description="the dtype torch FSDP reduce-scatters gradients in (MixedPrecisionPolicy."
                                    "reduce_dtype): auto (fp32, bf16 under bf16-pure: torchtitan's and optplan's "
                                    "train.py's), fp32, or the recipe's 16-bit dtype (accelerate's, the Hugging Face "
                                    "Trainer's and Lightning's FSDP default; IBM's fms-fsdp; Composer's PURE): half "
                                    "the bytes; estimators/fsdp_grad_sync.py")
    async_tp: bool = Field(default=False, description="torch's async tensor parallelism (torchtitan "
                                                      "--parallelism.enable_async_tensor_parallel: Inductor's "
                                                      "micro-pipelined all-gather-matmul and matmul-reduce-scatter "
                                                      "over symmetric memory, inside one NVLink node; torch engine, "
                                                      "sequence parallel, compiled; estimators/async_tp.py)")
    sp: bool = Field(default=False, description="sequence parallelism inside the tensor-parallel group")
    flash: bool = Field(default=True, description="memory-efficient (flash) attention: no s x s scores stored")
    compile: bool = Field(default=False, description="torch.compile of each repeated block (torch and deepspeed "
                                                     "engines): Inductor fuses the elementwise ops between GEMMs, "
                                                     "priced as fused kernels; eager (False) is priced by the "
                                                     "measured per-operator count (estimators/eager_traffic.py)")
    compile_loss: bool | None = Field(
        default=None, description="torch.compile of the loss function (outside the model; torch and deepspeed "
                                  "engines): Inductor's fused cross entropy holds the logits and their gradient "
                                  "only (estimators/compiled_loss.py); None follows compile (torchtitan compiles "
                                  "its loss with its blocks, and so does optplan's training loop)")
    offload_optimizer: OffloadTarget = "none"
    offload_params: OffloadTarget = "none"
    engine: EngineName = "deepspeed"
    quant: QuantName = Field(default="none", description="frozen base weights of a LoRA fine-tune: 16-bit (none), "
                                                         "int8, nf4 or nf4-dq (bitsandbytes, QLoRA)")

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            opt = data.get("optimizer")
            if isinstance(opt, str) and opt in OPTIMIZER_ALIASES:
                data["optimizer"] = OPTIMIZER_ALIASES[opt]
            if data.get("sp") is None:
                # Megatron's recommended default with TP; the torch engine follows the model's own tp_plan, and
                # transformers has no sequence parallelism (estimators/tensor_plan.py)
                data["sp"] = int(data.get("tp") or 1) > 1 and data.get("engine") != "torch"
        return data

    @model_validator(mode="after")
    def _check(self) -> Strategy:
        if self.fsdp != "none" and self.zero > 0:
            raise ValueError("choose --zero (DeepSpeed ZeRO) or --fsdp (torch FSDP), not both")
        if self.fsdp != "none" and self.engine != "torch":
            raise ValueError("FSDP runs on the torch engine: use --engine torch with --fsdp")
        if self.engine == "torch" and self.zero > 0:
            raise ValueError("the torch engine shards with FSDP: use --fsdp full|grad_op|hybrid instead of --zero")
        if self.engine == "megatron" and self.zero > 1:
            raise ValueError("Megatron's distributed optimizer shards optimizer states only: use --zero 0 or 1")
        if self.engine == "megatron" and (self.offload_optimizer != "none" or self.offload_params != "none"):
            raise ValueError("offload is modelled for the deepspeed and torch engines: drop --offload or change --engine")
        if self.engine == "torch":
            if self.offload_optimizer != "none":
                raise ValueError("torch FSDP offloads parameters, gradients and the optimizer step together: "
                                 "use --offload params")
            if self.offload_params != "none" and self.fsdp == "none":
                raise ValueError("parameter offload on the torch engine needs FSDP (--fsdp full|grad_op|hybrid)")
            if self.offload_params == "nvme":
                raise ValueError("torch FSDP offloads to CPU only: use cpu, not nvme")
        else:
            if self.offload_params != "none" and self.zero != 3:
                raise ValueError("parameter offload needs ZeRO stage 3 (--zero 3)")
            if self.offload_optimizer != "none" and self.zero == 0:
                raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3 (--zero 1..3)")
            if self.offload_optimizer == "nvme" and self.zero != 3:  # stages 1-2 keep an offloaded optimizer in RAM
                raise ValueError("NVMe optimizer offload needs ZeRO stage 3 (ZeRO-Infinity): use --zero 3, or "
                                 "--offload-optimizer cpu")
        if self.quant != "none":
            if self.precision == "fp8":  # bitsandbytes' 4-bit layers dequantise to 16-bit GEMMs, never fp8 ones
                raise ValueError(f"{QUANT_FP8_PROBLEM}: use --precision bf16, not fp8")
            if self.engine == "megatron":
                raise ValueError("a quantised base (QLoRA) runs on the torch or deepspeed engine: use --engine torch")
            if self.engine != "torch" and (self.offload_optimizer != "none" or self.offload_params != "none"):
                raise ValueError("offload is not modelled with a quantised base: drop --offload or --quant")
        if self.optimizer in PAGED_OPTIMIZERS:
            if self.engine != "torch":
                raise ValueError(f"--optimizer {self.optimizer} (bitsandbytes' paged optimizer) runs in a torch "
                                 "training loop: use --engine torch, or --optimizer adamw/adamw8bit")
            if self.offload_params != "none":
                raise ValueError(f"--optimizer {self.optimizer} pages its state itself: drop --offload params")
        if self.checkpoint_layers is not None:
            if self.checkpointing != "full":
                raise ValueError(f"--checkpoint-layers {self.checkpoint_layers} picks the blocks full checkpointing "
                                 "recomputes: add --checkpointing full, or drop --checkpoint-layers")
            if self.quant != "none":
                raise ValueError("--checkpoint-layers is not modelled with a quantised base (its kept layer inputs "
                                 "assume every block checkpointed or none): drop --checkpoint-layers, or --quant")
            if self.vpp > 1 or self.pp_schedule == "dualpipe":
                raise ValueError("--checkpoint-layers counts the blocks of one pipeline stage, and is not modelled "
                                 "with virtual stages or DualPipe: use --vpp 1 and --pp-schedule 1f1b, or drop "
                                 "--checkpoint-layers")
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism needs tensor parallelism: set --tp > 1 or --no-sp")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("virtual pipeline stages need pipeline parallelism: set --pp > 1 or --vpp 1")
        if self.vpp > 1 and self.grad_accum % self.pp:
            raise ValueError(f"the interleaved schedule needs micro-batches ({self.grad_accum}) divisible by "
                             f"--pp {self.pp}: change --gas/--global-batch or use --vpp 1")
        if self.ep > 1 and self.engine != "megatron":
            raise ValueError("expert parallelism is modelled on Megatron-LM (--expert-model-parallel-size): use "
                             "--engine megatron, or --ep 1")
        if self.dispatcher != "alltoall" and (self.ep == 1 or self.engine != "megatron"):
            raise ValueError(f"--dispatcher {self.dispatcher} dispatches the tokens of expert parallelism on Megatron-LM: "
                             "use --ep > 1 with --engine megatron, or --dispatcher alltoall")
        if self.checkpointing == "moe" and self.engine != "megatron":
            raise ValueError("--checkpointing moe recomputes the MoE layers the Megatron-LM way (--recompute-modules "
                             "moe): use --engine megatron, or --checkpointing selective|full")
        if self.ep_overlap:
            if self.ep == 1 or self.engine != "megatron":
                raise ValueError("--ep-overlap hides the all-to-alls of expert parallelism on Megatron-LM: use --ep > 1 "
                                 "with --engine megatron, or drop --ep-overlap")
            if self.checkpointing in OVERLAP_EXCLUDED_RECOMPUTE:
                raise ValueError(f"Megatron-LM's all-to-all overlap excludes {self.checkpointing} recomputation: use "
                                 "--checkpointing selective|none, or drop --ep-overlap")
            if self.precision not in OVERLAP_PRECISIONS:
                raise ValueError(f"Megatron-LM's all-to-all overlap needs a bf16 or fp16 model, not {self.precision}: "
                                 "use --precision bf16, or drop --ep-overlap")
            if self.pp > 1 and self.vpp == 1:
                raise ValueError("Megatron-LM's all-to-all overlap needs virtual pipeline stages with --pp > 1: set "
                                 "--vpp >= 2, or drop --ep-overlap")
        if self.comm_overlap:
            if self.engine != "megatron":
                raise ValueError("--comm-overlap is Megatron-LM's tensor/data-parallel overlap (--tp-comm-overlap, "
                                 "--overlap-grad-reduce): use --engine megatron, or drop --comm-overlap")
            if self.tp > 1 and not self.sp:
                raise ValueError("Megatron-LM overlaps tensor-parallel communication only with sequence parallelism: "
                                 "drop --no-sp, or drop --comm-overlap")
        if self.async_tp:
            if self.engine != "torch" or self.tp <= 1:
                raise ValueError("--async-tp is torch's micro-pipelined tensor parallelism: use --engine torch with "
                                 "--tp > 1 (Megatron-LM: --comm-overlap), or drop --async-tp")
            if not self.sp or not self.compile:
                raise ValueError("--async-tp fuses the sequence-parallel all-gathers and reduce-scatters with their "
                                 "matmuls in torch.compile's graphs: add --sp and --compile, or drop --async-tp")
        if self.compile and self.engine == "megatron":
            raise ValueError("--compile compiles the model's blocks with torch.compile (torch and deepspeed engines); "
                             "Megatron-LM runs its own fused kernels: drop --compile, or use --engine torch")
        if self.compile_loss and self.engine == "megatron":
            raise ValueError("--compile-loss compiles the training loop's loss function with torch.compile (torch and "
                             "deepspeed engines); Megatron-LM runs its own fused cross entropy: drop --compile-loss, "
                             "or use --engine torch")
        if self.fsdp_grad_sync == "step" and (self.engine != "torch" or self.fsdp == "none"):
            raise ValueError("--fsdp-grad-sync step defers torch FSDP's gradient reduce-scatter to the last "
                             "micro-batch: use --engine torch with --fsdp full|grad_op|hybrid, or drop it")
        if self.fsdp_reduce_dtype != "auto":
            if self.engine != "torch" or self.fsdp == "none":
                raise ValueError(f"--fsdp-reduce-dtype {self.fsdp_reduce_dtype} sets torch FSDP's gradient "
                                 "reduce-scatter dtype: use --engine torch with --fsdp full|grad_op|hybrid, or drop it")
            if not reduce_dtype_fits(self.precision, self.fsdp_reduce_dtype):
                low = SIXTEEN_BIT_WEIGHTS.get(self.precision)
                fix = (f"use --fsdp-reduce-dtype {low} or fp32" if low else
                       "use --fsdp-reduce-dtype fp32, or a recipe with 16-bit weights (bf16, fp16, bf16-pure, fp8)")
                raise ValueError(f"--fsdp-reduce-dtype {self.fsdp_reduce_dtype} does not match precision "
                                 f"{self.precision} (FSDP reduces in fp32 or the dtype it gathers the weights in): "
                                 f"{fix}")
        if self.pp_schedule == "dualpipe":
            if self.engine != "megatron":
                raise ValueError("--pp-schedule dualpipe prices DeepSeek's DualPipe on Megatron-Core's model of the "
                                 "layers: use --engine megatron, or --pp-schedule 1f1b")
            if self.pp < 2 or self.pp % 2:
                raise ValueError(f"DualPipe pairs stage r with stage p-1-r: --pp must be even and >= 2 (got {self.pp})")
            if self.vpp > 1:
                raise ValueError("DualPipe is not interleaved: use --vpp 1 with --pp-schedule dualpipe")
            if self.grad_accum % 2 or self.grad_accum < 2 * self.pp:
                raise ValueError(f"DualPipe runs an even number of micro-batches, at least 2 x --pp = {2 * self.pp} "
                                 f"(got {self.grad_accum}): raise --gas/--global-batch")
            if self.ep_overlap:
                raise ValueError("DualPipe overlaps the all-to-alls itself: drop --ep-overlap (Megatron-LM's overlap)")
        if self.etp is not None and self.etp != self.tp and self.engine != "megatron":
            raise ValueError(f"--etp {self.etp} splits the experts unlike the other layers, which Megatron-LM does "
                             "(--expert-tensor-parallel-size): use --engine megatron, or drop --etp")
        if self.etp is None or self.etp == self.tp:
            if self.ep > 1 and (self.dp * self.cp) % self.ep:
                raise ValueError(f"--ep {self.ep} must divide the data-parallel x context-parallel ranks "
                                 f"{self.dp * self.cp} (Megatron-Core carves the expert group out of them): change "
                                 "--ep, or fold it over tensor parallelism with --etp 1")
        elif (self.tp * self.dp * self.cp) % (self.ep * self.etp):
            raise ValueError(f"--ep {self.ep} x --etp {self.etp} must divide the tensor x data x context-parallel "
                             f"ranks {self.tp * self.dp * self.cp} of a pipeline stage (Megatron-Core's expert "
                             "mesh folds over them): change --ep or --etp")
        if self.pp > 1 and self.engine == "deepspeed" and self.zero >= 2:
            raise ValueError("DeepSpeed's pipeline engine supports ZeRO-1 at most: use --zero 0|1 with --pp > 1")
        return self

    @property
    def expert_tp(self) -> int:
        """Ranks each routed expert is split over: ``etp``, or ``tp`` when unset (Megatron-Core's default)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel ranks: replicas of one expert shard in a pipeline stage, tp·dp·cp / (ep·etp)
        (Megatron-Core's expert mesh, MoE parallel folding: Liu et al. 2025, arXiv 2504.14960 §3)."""
        return self.tp * self.dp * self.cp // (self.ep * self.expert_tp)

    @property
    def world_size(self) -> int:
        """GPUs the strategy occupies: dp·tp·pp·cp."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: mbs x grad_accum x dp."""
        return self.mbs * self.grad_accum * self.dp

    @property
    def shard_stage(self) -> int:
        """The ZeRO stage of the data-parallel sharding, whether DeepSpeed's or FSDP's (0-3)."""
        return max(self.zero, FSDP_STAGE[self.fsdp])

    @property
    def dualpipe(self) -> bool:
        """True under DualPipe (validation guarantees its even pp >= 2 and its >= 2·pp micro-batches)."""
        return self.pp_schedule == "dualpipe"

    @property
    def loss_compiled(self) -> bool:
        """Whether the training loop runs its loss function compiled by torch.compile: ``compile_loss`` when set,
        else ``compile`` (never on Megatron-LM, which runs its own fused cross entropy)."""
        if self.engine == "megatron":
            return False
        return self.compile if self.compile_loss is None else self.compile_loss

    @property
    def model_parallel(self) -> bool:
        """True when tensor, pipeline or context parallelism is used."""
        return self.tp > 1 or self.pp > 1 or self.cp > 1 or self.ep > 1

    def label(self) -> str:
        """Short human label, e.g. 'bf16 ZeRO-2 mbs8x4 ckpt', 'bf16 tp4 pp2 ZeRO-1 mbs1x16' or 'bf16 DDP mbs8x1
        [torch]' (the torch engine unsharded: DistributedDataParallel, never a ZeRO stage)."""
        parts = [self.precision]
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) > 1:
                parts.append(f"{name}{getattr(self, name)}")
        if self.expert_tp != self.tp:
            parts.append(f"etp{self.expert_tp}")
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.pp_schedule != "1f1b":
            parts.append(self.pp_schedule)
        if self.tp > 1 and not self.sp:
            parts.append("no-sp")
        parts.append(sharding_name(self.engine, self.zero, self.fsdp))
        parts.append(f"mbs{self.mbs}x{self.grad_accum}")
        if self.checkpointing == "full":
            parts.append("ckpt" if self.checkpoint_layers is None else f"ckpt{self.checkpoint_layers}")
        elif self.checkpointing == "selective":
            parts.append("sel-ckpt")
        elif self.checkpointing == "moe":
            parts.append("moe-ckpt")
        if self.offload_optimizer != "none":
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_params != "none":
            parts.append(f"params->{self.offload_params}")
        if self.quant != "none":
            parts.append(f"base-{self.quant}")
        if self.dispatcher != "alltoall":
            parts.append(self.dispatcher)
        if self.ep_overlap:
            parts.append("a2a-overlap")
        if self.comm_overlap:
            parts.append("comm-overlap")
        if self.async_tp:
            parts.append("async-tp")
        if self.fsdp_grad_sync == "step":
            parts.append("grad-sync-step")
        if self.fsdp_reduce_dtype != "auto":
            parts.append(f"reduce-{self.fsdp_reduce_dtype}")
        if self.compile:
            parts.append("compile" if self.loss_compiled else "compile(eager-loss)")
        elif self.loss_compiled:
            parts.append("compiled-loss")
        if self.engine != UNTAGGED_ENGINE:
            parts.append(f"[{self.engine}]")
        return " ".join(parts)
