"""MoE step-time fidelity against published, measured runs (issue 19): predicted against measured throughput, per run.

Data: ``benchmarks/data/moe_published.json``, one row per measured run with its model shape (Hugging Face config),
cluster, parallel layout, batch, precision, recompute, dispatcher, the measured figure with its definition and the
source (Megatron-Core's MoE README, NVIDIA's Megatron MoE Model Zoo, the NeMo Megatron-Bridge and AutoModel
performance summaries, DeepSeek-V3's technical report; its ``excluded`` list says what was left out and why).

Prediction, through optplan's own pipeline, for every row, with no per-row constant:

* the profile: ``estimators.arch.parse_arch`` + ``profile_from_arch`` on the row's shape (``--arch`` keys; MLA widths
  when the model has them);
* the plan: ``Strategy(engine="megatron", ...)`` with the row's tp/pp/vpp/cp/mbs/global batch, ``zero=1`` (Megatron's
  distributed optimizer), ``dispatcher="deepep"`` where the source dispatches with DeepEP/HybridEP on a GPU optplan's
  deepep dispatcher covers, and the closest supported settings where optplan lacks the source's (``plan``: every
  substitution is flagged on the row's line, legend at the end);
* the cluster: ``Cluster(gpu=find_gpu(...), gpus, gpus_per_node, inter_node_bandwidth_bytes_per_s)`` (H800: the H100
  SXM entry with its datasheet NVLink of 400 GB/s, 200 GB/s each way);
* ``estimators.estimate.estimate`` -> ``time.tokens_per_s / gpus``.

Like for like: every measured figure becomes tokens/s per GPU with the source's own definition (step time: global
batch x sequence ÷ step ÷ GPUs; TFLOP/s: ÷ the source's FLOPs per token, Megatron's formula of that date; GPU hours
per trillion tokens: 1e12 ÷ (hours x 3600)). The error of a row is predicted ÷ measured step time - 1 (as
benchmarks/fidelity_published.py), i.e. measured ÷ predicted throughput - 1.

Diagnostics (printed, never scored; the evidence for where and why the model misses): the exact model FLOPs per
token against the profile's (optplan's ``--arch`` has no head_dim key: Qwen3's q width 64·128 = 8192 is priced at
hidden 4096; MLA's qk/v head dims are priced at hidden/heads), the predicted all-to-all share, counterfactual ratios
per group (``Result.counterfactual``: exact FLOPs, a node-deduplicating dispatch as DeepEP/HybridEP do it, the
source's all-to-all overlap, the source's interleaving) and a probe with the flash-attention fractions doubled;
``Result.prototype`` combines the grounded counterfactuals and its MAPE is printed above the last line.

Run: ``python benchmarks/fidelity_moe.py [--write]`` (``--write`` also writes benchmarks/results/fidelity_moe.txt).
Last line: ``moe: MAPE X% over N runs``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.efficiency import efficiency_for
from optplan.estimators.estimate import Estimate, estimate
from optplan.estimators.expert_parallel import DEEPEP_GPUS
from optplan.estimators.hardware import Cluster, GPUSpec, find_gpu
from optplan.estimators.parallel import placement
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import CheckpointName, PrecisionName, Strategy
from optplan.estimators.timing import step_time

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "moe_published.json"
RESULTS = ROOT / "benchmarks" / "results" / "fidelity_moe.txt"
GIB = 2**30

REQUIRED = ("id", "set", "model", "shape", "gpu", "gpus", "gpus_per_node", "inter_node_gbit_per_gpu", "tp", "pp", "vpp",
            "cp", "ep", "etp", "mbs", "global_batch", "seq", "precision", "recompute", "dispatcher", "token_policy",
            "distributed_optimizer", "features", "measured", "memory", "source", "notes")
SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "gated", "tied", "experts", "topk",
              "moe_ffn", "shared_experts", "first_dense", "moe_every", "mla", "mtp_layers", "shape_source")
METRICS = ("tokens_per_s_per_gpu", "step_s", "model_tflops_per_gpu", "gpu_hours_per_trillion_tokens")
PRECISIONS: dict[str, PrecisionName] = {"bf16": "bf16", "fp8-cs": "fp8", "fp8-blockwise": "fp8", "mxfp8": "fp8"}
GPUS: dict[str, tuple[str, dict[str, float]]] = {
    "H100-SXM": ("H100-SXM", {}),
    "B200": ("B200", {}),
    # the H100 SXM die with NVLink cut to 400 GB/s bidirectional (NVIDIA H800 SXM datasheet); the entry keeps the
    # H100 name so the H100's fitted efficiency constants apply
    "H800": ("H100-SXM", {"intra_node_bandwidth_bytes_per_s": 200e9}),
}
NODE_DEDUP_DISPATCHERS = ("deepep", "hybridep", "deepseek-custom")
"""Dispatchers that send a token once to each remote node that holds any of its experts and fan it out over NVLink
there (DeepEP's internode kernels, HybridEP, DeepSeek-V3 §3.2.2), instead of once per routed expert."""
EXPERT_RECOMPUTE = ("moe",)
"""Megatron --recompute-modules that re-run the whole MoE layer (router, dispatch, experts: most of its GEMMs and its
all-to-alls): priced as optplan's moe recomputation (estimators/moe_recompute.py); the other modules (layernorm, moe_act, mla_up_proj, core_attn,
mlp = the dense layers' MLP, rmsnorm) are small and priced as its selective one (Megatron-LM arguments.py,
--recompute-modules)."""

FLAGS = {
    "hd": "head_dim x heads > hidden: optplan's --arch has no head_dim, attention priced at width hidden (see flops)",
    "mla": "MLA attention: its latent projections and its core at the query/key and value head widths are priced "
           "(estimators/compute.py), the core at the fused-attention kernel's efficiency for ordinary heads",
    "fold": "EP not dividing tp·dp·cp / ETP or the experts: ep clipped to a divisor of both",
    "vpp": "micro-batches not divisible by pp (interleaving needs whole groups of pp): vpp 1 (1F1B)",
    "rc": "Megatron --recompute-modules mapped to optplan's selective or moe recomputation (other modules: layernorm, moe_act, ... not modelled)",
    "fp8": "fp8 recipe (MXFP8 / blockwise) priced as Transformer Engine per-tensor fp8",
    "dd": "node-deduplicating dispatcher (DeepEP/HybridEP) across nodes on a GPU optplan's deepep dispatcher does not "
          "cover: optplan prices topk copies per token",
    "ov": "all-to-all overlapped with compute where optplan's ep_overlap cannot express it (DualPipe, or Megatron's "
          "overlap outside its rules as mapped): optplan exposes it",
    "dual": "DualPipe schedule whose layout optplan's pp_schedule dualpipe cannot take (odd pp, or fewer than 2·pp "
            "micro-batches): priced as 1F1B",
    "mtp": "multi-token-prediction module not in the profile",
    "fsdp": "FSDP (Megatron-FSDP / torch FSDP2) priced as Megatron's distributed optimizer (zero 1)",
    "torch": "PyTorch (AutoModel) engine priced as Megatron-Core",
    "gpu": "H800: H100 SXM entry with NVLink 200 GB/s each way",
    "bal": "load not forced balanced (aux-loss): optplan assumes a balanced router",
    "dpo": "overlapped gradient reduce-scatter / param all-gather without a stated tensor-parallel overlap (tp > 1): "
           "optplan's comm_overlap would add that one, so the plan exposes both",
}


def load() -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """(sources, rows, excluded) of the data file."""
    doc = json.loads(DATA.read_text(encoding="utf-8"))
    return doc["sources"], doc["rows"], doc["excluded"]


def check_row(row: dict[str, Any], sources: dict[str, Any]) -> list[str]:
    """What is missing or inconsistent in ``row`` (empty when it is complete and cited)."""
    bad = [f"missing {k}" for k in REQUIRED if k not in row]
    if bad:
        return bad
    bad += [f"shape misses {k}" for k in SHAPE_KEYS if k not in row["shape"]]
    if row["source"].get("name") not in sources or not row["source"].get("where"):
        bad.append("source must name a known source and where in it")
    m = row["measured"]
    if m.get("metric") not in METRICS or not (m.get("value", 0) > 0) or not m.get("definition"):
        bad.append("measured needs a known metric, a positive value and its definition")
    if m.get("metric") == "model_tflops_per_gpu" and m.get("flop_formula") not in FLOP_FORMULAS:
        bad.append("a TFLOP/s figure needs the source's flop_formula")
    if row["gpus"] % (row["tp"] * row["pp"] * row["cp"]):
        bad.append("gpus not divisible by tp·pp·cp")
    else:
        dp = row["gpus"] // (row["tp"] * row["pp"] * row["cp"])
        if row["global_batch"] % (dp * row["mbs"]):
            bad.append("global batch not divisible by dp·mbs")
    if row["precision"] not in PRECISIONS or row["gpu"] not in GPUS:
        bad.append("unknown precision or GPU")
    if row["recompute"].get("granularity") not in ("none", "selective", "full"):
        bad.append("recompute granularity must be none, selective or full")
    return bad


# ------------------------------------------------------------------------------------------------ FLOP conventions
def megatron_2024_flops_per_token(shape: dict[str, Any], seq: int) -> float:
    """Megatron-LM ``num_floating_point_operations`` of MCore v0.8/v0.9 per token (training.py at core_v0.8.0):
    12·L·h²·[(1 + G/A + s/h)·(q/h) + (F/h)·topk·3/2 + V/(2·L·h)] (non-causal attention, every layer an MoE layer)."""
    L, h, a = shape["layers"], shape["hidden"], shape["heads"]
    g = shape["kv_heads"] or a
    q = a * (shape["head_dim"] or h // a)
    gated = 1.5 if shape["gated"] else 1.0
    return 12.0 * L * h * h * ((1 + g / a + seq / h) * (q / h) + shape["moe_ffn"] / h * shape["topk"] * gated
                               + shape["vocab"] / (2 * L * h))


def megatron_2025_causal_flops_per_token(shape: dict[str, Any], seq: int) -> float:
    """Megatron-LM ``num_floating_point_operations`` per token from commit 8873b55d6a (2025-03-06; GQA, no MTP):
    12·L·h²·(1 + G/A + s/(2h))·(q/h) + 12·h·(dense·F + moe·(F_e·topk + shared·F_e))·3/2 + 6·h·V."""
    L, h, a = shape["layers"], shape["hidden"], shape["heads"]
    g = shape["kv_heads"] or a
    q = a * (shape["head_dim"] or h // a)
    gated = 1.5 if shape["gated"] else 1.0
    moe_layers = (L - shape["first_dense"]) // shape["moe_every"]
    mlp = ((L - moe_layers) * shape["ffn"] + moe_layers * shape["moe_ffn"] * (shape["topk"] + shape["shared_experts"]))
    attn = 12.0 * L * h * h * (1 + g / a + seq / (2 * h)) * (q / h)
    return attn + 12.0 * h * mlp * gated + 6.0 * h * shape["vocab"]


FLOP_FORMULAS = {"megatron_2024": megatron_2024_flops_per_token,
                 "megatron_2025_causal": megatron_2025_causal_flops_per_token}


def exact_flops_per_token(shape: dict[str, Any], seq: int) -> float:
    """Training FLOPs per token of the true shape in optplan's convention (PaLM: 6·N_active + the attention core's
    12·L·s·width, non-causal): q/k/v/o of heads·head_dim, MLA projections and its qk (nope + rope) / v widths, the
    active experts and router, the untied output head; no MTP module."""
    L, h, a = shape["layers"], shape["hidden"], shape["heads"]
    mla = shape["mla"]
    if mla:
        qk, v = a * (mla["nope_dim"] + mla["rope_dim"]), a * mla["v_dim"]
        q_proj = h * qk if not mla["q_lora"] else mla["q_lora"] * (h + qk)
        attn = q_proj + h * (mla["kv_lora"] + mla["rope_dim"]) + mla["kv_lora"] * a * (mla["nope_dim"] + mla["v_dim"])
        attn += v * h
        core = qk + v
    else:
        d = shape["head_dim"] or h // a
        q, kv = a * d, (shape["kv_heads"] or a) * d
        attn, core = 2 * h * q + 2 * h * kv, 2 * q
    mult = 3 if shape["gated"] else 2
    moe_layers = (L - shape["first_dense"]) // shape["moe_every"]
    mlp = mult * h * ((L - moe_layers) * shape["ffn"]
                      + moe_layers * shape["moe_ffn"] * (shape["topk"] + shape["shared_experts"]))
    router = moe_layers * h * shape["experts"]
    n_active = L * attn + mlp + router + h * shape["vocab"]
    return 6.0 * n_active + 6.0 * L * seq * core


def measured_tokens_per_s_per_gpu(row: dict[str, Any]) -> float:
    """The source's figure as tokens/s per GPU, by its own definition."""
    m, seq, gpus = row["measured"], row["seq"], row["gpus"]
    if m["metric"] == "tokens_per_s_per_gpu":
        return float(m["value"])
    if m["metric"] == "step_s":
        return row["global_batch"] * seq / m["value"] / gpus
    if m["metric"] == "model_tflops_per_gpu":
        return m["value"] * 1e12 / FLOP_FORMULAS[m["flop_formula"]](row["shape"], seq)
    if m["metric"] == "gpu_hours_per_trillion_tokens":
        return 1e12 / (m["value"] * 3600.0)
    raise ValueError(f"{row['id']}: unknown metric {m['metric']}")


# ------------------------------------------------------------------------------------------------ the closest plan
def arch_text(shape: dict[str, Any]) -> str:
    """The shape as ``--arch`` keys (the MTP module has none)."""
    keys: dict[str, Any] = {k: shape[k] for k in ("layers", "hidden", "heads", "ffn", "vocab", "experts", "topk",
                                                  "moe_ffn", "shared_experts", "first_dense", "moe_every")}
    if shape["kv_heads"] and not shape["mla"]:
        keys["kv_heads"] = shape["kv_heads"]
    if shape["head_dim"] and not shape["mla"] and shape["heads"] * shape["head_dim"] != shape["hidden"]:
        keys["head_dim"] = shape["head_dim"]  # --arch head_dim (Qwen3: 64 heads of 128 on hidden 4096)
    keys["gated"], keys["tied"] = int(shape["gated"]), int(shape["tied"])
    if shape["mla"]:
        keys.update({k: v for k, v in shape["mla"].items() if v is not None})
    return ",".join(f"{k}={v}" for k, v in keys.items())


@dataclass(frozen=True)
class Plan:
    """A row in optplan's terms: profile, cluster, strategy and the substitutions made (FLAGS keys)."""

    profile: ModelProfile
    cluster: Cluster
    strategy: Strategy
    flags: tuple[str, ...]


def _gpu(row: dict[str, Any]) -> GPUSpec:
    name, update = GPUS[row["gpu"]]
    spec = find_gpu(name)
    return spec.model_copy(update=update) if update else spec


def _expert_parallel(row: dict[str, Any], dp: int) -> tuple[int, int | None, list[str]]:
    """optplan's (ep, etp) for the source's EP and expert-tp: as run (Strategy.etp, None where it is tp), with ep
    clipped to a divisor of tp·dp·cp / etp and of the experts where the source's does not divide them."""
    flags: list[str] = []
    ep, etp, tp = row["ep"], row["etp"], row["tp"]
    room = tp * dp * row["cp"] // etp
    if room % ep or row["shape"]["experts"] % ep:
        flags.append("fold")
        ep = math.gcd(math.gcd(ep, room), row["shape"]["experts"])
    return ep, (None if etp == tp else etp), flags


def _checkpointing(row: dict[str, Any]) -> tuple[CheckpointName, list[str]]:
    rc = row["recompute"]
    if rc["granularity"] != "selective":
        return rc["granularity"], []
    if any(m in EXPERT_RECOMPUTE for m in rc["modules"]):  # optplan's moe recomputation (moe_recompute.py)
        return "moe", (["rc"] if set(rc["modules"]) - {"moe"} else [])
    return "selective", (["rc"] if set(rc["modules"]) - {"core_attn"} else [])


def plan(row: dict[str, Any]) -> Plan:
    """The closest supported optplan settings for ``row`` (module docstring) and what had to be substituted."""
    shape = row["shape"]
    flags: list[str] = []
    profile = profile_from_arch(parse_arch(arch_text(shape), seq_len=row["seq"]), name=row["model"])
    if shape["mla"]:
        flags.append("mla")
    tp, pp, cp, mbs = row["tp"], row["pp"], row["cp"], row["mbs"]
    dp = row["gpus"] // (tp * pp * cp)
    grad_accum = row["global_batch"] // (dp * mbs)
    ep, etp, ep_flags = _expert_parallel(row, dp)
    flags += ep_flags
    vpp = row["vpp"]
    if vpp > 1 and grad_accum % pp:
        flags.append("vpp")
        vpp = 1
    checkpointing, rc_flags = _checkpointing(row)
    flags += rc_flags
    if row["precision"] in ("mxfp8", "fp8-blockwise"):
        flags.append("fp8")
    features = row["features"]
    strategy = Strategy(engine="megatron", precision=PRECISIONS[row["precision"]], tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep,
                        etp=etp, dp=dp, mbs=mbs, grad_accum=grad_accum, zero=1, checkpointing=checkpointing)
    cluster = Cluster(gpu=_gpu(row), gpus=row["gpus"], gpus_per_node=row["gpus_per_node"],
                      inter_node_bandwidth_bytes_per_s=row["inter_node_gbit_per_gpu"] * 1e9 / 8)
    if row["dispatcher"].split(" ")[0] in NODE_DEDUP_DISPATCHERS and ep > 1:
        if cluster.gpu.name in DEEPEP_GPUS:  # optplan's deepep dispatcher: one copy per remote node
            strategy = strategy.model_copy(update={"dispatcher": "deepep"})
        elif _ep_nodes(strategy, cluster) > 1:
            flags.append("dd")
    if "a2a-overlap-1f1b" in features:  # Megatron's batch-level overlap: optplan's ep_overlap where its rules allow
        try:
            strategy = Strategy(**{**strategy.model_dump(), "ep_overlap": True})
        except ValueError:
            flags.append("ov")
    elif "dualpipe" in features:  # optplan's pp_schedule dualpipe: its schedule, two stages per rank, its overlap
        try:
            strategy = Strategy(**{**strategy.model_dump(), "pp_schedule": "dualpipe"})
        except ValueError:
            flags += ["dual", "ov"]
    elif any(f.startswith("a2a-overlap") for f in features):
        flags.append("ov")
    if shape["mtp_layers"] and "mtp" in features:
        flags.append("mtp")
    if any(f in features for f in ("megatron-fsdp", "torch-fsdp2")):
        flags.append("fsdp")
    if "engine-torch" in features:
        flags.append("torch")
    if row["gpu"] == "H800":
        flags.append("gpu")
    # "forced balance" names a forced router; "load not forced" / "does not say forced" are aux-loss rows
    if "forced balance" not in row["token_policy"] and "bias balancing" not in row["token_policy"]:
        flags.append("bal")
    if "overlap-grad-reduce" in features:
        # optplan's comm_overlap is Megatron's data-parallel overlap and, with tp > 1, its tensor-parallel one: taken
        # where the source states both (or has no tensor parallelism), else the data-parallel overlap stays exposed
        if strategy.tp == 1 or "tp-comm-overlap-flag" in features:
            strategy = strategy.model_copy(update={"comm_overlap": True})
        else:
            flags.append("dpo")
    return Plan(profile=profile, cluster=cluster, strategy=strategy, flags=tuple(flags))


def _ep_nodes(strategy: Strategy, cluster: Cluster) -> int:
    return placement(strategy, cluster.gpus_per_node).ep.nodes


# ------------------------------------------------------------------------------------------------ prediction
@dataclass(frozen=True)
class Result:
    """One row's prediction against its measurement, and the diagnostics around it."""

    row: dict[str, Any]
    plan: Plan
    est: Estimate
    measured_tps: float
    attention_x2_step_s: float
    """The predicted step with the GPU's flash-attention forward/backward fractions doubled (a probe, never scored)."""

    @property
    def predicted_tps(self) -> float:
        tokens = self.est.time.tokens_per_s or 0.0
        return tokens / self.row["gpus"]

    @property
    def ratio(self) -> float:
        """Predicted ÷ measured step time (= measured ÷ predicted throughput)."""
        return self.measured_tps / self.predicted_tps

    @property
    def measured_step_s(self) -> float:
        return self.est.time.step_s / self.ratio

    @property
    def in_band(self) -> bool:
        """Whether the measured step lies inside the estimate's band (time.step_s_low-high, uncertainty.py)."""
        t = self.est.time
        return t.step_s_low <= self.measured_step_s <= t.step_s_high

    @property
    def band_text(self) -> str:
        """The band as multiples of the predicted step, e.g. '0.74-1.31'."""
        t = self.est.time
        return f"{t.step_s_low / t.step_s:.2f}-{t.step_s_high / t.step_s:.2f}"

    @property
    def a2a_share(self) -> float:
        t = self.est.time
        return t.ep_comm_s / t.step_s

    @property
    def flops_factor(self) -> float:
        """Exact training FLOPs per token of the true shape ÷ the profile's (``exact_flops_per_token``)."""
        return exact_flops_per_token(self.row["shape"], self.row["seq"]) / (
            self.plan.profile.train_flops_per_sample / self.row["seq"])

    @property
    def dedup_factor(self) -> float:
        """Inter-node bytes of a node-deduplicating dispatch ÷ optplan's topk copies (uniform routing over the expert
        group's n nodes, experts spread evenly, e/n per node): E[remote nodes holding any of a token's topk experts]
        = (n - 1)·(1 - C(e - e/n, topk)/C(e, topk)) (capped at M·(n - 1)/n under node-limited routing to M nodes),
        ÷ topk·(n - 1)/n. 1 for other dispatchers and groups inside one node."""
        if "dd" not in self.plan.flags:
            return 1.0
        shape = self.row["shape"]
        n = _ep_nodes(self.plan.strategy, self.plan.cluster)
        e, k = shape["experts"], shape["topk"]
        miss = math.comb(e - e // n, k) / math.comb(e, k)
        remote_nodes = (n - 1) * (1 - miss)
        if "node-limited-routing" in self.row["features"]:
            remote_nodes = min(remote_nodes, 4 * (n - 1) / n)
        return remote_nodes / (k * (n - 1) / n)

    def counterfactual(self, *, flops: bool = False, a2a_scale: float = 1.0, overlap: bool = False,
                       interleave: bool = False) -> float:
        """The ratio with parts of the predicted step changed (never scored; evidence for the mechanisms): GEMM and
        attention time (compute + recompute) scaled by the FLOP deficit (``flops``), the all-to-all scaled by
        ``a2a_scale`` and, where the source overlaps it with another micro-batch's compute (flags ov/dual), only
        its excess over that compute exposed (``overlap``), the pipeline bubble of the source's interleaving
        ÷ vpp where optplan had to drop it (``interleave``)."""
        t = self.est.time
        work = (t.compute_s + t.recompute_s) * (self.flops_factor if flops else 1.0)
        a2a = t.ep_comm_s * a2a_scale
        if overlap and ({"ov", "dual"} & set(self.plan.flags)):
            a2a = max(0.0, a2a - work)
        bubble = t.bubble_s / (self.row["vpp"] if interleave and "vpp" in self.plan.flags else 1)
        step = t.step_s - (t.compute_s + t.recompute_s) + work - t.ep_comm_s + a2a - t.bubble_s + bubble
        return step / self.measured_step_s

    @property
    def prototype(self) -> float:
        """The ratio under every grounded counterfactual at once: exact FLOPs, node-deduplicated dispatch,
        the source's all-to-all overlap and interleaving (a prototype of the proposed changes, never scored)."""
        return self.counterfactual(flops=True, a2a_scale=self.dedup_factor, overlap=True, interleave=True)

    @property
    def attention_x2(self) -> float:
        """The ratio with the GPU's fitted flash-attention fractions doubled (a probe, never scored; an engine whose
        kernel has measured fractions, estimators/attention_kernels.py, keeps them)."""
        return self.attention_x2_step_s / self.measured_step_s


def predict(row: dict[str, Any]) -> Result:
    """Price ``row`` through ``estimate`` with the closest supported plan."""
    p = plan(row)
    eff = efficiency_for(p.cluster.gpu)
    doubled = eff.model_copy(update={"flash_attention_fraction": 2 * eff.flash_attention_fraction,
                                     "flash_backward_fraction": 2 * eff.flash_backward_fraction})
    probe = step_time(p.profile, p.strategy, p.cluster, efficiency=doubled).step_s
    return Result(row=row, plan=p, est=estimate(p.profile, p.cluster, p.strategy),
                  measured_tps=measured_tokens_per_s_per_gpu(row), attention_x2_step_s=probe)


def domain_rows() -> list[Any]:
    """Every published MoE run as a ``published_sets.Row`` (the closest supported plan, the measured step time):
    the MoE sets of the time model's measured domain (``fidelity_published.py --write-domain``)."""
    from published_sets import Row

    out = []
    for row in load()[1]:
        r = predict(row)
        out.append(Row(set=f"moe:{row['set']}", label=row["id"], profile=r.plan.profile, cluster=r.plan.cluster,
                       strategy=r.plan.strategy, measured_s=r.measured_step_s))
    return out


def _mape(ratios: list[float]) -> float:
    return statistics.fmean(abs(r - 1) for r in ratios)


def _layout(r: Result) -> str:
    row, s = r.row, r.plan.strategy
    src = f"tp{row['tp']} pp{row['pp']}" + (f"v{row['vpp']}" if row['vpp'] > 1 else "") + \
        (f" cp{row['cp']}" if row['cp'] > 1 else "") + f" ep{row['ep']}"
    etp = f" etp{s.expert_tp}" if s.expert_tp != s.tp else ""
    return f"{src} -> ep{s.ep}{etp}" + ("" if s.vpp == row["vpp"] else f" v{s.vpp}") + f" {s.checkpointing[:3]}"


def _groups(results: list[Result]) -> dict[str, list[Result]]:
    groups: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        groups[f"set {r.row['set']}"].append(r)
        groups[f"gpu {r.row['gpu']}"].append(r)
        nodes = _ep_nodes(r.plan.strategy, r.plan.cluster)
        disp = "node-dedup dispatcher" if r.row["dispatcher"].split(" ")[0] in NODE_DEDUP_DISPATCHERS else "NCCL a2a"
        if r.row["seq"] <= 8192:
            groups[f"seq<=8k, expert group in {'one node' if nodes == 1 else 'several nodes'}, {disp}"].append(r)
        groups["shape: Qwen3 head_dim (flag hd)" if "hd" in r.plan.flags else
               "shape: MLA (flag mla)" if "mla" in r.plan.flags else "shape: exact"].append(r)
        if r.row["seq"] > 8192:
            groups["sequence > 8192 (long context)"].append(r)
        if "vpp" in r.plan.flags:
            groups["interleaving dropped (flag vpp)"].append(r)
    return groups


def report(results: list[Result], excluded: list[dict[str, Any]]) -> None:
    """Per run, per group, the counterfactuals, the flags and the exclusions."""
    print("MoE training throughput: optplan (estimate, closest supported plan) against published measurements")
    print("ratio = predicted ÷ measured step time (= measured ÷ predicted tokens/s per GPU); flags: legend below\n")
    print(f"{'run':<44} {'GPU':<8} {'GPUs':>5} {'prec':<13} {'layout (source -> optplan)':<34} {'meas t/s':>8} "
          f"{'pred t/s':>8} {'ratio':>6} {'band':>9} {'':>3} {'a2a%':>5} {'flops':>6} {'proto':>6} {'mem GiB':>8}  flags")
    for r in results:
        row, mem = r.row, r.est.memory
        oom = "!" if not mem.fits else " "
        print(f"{row['id']:<44} {row['gpu']:<8} {row['gpus']:>5} {row['precision']:<13} {_layout(r):<34} "
              f"{r.measured_tps:>8.0f} {r.predicted_tps:>8.0f} {r.ratio:>6.2f} {r.band_text:>9} "
              f"{'in' if r.in_band else 'OUT':>3} {100 * r.a2a_share:>4.0f}% "
              f"{r.flops_factor:>6.2f} {r.prototype:>6.2f} {mem.total_bytes / GIB:>7.1f}{oom}  {','.join(r.plan.flags)}")
    print("\nband = the estimate's step-time band as multiples of its step (time.step_s_low-high: the plan's measured "
          "errors, widened for what was never measured, estimators/uncertainty.py); in/OUT = whether the measured step "
          "lies inside it.")
    print("a2a% = predicted all-to-all share of the step; flops = exact training FLOPs per token of the true shape ÷ "
          "the --arch profile's (same convention); proto = the ratio under the prototype of the proposed changes "
          "(Result.prototype: exact FLOPs, node-deduplicated dispatch, the source's all-to-all overlap and "
          "interleaving; not scored); mem = predicted peak per GPU, '!' = over the GPU's capacity although the run "
          "fitted (a memory miss; FSDP rows are priced without FSDP's sharding).")

    print(f"\n{'group':<62} {'runs':>4} {'MAPE':>6} {'median':>6} {'min':>5} {'max':>5} {'a2a%':>5} | "
          f"{'fc':>5} {'+dd':>5} {'+ov':>5} {'proto':>6} {'attn2':>6} {'proto MAPE':>10}")
    groups = _groups(results)
    for name in sorted(groups):
        rs = groups[name]
        rr = [r.ratio for r in rs]

        def med(f: Any, rs: list[Result] = rs) -> float:
            return statistics.median(f(r) for r in rs)
        print(f"{name:<62} {len(rs):>4} {100 * _mape(rr):>5.1f}% {statistics.median(rr):>6.2f} {min(rr):>5.2f} "
              f"{max(rr):>5.2f} {100 * statistics.fmean(r.a2a_share for r in rs):>4.0f}% | "
              f"{med(lambda r: r.counterfactual(flops=True)):>5.2f} "
              f"{med(lambda r: r.counterfactual(flops=True, a2a_scale=r.dedup_factor)):>5.2f} "
              f"{med(lambda r: r.counterfactual(flops=True, a2a_scale=r.dedup_factor, overlap=True)):>5.2f} "
              f"{med(lambda r: r.prototype):>6.2f} {med(lambda r: r.attention_x2):>6.2f} "
              f"{100 * _mape([r.prototype for r in rs]):>9.1f}%")
    print("Counterfactual median ratios (never scored; Result.counterfactual): fc = compute + recompute scaled by the "
          "FLOP deficit; +dd = and the all-to-all cut to a node-deduplicating dispatch where the source uses one; "
          "+ov = and only its excess over compute exposed where the source overlaps it; proto = and the bubble of "
          "the source's interleaving; attn2 = optplan's plan with the GPU's fitted flash-attention fractions doubled "
          "(alone; Megatron on Hopper runs its kernel's measured fractions, estimators/attention_kernels.py, which "
          "this probe leaves as they are).")

    print("\nflags:")
    for key, text in FLAGS.items():
        print(f"  {key:<5} {text}")
    print(f"\nexcluded ({len(excluded)} groups of published rows, the data file's 'excluded'):")
    for ex in excluded:
        print(f"  - {ex['what']}: {ex['reason']}")


def dense_check() -> str:
    """The dense published-throughput benchmark's summary line (benchmarks/fidelity_published.py), recomputed."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fidelity_published import report as dense_report
    from published_sets import all_rows

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        dense_report(all_rows(), 0)
    return buf.getvalue().strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"also write {RESULTS.relative_to(ROOT)}")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense benchmark's check line")
    args = parser.parse_args()
    sources, rows, excluded = load()
    problems = {row.get("id", "?"): check_row(row, sources) for row in rows}
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        raise SystemExit(f"data file rows incomplete: {problems}")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        results = [predict(row) for row in rows]
        report(results, excluded)
        if not args.no_dense:
            print(f"\ndense check (benchmarks/fidelity_published.py, unchanged by this benchmark): {dense_check()}")
        print(f"prototype of the proposed changes (not optplan, not scored): MAPE "
              f"{100 * _mape([r.prototype for r in results]):.1f}% over {len(results)} runs")
        print(f"measured step inside the estimate's band: {sum(r.in_band for r in results)} of {len(results)}")
        print(f"moe: MAPE {100 * _mape([r.ratio for r in results]):.1f}% over {len(results)} runs")
    text = buf.getvalue()
    print(text, end="")
    if args.write:
        RESULTS.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
