"""The search space: every legal Strategy for a model on a cluster, grouped for pruned enumeration.

Axes (design.md "Strategy: what is searched"): GPU count (one, or a ``--gpus-range``), the parallel layout
(tp, pp, vpp, cp; dp = the rest), the engine and its data-parallel sharding and offload, the precision
recipe, the optimizer, activation checkpointing, the micro-batch and gradient accumulation.

Legality follows Megatron-LM's argument checks (``megatron/training/arguments.py``): tp divides the
attention and key-value heads and stays inside a node; pp (x vpp) is at most the layer count, an uneven split
placed by a custom pipeline layout (``--pipeline-model-parallel-layout``, estimators/pipeline_layout.py), and,
interleaved, the micro-batches divide by pp; cp splits the sequence into 2·cp chunks. Which engine runs
which layout:

- DeepSpeed (ZeRO 0-3, CPU offload of the optimizer, and of the parameters under ZeRO-3) and plain torch
  (DDP, FSDP FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD across nodes, FSDP CPU offload) run data-parallel
  layouts: these are the plans a ``ds_config.json`` / ``accelerate.yaml`` launches as they are;
- Megatron-LM (ZeRO-0, or its distributed optimizer = ZeRO-1) runs every layout of a transformer, and is
  the engine for pipeline and context parallelism;
- plain torch also runs tensor parallelism for a model that carries its own plan (a Hugging Face ``tp_plan``,
  estimators/tensor_plan.py): tp alone, FSDP2 over the data-parallel ranks (or no data parallelism), which
  ``from_pretrained(tp_plan="auto")`` / accelerate's ParallelismConfig launch.

A *group* is a point of every axis except the micro-batch: per-GPU memory grows with the micro-batch, so
the search prices a group's micro-batches in ascending order and stops at the first that does not fit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from math import gcd
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.ep_overlap import recipe_allows_overlap
from optplan.estimators.errors import OptplanError
from optplan.estimators.expert_parallel import DEEPEP_GPUS
from optplan.estimators.hardware import Cluster
from optplan.estimators.parallel import group_nodes
from optplan.estimators.precision import require_precision
from optplan.estimators.profile import ModelProfile, TransformerShape
from optplan.estimators.strategy import CheckpointName as CheckpointMode
from optplan.estimators.strategy import EngineName, ReduceDtype, Strategy, reduce_dtype_fits, sharding_name
from optplan.planner.sparse_grads import check_sparse_optimizers

MAX_MICRO_BATCH = 1024
MAX_VPP = 8
MAX_CP = 16
MIN_TOKENS_PER_CP_RANK = 1024
"""Context parallelism below ~1k tokens per rank only adds ring traffic (Megatron-LM's CP guide targets
sequences of 8k and more); such splits are not searched."""
FREE_BATCH_PIPELINE_MULTIPLES = (1, 2, 4)
"""With a free global batch a pipeline of p stages gets p, 2p or 4p micro-batches per step (bubble
(p-1)/(m+p-1): Narayanan et al. 2021 eq. 1 keeps it under ~20% at 4p)."""
SEARCHED_PRECISIONS_BF16 = ("bf16", "amp-bf16", "fp32")
SEARCHED_PRECISIONS_NO_BF16 = ("fp16", "amp-fp16", "fp32")
MEGATRON_PRECISIONS = ("bf16", "fp16", "fp32", "fp8", "bf16-pure")
"""Megatron-LM keeps 16-bit parameters with fp32 main copies (or fp32 throughout); it has no autocast recipe."""
ENGINES: tuple[EngineName, ...] = ("deepspeed", "torch", "megatron")


class Layout(NamedTuple):
    """Where the GPUs go: world = dp·tp·pp·cp."""

    gpus: int
    dp: int
    tp: int
    pp: int
    vpp: int
    cp: int
    ep: int = 1
    dispatcher: str = "alltoall"
    ep_overlap: bool = False
    etp: int | None = None
    """Expert tensor-parallel degree (None: tp, Megatron's default; 1 with tp > 1: the experts folded whole over
    the tensor-parallel ranks)."""

    @property
    def model_parallel(self) -> bool:
        return self.tp > 1 or self.pp > 1 or self.cp > 1 or self.ep > 1


class Sharding(NamedTuple):
    """The engine and its data-parallel sharding and offload."""

    engine: EngineName
    zero: int = 0
    fsdp: str = "none"
    offload_optimizer: str = "none"
    offload_params: str = "none"

    def label(self) -> str:
        what = sharding_name(self.engine, self.zero, self.fsdp)
        off = [n for n, v in (("optimizer", self.offload_optimizer), ("params", self.offload_params)) if v != "none"]
        return f"{self.engine} {what}" + (f" + CPU offload of {' and '.join(off)}" if off else "")


class Group(NamedTuple):
    """Every axis but the micro-batch (and the accumulation, derived from it)."""

    layout: Layout
    sharding: Sharding
    precision: str
    optimizer: str
    checkpointing: CheckpointMode
    quant: str = "none"
    compile_blocks: bool = False
    fsdp_reduce_dtype: str = "auto"


class SearchSpace(BaseModel):
    """The axes of the search. ``global_batch`` None means free (see ``accumulations``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpus_per_node: int = Field(ge=1)
    layouts: tuple[Layout, ...]
    shardings: tuple[Sharding, ...]
    precisions: tuple[str, ...]
    optimizers: tuple[str, ...]
    checkpointing: tuple[CheckpointMode, ...]
    global_batch: int | None = None
    max_micro_batch: int = MAX_MICRO_BATCH
    quant: str = "none"
    torch_tp: bool = Field(default=False, description="the torch engine also runs tensor-parallel layouts, split by "
                                                      "the model's own tp_plan (FSDP2 over the data-parallel ranks)")
    partial_checkpointing: bool = Field(
        default=False, description="each fitting plan with full checkpointing is followed by its partial ones: the "
                                   "fewest first blocks of each stage that fit (planner/partial.py; --checkpointing "
                                   "partial, or no --checkpointing)")
    compile_blocks: bool = Field(default=False, description="torch and DeepSpeed plans torch.compile each repeated "
                                                            "block (Strategy.compile)")
    fsdp_reduce_dtype: ReduceDtype = Field(
        default="auto", description="the dtype torch FSDP plans reduce gradients in where their recipe takes it "
                                    "(Strategy.fsdp_reduce_dtype; the others keep auto): the user's trainer's, not "
                                    "searched")

    @property
    def gpu_counts(self) -> tuple[int, ...]:
        return tuple(sorted({lay.gpus for lay in self.layouts}))

    @property
    def dp(self) -> int:
        """The data-parallel degree of the plain data-parallel layout at the largest GPU count."""
        return max(lay.dp for lay in self.layouts if not lay.model_parallel)

    @property
    def optimizer(self) -> str:
        return self.optimizers[0]

    def shardings_for(self, layout: Layout) -> tuple[Sharding, ...]:
        """The engine/sharding choices that can run ``layout``."""
        out = []
        for sh in self.shardings:
            if layout.model_parallel and sh.engine != "megatron" and not self._torch_tp_runs(layout, sh):
                continue
            if sh.fsdp == "hybrid" and layout.dp <= self.gpus_per_node:
                continue  # HSDP replicates across nodes: one node is plain FULL_SHARD
            if layout.dp == 1 and (sh.zero > 0 or sh.fsdp != "none") and sh.offload_optimizer == "none" \
                    and sh.offload_params == "none":
                continue  # sharding over one rank is the unsharded plan with extra bookkeeping
            out.append(sh)
        return tuple(out)

    def _torch_tp_runs(self, layout: Layout, sharding: Sharding) -> bool:
        """The torch engine runs tensor parallelism alone (no pipeline or context split) by the model's tp_plan,
        as transformers' ``DistributedConfig`` launches it: FSDP2 FULL_SHARD (HSDP across nodes) over the
        data-parallel ranks, or no data parallelism at all. It has no SHARD_GRAD_OP (``fully_shard`` with
        ``reshard_after_forward=True``) and no DDP beside TP (nor has accelerate's ParallelismConfig)."""
        if not self.torch_tp or sharding.engine != "torch" or layout.pp > 1 or layout.cp > 1:
            return False
        return sharding.fsdp in ("full", "hybrid") if layout.dp > 1 else sharding.fsdp == "none"

    def precisions_for(self, sharding: Sharding) -> tuple[str, ...]:
        if sharding.engine == "megatron":
            return tuple(p for p in self.precisions if p in MEGATRON_PRECISIONS)
        return tuple(p for p in self.precisions if p != "fp8" or (sharding.engine == "torch" and self.quant == "none"))

    def groups(self) -> Iterator[Group]:
        """Every group in a fixed order (deterministic)."""
        for layout in self.layouts:
            for sharding in self.shardings_for(layout):
                for precision in self.precisions_for(sharding):
                    for optimizer in self.optimizers:
                        if sharding.offload_optimizer != "none" and optimizer != "adamw":
                            continue  # DeepSpeed's CPU optimizer is Adam/AdamW only
                        for ckpt in self.checkpointing:
                            yield Group(layout, sharding, precision, optimizer, ckpt, self.quant,
                                        self.compile_blocks, self.fsdp_reduce_dtype)

    def micro_batches(self, layout: Layout) -> tuple[int, ...]:
        """Micro-batches per GPU, ascending: divisors of the per-replica batch when it is fixed, else powers
        of two."""
        if self.global_batch is None:
            return _powers_of_two_upto(self.max_micro_batch)
        if self.global_batch % layout.dp:
            return ()
        per_replica = self.global_batch // layout.dp
        return tuple(b for b in range(1, min(per_replica, self.max_micro_batch) + 1) if per_replica % b == 0)

    def accumulations(self, layout: Layout, mbs: int) -> tuple[int, ...]:
        """Gradient-accumulation steps for ``mbs``: fixed by the global batch, else 1 (pipelines: 1-4 x pp)."""
        if self.global_batch is not None:
            return (self.global_batch // (layout.dp * mbs),)
        if layout.pp == 1:
            return (1,)
        return tuple(layout.pp * k for k in FREE_BATCH_PIPELINE_MULTIPLES)

    @property
    def size(self) -> int:
        """Number of candidate strategies (before memory pruning)."""
        total = 0
        for group in self.groups():
            for mbs in self.micro_batches(group.layout):
                total += len(self.accumulations(group.layout, mbs))
        return total


def strategy_of(group: Group, mbs: int, grad_accum: int) -> Strategy | None:
    """The Strategy at one point, or None when the combination is not legal (Strategy's own rules). A layout's
    all-to-all overlap is dropped where the group's recipe forbids it (full recomputation, fp32). Megatron plans
    overlap their tensor- and data-parallel communication (``comm_overlap``: --tp-comm-overlap,
    --overlap-grad-reduce, --overlap-param-gather, as NVIDIA's own recipes run; estimators/tp_overlap.py): it hides
    time and costs no memory in the model, so the plan without it is dominated and not searched."""
    lay, sh = group.layout, group.sharding
    if lay.ep_overlap and not recipe_allows_overlap(group.precision, group.checkpointing):
        lay = lay._replace(ep_overlap=False)
    try:
        return Strategy(precision=group.precision, optimizer=group.optimizer, zero=sh.zero,  # type: ignore[arg-type]
                        fsdp=sh.fsdp, mbs=mbs, grad_accum=grad_accum,  # type: ignore[arg-type]
                        checkpointing=group.checkpointing, dp=lay.dp, tp=lay.tp, pp=lay.pp, vpp=lay.vpp,
                        cp=lay.cp, ep=lay.ep, etp=lay.etp, dispatcher=lay.dispatcher,  # type: ignore[arg-type]
                        ep_overlap=lay.ep_overlap, comm_overlap=sh.engine == "megatron",
                        compile=group.compile_blocks and sh.engine != "megatron",
                        fsdp_reduce_dtype=reduce_dtype_for(group),  # type: ignore[arg-type]
                        offload_optimizer=sh.offload_optimizer,  # type: ignore[arg-type]
                        offload_params=sh.offload_params, engine=sh.engine,  # type: ignore[arg-type]
                        quant=group.quant)  # type: ignore[arg-type]
    except ValueError:
        return None


def reduce_dtype_for(group: Group) -> str:
    """The group's ``fsdp_reduce_dtype`` where its plan takes it (torch FSDP; ``bf16``/``fp16`` over the recipe whose
    weights are gathered in that dtype), else ``auto``: the user's dtype is their trainer's, which runs the other
    engines and recipes its own way (estimators/fsdp_grad_sync.py)."""
    want, sh = group.fsdp_reduce_dtype, group.sharding
    if want == "auto" or sh.engine != "torch" or sh.fsdp == "none":
        return "auto"
    return want if reduce_dtype_fits(group.precision, want) else "auto"


def _powers_of_two_upto(limit: int) -> tuple[int, ...]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return tuple(out)


def check_global_batch(global_batch: int | None, gpus: int) -> None:
    """A fixed global batch must be positive."""
    if global_batch is not None and global_batch < 1:
        raise OptplanError(f"--global-batch must be >= 1 (got {global_batch})")


def check_precisions(cluster: Cluster, precisions: Sequence[str]) -> None:
    """Every named precision must exist and have math on the cluster's GPU."""
    for name in precisions:
        require_precision(cluster.gpu, name)


def parse_gpus_range(text: str, gpus_per_node: int) -> tuple[int, ...]:
    """``LO:HI`` -> the GPU counts to plan: 2^k and 3·2^k in [LO, HI] that launch (a power of two inside one
    node, whole nodes beyond it)."""
    parts = text.split(":")
    try:
        lo, hi = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or hi is None or lo < 1 or hi < lo:
        raise OptplanError(f"--gpus-range {text!r} is not LO:HI with 1 <= LO <= HI (e.g. 8:1024)")
    counts = set()
    v = 1
    while v <= hi:
        for n in (v, 3 * v):
            if lo <= n <= hi and ((n <= gpus_per_node and gpus_per_node % n == 0) or n % gpus_per_node == 0):
                counts.add(n)
        v *= 2
    if not counts:
        raise OptplanError(f"--gpus-range {text} holds no launchable GPU count (a divisor of the "
                           f"{gpus_per_node}-GPU node, or whole nodes): widen the range")
    return tuple(sorted(counts))


def _layouts(profile: ModelProfile, gpus: int, gpus_per_node: int, model_parallel: bool,
             torch_tp: bool = False, *, deepep: bool = False) -> list[Layout]:
    shape = profile.transformer
    block = profile.repeated_block
    tps, pps, cps = [1], [1], [1]
    if (model_parallel or torch_tp) and shape is not None:
        heads = gcd(shape.heads, shape.kv_heads or shape.heads)
        tps = [t for t in _powers_of_two_upto(gpus_per_node) if heads % t == 0]
    if model_parallel and shape is not None:
        seq = profile.tokens_per_sample or 0
        cps = [c for c in _powers_of_two_upto(MAX_CP) if c == 1 or (seq % (2 * c) == 0
                                                                   and seq // c >= MIN_TOKENS_PER_CP_RANK)]
    if model_parallel and block is not None and block.count > 1:
        # any pp up to the layer count: Megatron places a split that pp (x vpp) does not divide with a custom
        # pipeline layout (estimators/pipeline_layout.py), priced at its busiest rank's ceil(L/pp) layers
        pps = list(range(1, block.count + 1))
    out = []
    for tp in tps:
        for cp in cps:
            for pp in pps:
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                vpps = [1]
                if pp > 1 and block is not None:
                    # an even split where pp divides the layers (the plain flags); else a custom layout, at powers of
                    # two (the bubble shrinks as 1/vpp: 2, 4, 8 span the trade against memory without every step)
                    vpps += [v for v in range(2, MAX_VPP + 1) if pp * v <= block.count
                             and (block.count % (pp * v) == 0 if block.count % pp == 0 else v & (v - 1) == 0)]
                for etp, ep in _expert_splits(shape, tp, dp * cp, model_parallel):
                    # DeepEP pays only where the expert group leaves the node (a token crosses to each node once)
                    spans = ep > 1 and group_nodes(ep, etp or tp, gpus_per_node) > 1
                    dispatchers = ("alltoall", "deepep") if spans and deepep else ("alltoall",)
                    for v in vpps:
                        # Megatron's all-to-all overlap (estimators/ep_overlap.py) wherever its rules allow it: it
                        # hides communication and the memory model charges it nothing, so the plan without it is
                        # dominated and not searched (strategy_of drops it where the recipe forbids it)
                        overlap = ep > 1 and (pp == 1 or v > 1)
                        out.extend(Layout(gpus, dp, tp, pp, v, cp, ep, d, overlap, etp) for d in dispatchers)
    return out


def _expert_splits(shape: TransformerShape | None, tp: int, dpcp: int,
                   model_parallel: bool) -> list[tuple[int | None, int]]:
    """(etp, ep) pairs for an MoE shape on Megatron, (None, 1) for dense models.

    - etp None (= tp, Megatron's default): ep a power of two dividing the experts and dp·cp (Megatron-Core carves
      the expert group out of them).
    - With tp > 1, etp 1 (each expert whole, the expert group folded over the tensor-parallel ranks: MoE parallel
      folding, arXiv 2504.14960 §3) at ep >= tp dividing the experts and tp·dp·cp. At the same expert sharding
      ep·etp, etp 1 holds the same bytes and sends the same all-to-all bytes across the same nodes (over more
      peers: a little more of it inside the node) and skips the expert tensor-parallel gather and scatter of
      every routed copy (estimators/moe_comm.py), which outweighs that; so (etp tp, ep e > 1) is dropped
      wherever (etp 1, ep e·tp) is legal. (etp tp, ep 1) stays: the torch engine's tensor-parallel layouts and
      Megatron without expert parallelism. ep < tp with etp 1 (experts replicated inside the tensor-parallel
      group) is not searched. The split needs tp to divide the expert width (Megatron's rule)."""
    if not model_parallel or shape is None or shape.moe is None:
        return [(None, 1)]
    experts = shape.moe.experts
    powers = [e for e in _powers_of_two_upto(experts) if experts % e == 0]
    folded = [e for e in powers if tp > 1 and e >= tp and (tp * dpcp) % e == 0]
    split = [e for e in powers if dpcp % e == 0 and (e == 1 or e * tp not in folded) and shape.moe.moe_ffn % tp == 0]
    return [(None, e) for e in split] + [(1, e) for e in folded]


def _shardings(engines: Sequence[EngineName], multi_node: bool, offload: bool) -> tuple[Sharding, ...]:
    out: list[Sharding] = []
    for engine in engines:
        if engine == "deepspeed":
            out += [Sharding("deepspeed", z) for z in (0, 1, 2, 3)]
            if offload:
                out += [Sharding("deepspeed", z, offload_optimizer="cpu") for z in (1, 2, 3)]
                out.append(Sharding("deepspeed", 3, offload_optimizer="cpu", offload_params="cpu"))
        elif engine == "torch":
            out += [Sharding("torch"), Sharding("torch", fsdp="full"), Sharding("torch", fsdp="grad_op")]
            if multi_node:
                out.append(Sharding("torch", fsdp="hybrid"))
            if offload:
                out.append(Sharding("torch", fsdp="full", offload_params="cpu"))
        elif engine == "megatron":
            out += [Sharding("megatron", 0), Sharding("megatron", 1)]
    return tuple(out)


def build_space(profile: ModelProfile, cluster: Cluster, *, global_batch: int | None = None,
                precisions: Sequence[str] | None = None, optimizers: Sequence[str] | str | None = None,
                engines: Sequence[str] | None = None, gpu_counts: Sequence[int] | None = None,
                offload: bool = True, checkpointing: Sequence[str] | None = None,
                max_micro_batch: int = MAX_MICRO_BATCH, quant: str = "none",
                compile_blocks: bool = False, fsdp_reduce_dtype: str = "auto") -> SearchSpace:
    """The space for ``profile`` on ``cluster`` (at ``gpu_counts``, default the cluster's GPUs).

    Megatron (tensor/pipeline/context parallelism) is searched for transformers (the profile has a shape);
    the engines can be limited with ``engines``. Precisions default to bf16, AMP bf16 and fp32 (fp16 and
    AMP fp16 on GPUs without bf16); fp8 and bf16-pure change numerics and are searched only when named.

    A LoRA profile (``profile.adapter``) runs on the torch engine (DDP or FSDP, what TRL's SFTTrainer launches:
    finetune.py) without offload (its optimizer states are the adapters').
    """
    check_global_batch(global_batch, cluster.gpus)
    counts = tuple(gpu_counts) if gpu_counts else (cluster.gpus,)
    if precisions is None:
        usable = SEARCHED_PRECISIONS_BF16 if cluster.gpu.supports_bf16 else SEARCHED_PRECISIONS_NO_BF16
    else:
        check_precisions(cluster, precisions)
        usable = tuple(dict.fromkeys(precisions))
    if isinstance(optimizers, str):
        optimizers = (optimizers,)
    opts = tuple(dict.fromkeys(optimizers)) if optimizers else (profile.defaults.optimizer or "adamw",)
    opts = check_sparse_optimizers(profile, opts, named=bool(optimizers) or bool(profile.defaults.optimizer))
    chosen_engines = tuple(dict.fromkeys(engines)) if engines else ENGINES
    for e in chosen_engines:
        if e not in ENGINES:
            raise OptplanError(f"unknown --engine {e!r}: use one of {', '.join(ENGINES)}")
    if profile.transformer is None:
        chosen_engines = tuple(e for e in chosen_engines if e != "megatron") or chosen_engines
    if profile.adapter is not None:
        chosen_engines = ("torch",)
        offload = False
    model_parallel = "megatron" in chosen_engines and profile.transformer is not None
    torch_tp = ("torch" in chosen_engines and profile.tensor_plan is not None and profile.transformer is not None
                and profile.adapter is None)
    layouts: list[Layout] = []
    for n in counts:
        layouts += _layouts(profile, n, cluster.gpus_per_node, model_parallel, torch_tp,
                            deepep=cluster.gpu.name in DEEPEP_GPUS)
    if checkpointing is not None:
        named = tuple(dict.fromkeys(checkpointing))
        partial = "partial" in named  # found from the full plans: full is searched with it
        ckpt = tuple(dict.fromkeys(["full" if m == "partial" else m for m in named]))
        can = profile.supports_checkpointing or profile.transformer is not None
        if not can and set(ckpt) - {"none"}:
            raise OptplanError(f"--checkpointing {' '.join(m for m in ckpt if m != 'none')}: {profile.name} has no "
                               "repeated blocks to checkpoint: drop --checkpointing (or use none)")
        if "moe" in ckpt and (profile.transformer is None or profile.transformer.moe is None):
            raise OptplanError(f"--checkpointing moe recomputes MoE layers and {profile.name} has none: use none, "
                               "selective or full")
        if set(ckpt) <= {"moe"} and not model_parallel:
            engines_text = ", ".join(chosen_engines)
            raise OptplanError(f"--checkpointing moe is Megatron-LM's --recompute-modules moe and the search runs "
                               f"{engines_text}: add --engine megatron, or use none, selective or full")
    elif profile.supports_checkpointing or profile.transformer is not None:
        ckpt = ("none", "selective", "full") if profile.transformer is not None else ("none", "full")
        partial = True
        if profile.transformer is not None and profile.transformer.moe is not None and "megatron" in chosen_engines:
            ckpt += ("moe",)  # Megatron's --recompute-modules moe (estimators/moe_recompute.py)
    else:
        ckpt, partial = ("none",), False
    multi_node = max(counts) > cluster.gpus_per_node
    return SearchSpace(
        gpus_per_node=cluster.gpus_per_node, layouts=tuple(layouts),
        shardings=_shardings(chosen_engines, multi_node, offload), precisions=usable, optimizers=opts,
        checkpointing=ckpt, global_batch=global_batch, max_micro_batch=max_micro_batch,  # type: ignore[arg-type]
        quant=quant, torch_tp=torch_tp, compile_blocks=compile_blocks, partial_checkpointing=partial,
        fsdp_reduce_dtype=fsdp_reduce_dtype,  # type: ignore[arg-type]
    )
