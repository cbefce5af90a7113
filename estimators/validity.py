"""Checks that a strategy can run a model on a cluster; each failure is one OptplanError line with the fix."""

from __future__ import annotations

from optplan.estimators.errors import OptplanError
from optplan.estimators.expert_parallel import DEEPEP_GPUS
from optplan.estimators.hardware import Cluster
from optplan.estimators.parallel import layers_per_stage, placement
from optplan.estimators.pipeline_layout import MAX_EXTRA_STAGES
from optplan.estimators.precision import require_precision
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import EngineName, Strategy

UNEVEN_INTERLEAVING_ENGINES: tuple[EngineName, ...] = ("megatron", "torch")
"""Engines that run an interleaved schedule over layers pp·vpp does not divide (check_strategy's docstring)."""


def check_strategy(profile: ModelProfile, cluster: Cluster, strategy: Strategy) -> None:
    """Raise OptplanError when ``strategy`` cannot run ``profile`` on ``cluster``.

    Rules (Megatron-LM's argument checks, ``megatron/training/arguments.py``): tp divides the attention
    heads and the key-value heads (a tp group larger than a node is allowed: it is priced over the
    inter-node link, see ``parallel.placement_notes``; the search keeps tp inside a node); pp (× vpp) is at most the number of layers,
    and interleaving needs the layers divisible by pp·vpp except on Megatron-LM, whose custom pipeline layout places
    an uneven split (estimators/pipeline_layout.py), and on the torch engine, whose pipeline stages are any split of
    the blocks (torch.distributed.pipelining; torchtitan's ``generate_split_points`` gives the extra layers to the
    middle stages, the balanced layout of pipeline_layout.py);
    context parallelism splits the sequence into 2·cp chunks (load-balanced causal attention); the
    world size dp·tp·pp·cp fits the cluster.
    """
    s = strategy
    require_precision(cluster.gpu, s.precision)
    shape = profile.transformer
    if s.tp > 1:
        if shape is None:
            raise OptplanError(f"--tp {s.tp} needs a transformer (attention heads to split), and {profile.name} "
                               "has no transformer shape: use --tp 1")
        if shape.heads % s.tp:
            raise OptplanError(f"--tp {s.tp} does not divide the {shape.heads} attention heads: use a divisor "
                               f"of {shape.heads}")
        if shape.kv_heads and shape.kv_heads % s.tp:
            raise OptplanError(f"--tp {s.tp} does not divide the {shape.kv_heads} key-value heads: use a "
                               f"divisor of {shape.kv_heads}")
    tp_nodes = placement(s, cluster.gpus_per_node).tp.nodes if s.async_tp else 1
    if tp_nodes > 1:
        raise OptplanError(f"--async-tp exchanges shards through symmetric memory over NVLink, inside one node, and "
                           f"--tp {s.tp} spans {tp_nodes} nodes of {cluster.gpus_per_node} GPUs: use a --tp that "
                           f"divides {cluster.gpus_per_node}, or drop --async-tp")
    moe = shape.moe if shape is not None else None
    for flag, value, fix, used in (("--ep", s.ep, "use --ep 1", s.ep > 1),
                                   ("--etp", s.etp, "drop --etp", s.etp is not None and s.etp != s.tp)):
        if used and moe is None:
            raise OptplanError(f"{flag} {value} splits the experts of MoE layers, and {profile.name} has none: {fix}")
    if moe is not None and moe.experts % s.ep:
        raise OptplanError(f"--ep {s.ep} does not divide the {moe.experts} experts: use a divisor of {moe.experts}")
    if moe is not None and s.engine == "megatron" and moe.moe_ffn % s.expert_tp:  # Megatron splits the experts so
        flag = "--tp" if s.etp is None else "--etp"
        raise OptplanError(f"{flag} {s.expert_tp} does not divide the experts' FFN width {moe.moe_ffn} (expert tensor "
                           f"parallelism splits it): use a divisor of {moe.moe_ffn}, or --etp 1")
    if s.checkpointing == "moe" and (shape is None or shape.moe is None):
        raise OptplanError(f"--checkpointing moe recomputes MoE layers, and {profile.name} has none: use "
                           "--checkpointing selective|full")
    if s.checkpoint_layers is not None:
        block = profile.repeated_block
        if block is None:
            raise OptplanError(f"--checkpoint-layers {s.checkpoint_layers}: {profile.name} has no repeated blocks to "
                               "checkpoint: drop --checkpoint-layers")
        on_stage = layers_per_stage(block.count, s.pp)
        if s.checkpoint_layers >= on_stage:
            raise OptplanError(f"--checkpoint-layers {s.checkpoint_layers} is not fewer than the {on_stage} blocks of "
                               f"a pipeline stage: use 1-{on_stage - 1}, or drop it to checkpoint every block")
    if s.dispatcher == "deepep" and cluster.gpu.name not in DEEPEP_GPUS:
        raise OptplanError(f"--dispatcher deepep runs on {', '.join(DEEPEP_GPUS)} (NVLink with RDMA; DeepEP/HybridEP), "
                           f"not on {cluster.gpu.name}: use --dispatcher alltoall")
    plan = profile.tensor_plan
    if s.tp > 1 and s.sp and s.engine == "torch" and plan is not None and not plan.sequence_parallel:
        raise OptplanError(f"the torch engine splits {profile.name} by its own tp_plan, which has no sequence "
                           "parallelism (transformers does not wire it up): use --no-sp, or --engine megatron")
    if s.pp > 1:
        if profile.repeated_block is None:
            raise OptplanError(f"--pp {s.pp} needs repeated blocks to split into stages, and {profile.name} "
                               "has none: use --pp 1")
        layers = profile.repeated_block.count
        if s.pp > layers:
            raise OptplanError(f"--pp {s.pp} is larger than the {layers} layers: use --pp <= {layers}")
        spare = MAX_EXTRA_STAGES if s.engine == "megatron" else 0  # stages of only the embedding / the loss
        if s.pp * s.vpp > layers + spare:
            raise OptplanError(f"--pp {s.pp} x --vpp {s.vpp} stages exceed the {layers} layers"
                               + (" plus the embedding and the loss" if spare else "") + ": lower --vpp")
        if s.vpp > 1 and layers % (s.pp * s.vpp) and s.engine not in UNEVEN_INTERLEAVING_ENGINES:
            raise OptplanError(f"the interleaved schedule needs the {layers} layers divisible by pp·vpp = "
                               f"{s.pp * s.vpp} (Megatron-LM and torch.distributed.pipelining place an uneven "
                               "split, estimators/pipeline_layout.py): change --vpp or --pp, or use --engine "
                               "megatron|torch")
    if s.cp > 1:
        seq = profile.tokens_per_sample
        if not seq:
            raise OptplanError(f"--cp {s.cp} splits the sequence, and {profile.name} takes no token sequence: "
                               "use --cp 1")
        if seq % (2 * s.cp):
            raise OptplanError(f"--cp {s.cp} needs the sequence length {seq} divisible by 2·cp = {2 * s.cp}: "
                               "change --seq-len or --cp")
    if s.quant != "none" and profile.adapter is None:
        raise OptplanError(f"--quant {s.quant} quantises the frozen base of a LoRA fine-tune, and {profile.name} was "
                           "profiled for full training: add --finetune qlora (or lora), or drop --quant")
    if profile.adapter is not None and s.engine == "megatron":
        raise OptplanError("LoRA adapters (peft) run on the torch or deepspeed engine, not Megatron-LM: use "
                           "--engine torch")
    if s.world_size > cluster.gpus:
        raise OptplanError(f"the strategy needs dp·tp·pp·cp = {s.dp}·{s.tp}·{s.pp}·{s.cp} = {s.world_size} GPUs "
                           f"which exceeds the {cluster.gpus} GPUs given: lower the degrees or raise --gpus")
