"""Measured training runs as rows the time model can price: every set the fit and the report use.

Each row is one measured run: a profile from its shape (``--arch`` formulas), a cluster, a strategy and
the measured step time (seconds). Sets:

- ``vtrain``: 1,440 Megatron-DeepSpeed iterations on 2-8 A100s (benchmarks/fidelity_vtrain.py's rows).
- ``llmfoundry-<gpu>``: 191 MPT runs with Composer and torch FSDP (``../shared/data`` copy in
  benchmarks/data/llmfoundry_mpt_benchmarks.csv, Apache-2.0). MPT blocks are GPT blocks without biases,
  learned positions, tied embeddings, flash attention, ffn 4h, vocabulary 50,368: the ``--arch`` GPT shape
  with the table's vocabulary. Composer's ``amp_bf16`` with FSDP ``DEFAULT`` mixed precision keeps fp32
  sharded parameters, gathers them in bf16 and reduces gradients in fp32 — optplan's torch ``bf16`` recipe
  as its exports configure it; ``bf16``/``PURE`` rows reduce in bf16 (the same recipe with ``fsdp_reduce_dtype``
  bf16: ``LLMFOUNDRY_REDUCE``). Their attention is MPT's own Triton flash kernel
  (the benchmark script's default ``attn_impl: triton``), the kernel the per-GPU flash fractions are fitted on: the
  rows price it as ``fitted`` (estimators/attention_kernels.py), not torch SDPA's, and their eager elementwise
  kernels as that stack's (``llm-foundry-2023`` in efficiency.yaml's stacks: torch 1.13/2.1 and MPT's code, slower
  than today's torch engine). Measured step time = global batch ×
  sequence ÷ (tokens/s per GPU × GPUs). A100 tables ran on RoCE at 1,600 Gb/s per node (25 GB/s per
  GPU); the H100 table names no interconnect: 400 Gb/s per GPU (the catalogue default, 8 × NDR per
  node) is assumed.
- ``narayanan-table1``, ``korthikanti-table5``, ``torchtitan``, ``megatron-bridge``: published tables (sources in
  ``PAPER``).
- ``dgxc-nemo``: 70 NeMo/Megatron-Core runs on DGX H100 from NVIDIA's DGX Cloud benchmarking recipes, bf16 and fp8,
  Llama 3.1 8B/70B/405B, Nemotron-4 15B/340B and GPT-3 175B at 8-2,304 GPUs
  (benchmarks/data/dgxc_nemo_published.json).
- ``dgxc-nemo-25.05``: the same recipes' release v25.05.05 (NeMo 2, containers 25.04): 24 runs of Llama 3.1 405B and
  Nemotron-4 340B on GB200 NVL72 racks (128-512 GPUs, weak and strong scaling) and Llama 3.1 405B, Nemotron-4
  15B/340B on DGX H100, bf16 and fp8 (benchmarks/data/dgxc_nemo_v25_05_published.json).
- ``nemo-long-context``: 17 NeMo/Megatron-Core fp8 runs of Llama 2 7B (DGX H100) and Llama 3 8B (DGX B200) at 4K-1M
  tokens per sequence, context parallelism 1-32 (benchmarks/data/nemo_long_context_published.json).
- ``fms-fsdp``: 8 PyTorch FSDP runs of Llama 2 7B-70B shapes (IBM's fms-fsdp; eager, bf16, batch 2 x 4,096 tokens) on 128
  A100 80GB and 96 H100 80GB GPUs behind 400 and 800 Gb/s per node (benchmarks/data/fms_fsdp_published.json).
- ``bigscience-bloom``: 18 Megatron-DeepSpeed runs of 176-203B GPT shapes on 384 A100 80GB behind 6.25 GB/s of
  Omni-Path per GPU (BLOOM-176B's layout search and production run; benchmarks/data/bigscience_bloom_published.json).

Split for fitting: within each set, rows alternate in file order between the fit half and the held-out
half (``split``).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from optplan.estimators.arch import ArchSpec, parse_arch, profile_from_arch
from optplan.estimators.efficiency import EngineEfficiency, GpuEfficiency, stack_efficiency
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, GPUSpec, find_gpu
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.temporaries import AdamImpl
from optplan.estimators.timing import TimeBreakdown, step_time

HERE = Path(__file__).resolve().parent
LLMFOUNDRY = HERE / "data" / "llmfoundry_mpt_benchmarks.csv"
LLMFOUNDRY_GPU = {"h100_80gb": "H100-SXM", "a100_80gb": "A100-80GB", "a100_40gb": "A100-40GB"}
LLMFOUNDRY_STACK = "llm-foundry-2023"
"""The software the tables ran (efficiency.py ``stacks``): Composer and MPT's eager blocks on torch 1.13 (A100 tables)
and 2.1 (H100 table: scripts/train/benchmarking/sweep.sh's image at llm-foundry 5e85bd62)."""
LLMFOUNDRY_REDUCE = {"PURE": "bf16", "DEFAULT": "fp32"}
"""The table's ``MP Mode`` -> the dtype FSDP reduced gradients in (``Strategy.fsdp_reduce_dtype``), from Composer's
``get_mixed_precision`` (mosaicml/composer ``composer/trainer/mosaic_fsdp_utils.py``): ``PURE`` is ``param_dtype =
reduce_dtype = buffer_dtype`` = the precision's (bf16) in every release; ``DEFAULT`` reduced in fp32 from 0.16.4
(d745fcb1b, Oct. 2023, "patch default"; before it bf16), which the tables' ``amp_bf16``/``DEFAULT`` rows ran: they were
added with the H100 table in llm-foundry b2a43a147 (Oct. 19 2023), whose setup.py pins ``mosaicml>=0.16.4,<0.17``.
The ``bf16``/``PURE`` rows are the A100 tables of May-July 2023 (llm-foundry 5f43bf160-c6cfb4284)."""
LLMFOUNDRY_NIC_BYTES_PER_S = {"h100_80gb": 50e9, "a100_80gb": 25e9, "a100_40gb": 25e9}


@dataclass(frozen=True)
class Row:
    """One measured run and how to price it."""

    set: str
    label: str
    profile: ModelProfile
    cluster: Cluster
    strategy: Strategy
    measured_s: float
    extra: dict[str, str] = field(default_factory=dict)
    adam_impl: AdamImpl | None = None  # the AdamW the run used when not its engine's own (temporaries.py)
    attention_kernel: str | None = None  # the attention kernel it ran when not its engine's own (attention_kernels.py)
    engine_stack: str | None = None  # the older software stack it ran when not today's engine (efficiency.py stacks)
    domain: str = ""  # a measured set of its own in the time domain (fidelity_published.py), else merged per GPU

    @property
    def gpu(self) -> str:
        return self.cluster.gpu.name

    def time(self, eff: GpuEfficiency | None = None, engine: EngineEfficiency | None = None) -> TimeBreakdown:
        """The predicted step (committed constants through ``estimate``, else ``step_time`` with overrides)."""
        if engine is None and self.engine_stack is not None:
            engine = stack_efficiency(self.engine_stack)
        if eff is None and engine is None:
            return estimate(self.profile, self.cluster, self.strategy, adam_impl=self.adam_impl,
                            attention_kernel=self.attention_kernel).time
        return step_time(self.profile, self.strategy, self.cluster, efficiency=eff, engine=engine,
                         adam_impl=self.adam_impl, attention_kernel=self.attention_kernel)

    def ratio(self, eff: GpuEfficiency | None = None, engine: EngineEfficiency | None = None) -> float:
        """Predicted ÷ measured step time."""
        return self.time(eff, engine).step_s / self.measured_s


@cache
def _profile(layers: int, hidden: int, heads: int, seq: int, vocab: int, flash: bool = True,
             kv_heads: int | None = None, ffn: int | None = None, gated: bool = False,
             tied: bool = True) -> ModelProfile:
    return profile_from_arch(ArchSpec(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab,
                                      flash=flash, kv_heads=kv_heads, ffn=ffn, gated=gated, tied=tied))


def llmfoundry_rows(path: Path = LLMFOUNDRY) -> list[Row]:
    """The 191 llm-foundry MPT runs, one set per GPU (``llmfoundry-H100-SXM`` ...), file order."""
    rows = []
    with path.open() as f:
        for raw in csv.DictReader(f):
            layers, hidden, heads, vocab, seq = (int(raw[k]) for k in ("layers", "hidden", "heads", "vocab",
                                                                       "SeqLen (T)"))
            gpus, mbs, accum = int(raw["# GPUs"]), int(raw["MicroBatchSize"]), int(raw["GradAccum"])
            ck = "full" if raw["Activation Checkpointing"] == "True" else "none"
            strategy = Strategy(precision="bf16", engine="torch", fsdp="full", dp=gpus, mbs=mbs, grad_accum=accum,
                                checkpointing=ck, fsdp_reduce_dtype=LLMFOUNDRY_REDUCE[raw["MP Mode"]])
            gpu = LLMFOUNDRY_GPU[raw["GPU"]]
            cluster = Cluster(gpu=find_gpu(gpu), gpus=gpus, gpus_per_node=8,
                              inter_node_bandwidth_bytes_per_s=LLMFOUNDRY_NIC_BYTES_PER_S[raw["GPU"]])
            tokens_per_gpu_s = float(raw["Throughput (T/s/GPU)"])
            measured = strategy.global_batch * seq / (tokens_per_gpu_s * gpus)
            label = (f"MPT-{raw['Model']} s={seq} gpus={gpus} mbs={mbs} ga={accum} ck={ck} "
                     f"{raw['Precision']}/{raw['MP Mode']}")
            rows.append(Row(set=f"llmfoundry-{gpu}", label=label,
                            profile=_profile(layers, hidden, heads, seq, vocab), cluster=cluster,
                            strategy=strategy, measured_s=measured,
                            extra={"mfu": raw["MFU"], "precision": raw["Precision"]}, attention_kernel="fitted",
                            engine_stack=LLMFOUNDRY_STACK))
    return rows


def vtrain_rows() -> list[Row]:
    """vTrain's 1,440 A100 rows through benchmarks/fidelity_vtrain.py's own loader."""
    spec = importlib.util.spec_from_file_location("fidelity_vtrain", HERE / "fidelity_vtrain.py")
    assert spec and spec.loader
    module = sys.modules.get("fidelity_vtrain") or importlib.util.module_from_spec(spec)
    if "fidelity_vtrain" not in sys.modules:
        sys.modules["fidelity_vtrain"] = module
        spec.loader.exec_module(module)
    return [Row(set="vtrain", label=r.label(), profile=r.profile, cluster=r.cluster, strategy=r.strategy,
                measured_s=r.measured_s) for r in module.load_rows()]


def narayanan_eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration with full recomputation, Narayanan et al. 2021 eq. 3:
    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    return 96.0 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


H100_NVL_BF16_FLOPS = 835.5e12
"""NVIDIA H100 datasheet, H100 NVL column: 1,671 TFLOP/s BF16 with sparsity, 835.5 dense."""


def grand_teton_h100() -> GPUSpec:
    """The Grand Teton H100 the torchtitan H100 tables ran on, as its source describes it: 96 GB of HBM2e at 2.4 TB/s,
    a 500 W power limit, and a peak "between SXM and NVL" (the source does not know it): priced at the midpoint of
    the two datasheet peaks (0.92 of the SXM's, every dtype), with the H100 SXM's fitted fractions and kernels (the
    same GH100 die; its name is kept so they apply)."""
    sxm = find_gpu("H100-SXM")
    scale = (sxm.peak_flops_for("bf16") + H100_NVL_BF16_FLOPS) / 2 / sxm.peak_flops_for("bf16")
    return sxm.model_copy(update={"peak_flops": {k: v * scale for k, v in sxm.peak_flops.items()},
                                  "memory_bandwidth_bytes_per_s": 2.4e12, "memory_bytes": 96 * 2**30,
                                  "tdp_watts": 500})


@dataclass(frozen=True)
class Paper:
    """A published table row: shape, layout, and what it reported."""

    set: str
    label: str
    arch: str
    seq: int
    gpu: str
    gpus: int
    strategy: Strategy
    measured_s: Callable[[], float]
    source: str
    nic_bytes_per_s: float = 25e9
    gpus_per_node: int = 8  # the NVLink domain: 72 for a GB200 NVL72 rack
    gpu_spec: Callable[[], GPUSpec] | None = None  # the part as the source describes it when not the catalogue's
    attention_kernel: str | None = None  # the attention kernel it ran when not its engine's own (attention_kernels.py)
    domain: str = ""  # its Row's domain (OUTSIDE_DOMAIN: judged, not in the time domain)


def _narayanan(params: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
               tflops: float) -> Paper:
    dp = gpus // (tp * pp)
    mbs = 1
    accum = batch // (dp * mbs)
    s = Strategy(precision="fp16", engine="megatron", tp=tp, pp=pp, dp=dp, mbs=mbs, grad_accum=accum, sp=False,
                 flash=False, checkpointing="full", vpp=1)
    return Paper(set="narayanan-table1", label=f"GPT {params} tp{tp} pp{pp} {gpus} A100 batch {batch}",
                 arch=f"layers={layers},hidden={hidden},heads={heads},vocab=51200", seq=2048, gpu="A100-80GB",
                 gpus=gpus, strategy=s,
                 measured_s=lambda: narayanan_eq3_flops(batch, 2048, layers, hidden, 51200) / (tflops * 1e12 * gpus),
                 source="Narayanan et al. 2021 (arXiv 2104.04473) Table 1; Selene, 8 x 200 Gb/s HDR per node")


def _tokens_per_gpu(set_: str, label: str, arch: str, seq: int, gpu: str, gpus: int, strategy: Strategy,
                    tokens_per_gpu_s: float, source: str, nic_bytes_per_s: float, gpus_per_node: int = 8,
                    gpu_spec: Callable[[], GPUSpec] | None = None, attention_kernel: str | None = None,
                    domain: str = "") -> Paper:
    return Paper(set=set_, label=label, arch=arch, seq=seq, gpu=gpu, gpus=gpus, strategy=strategy,
                 measured_s=lambda: strategy.global_batch * seq / (tokens_per_gpu_s * gpus), source=source,
                 nic_bytes_per_s=nic_bytes_per_s, gpus_per_node=gpus_per_node, gpu_spec=gpu_spec,
                 attention_kernel=attention_kernel, domain=domain)


LLAMA3_8B = "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0"
LLAMA3_70B = "layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256,gated=1,tied=0"
LLAMA2_13B = "layers=40,hidden=5120,heads=40,kv_heads=40,ffn=13824,vocab=32000,gated=1,tied=0"
LLAMA2_70B = "layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=32000,gated=1,tied=0"
"""torchtitan's Llama 2 flavors (``torchtitan/models/llama/__init__.py`` at 1ea476e9f: 13B dim 5,120, 40 layers and heads,
ffn 13,824 from multiple_of 256; 70B dim 8,192, 80 layers, 64 heads, 8 KV heads, ffn_dim_multiplier 1.3 with
multiple_of 4,096 -> 28,672), the Llama 2 tokenizer's 32,000 tokens, untied output."""
TORCHTITAN = "torchtitan docs/performance.md (pytorch/torchtitan), Llama 3 performance numbers"
TORCHTITAN_A100 = ("torchtitan docs/performance.md at 1ea476e9f (2024-04-24; pytorch/torchtitan), FSDP2 on 64 A100 80GB, "
                   "eager (train_configs compile = false)")

TORCHTITAN_ROWS: tuple[Paper, ...] = (
    _tokens_per_gpu("torchtitan", "Llama 3 8B FSDP2 64 A100 s8192 sel. AC", LLAMA3_8B, 8192, "A100-80GB", 64,
                    Strategy(precision="bf16", engine="torch", fsdp="full", dp=64, mbs=1, checkpointing="selective"),
                    2973.0, TORCHTITAN, 25e9),
    _tokens_per_gpu("torchtitan", "Llama 3 70B FSDP2 64 A100 s8192 full AC", LLAMA3_70B, 8192, "A100-80GB", 64,
                    Strategy(precision="bf16", engine="torch", fsdp="full", dp=64, mbs=1, checkpointing="full"),
                    331.0, TORCHTITAN, 25e9),
    _tokens_per_gpu("torchtitan", "Llama 3.1 8B FSDP 8 H100 (96GB, 500 W) s8192 sel. AC", LLAMA3_8B, 8192,
                    "H100-SXM", 8,
                    Strategy(precision="bf16", engine="torch", fsdp="full", dp=8, mbs=2, checkpointing="selective"),
                    5762.0, TORCHTITAN + " (Table 1: H100 96 GB HBM2e at 2.4 TB/s, 500 W: a slower part than the "
                    "catalogue's H100 SXM, priced as grand_teton_h100)", 50e9, gpu_spec=grand_teton_h100),
    _tokens_per_gpu("torchtitan", "Llama 3 8B FSDP2 64 A100 s8192 AC every 2 layers", LLAMA3_8B, 8192, "A100-80GB", 64,
                    Strategy(precision="bf16", engine="torch", fsdp="full", dp=64, mbs=1, checkpointing="full",
                             checkpoint_layers=16),
                    2904.0, TORCHTITAN_A100 + ", Llama 3 row 'selective layer'", 25e9),
    _tokens_per_gpu("torchtitan", "Llama 2 13B FSDP2 64 A100 s4096 no AC", LLAMA2_13B, 4096, "A100-80GB", 64,
                    Strategy(precision="bf16", engine="torch", fsdp="full", dp=64, mbs=2),
                    2162.0, TORCHTITAN_A100 + ", Llama 2 row 'no'", 25e9),
    _tokens_per_gpu("torchtitan", "Llama 2 13B FSDP2 64 A100 s4096 AC every 2 layers", LLAMA2_13B, 4096, "A100-80GB",
                    64, Strategy(precision="bf16", engine="torch", fsdp="full", dp=64, mbs=2, checkpointing="full",
                                 checkpoint_layers=20),
                    1914.0, TORCHTITAN_A100 + ", Llama 2 row 'selective layer'", 25e9),
    _tokens_per_gpu("torchtitan", "Llama 2 13B FSDP2 64 A100 s4096 sel. AC", LLAMA2_13B, 4096, "A100-80GB", 64,
                    Strategy(precision="bf16", engine="torch", fsdp="full", dp=64, mbs=2, checkpointing="selective"),
                    1904.0, TORCHTITAN_A100 + ", Llama 2 row 'selective op'", 25e9),
    _tokens_per_gpu("torchtitan", "Llama 2 70B FSDP2 64 A100 s4096 mbs1 sel. AC", LLAMA2_70B, 4096, "A100-80GB", 64,
                    Strategy(precision="bf16", engine="torch", fsdp="full", dp=64, mbs=1, checkpointing="selective"),
                    355.0, TORCHTITAN_A100 + ", Llama 2 row 'selective op', local batch 1", 25e9),
    _tokens_per_gpu("torchtitan", "Llama 2 70B FSDP2 64 A100 s4096 full AC", LLAMA2_70B, 4096, "A100-80GB", 64,
                    Strategy(precision="bf16", engine="torch", fsdp="full", dp=64, mbs=2, checkpointing="full"),
                    353.0, TORCHTITAN_A100 + ", Llama 2 row 'full'", 25e9),
)
"""torchtitan's published FSDP runs (tokens/s per GPU). Its "selective op" checkpointing is optplan's torch-engine
``selective`` (the same per-op policy, estimators/selective.py); its "selective layer" checkpoints every n-th
TransformerBlock (``selective_ac_option = 'n'``; the table does not give n: 2, the smallest, is priced:
``checkpoint_layers`` = half the layers under ``full``). The A100 cluster's network is not stated: 200 Gb/s per GPU
is assumed (25 GB/s, a DGX A100's eight HDR links), as for its Llama 3 rows. The same page at 395a52627 (2024-04-18)
lists Llama 2 70B at local batch 2 with selective layer and selective op AC as out of memory on these 80 GB GPUs
(tests/benchmarks/test_fsdp_published_data.py checks optplan refuses them and fits the batch-1 run)."""

NARAYANAN_ROWS: tuple[Paper, ...] = (
    _narayanan("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137.0),
    _narayanan("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138.0),
    _narayanan("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142.0),
    _narayanan("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135.0),
    _narayanan("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138.0),
    _narayanan("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140.0),
    _narayanan("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148.0),
    _narayanan("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155.0),
    _narayanan("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163.0),
    _narayanan("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163.0),
)
"""Narayanan et al. 2021 Table 1 (weak scaling, GPT shapes, sequence 2,048, vocabulary 51,200, fp16, full
recomputation, no flash attention, no sequence parallelism): achieved TFLOP/s per GPU counted with the
paper's eq. 3 (hardware FLOPs, recomputation included), turned into an iteration time. The table gives no
micro-batch size or schedule: micro-batch 1 and the plain 1F1B schedule are assumed (stated, not fitted)."""


def _korthikanti(params: str, heads: int, hidden: int, layers: int, pp: int, gpus: int, batch: int,
                 selective: bool, iteration_s: float) -> Paper:
    dp = gpus // (8 * pp)
    s = Strategy(precision="fp16", engine="megatron", tp=8, pp=pp, dp=dp, mbs=1, grad_accum=batch // dp,
                 sp=selective, flash=False, checkpointing="selective" if selective else "full", vpp=1)
    how = "sequence parallel + selective recompute" if selective else "full recompute"
    return Paper(set="korthikanti-table5", label=f"GPT {params} tp8 pp{pp} {gpus} A100 batch {batch} {how}",
                 arch=f"layers={layers},hidden={hidden},heads={heads},vocab=51200", seq=2048, gpu="A100-80GB",
                 gpus=gpus, strategy=s, measured_s=lambda: iteration_s,
                 source="Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models "
                        "(arXiv 2205.05198) Tables 3 and 5; Selene")


KORTHIKANTI_ROWS: tuple[Paper, ...] = tuple(
    _korthikanti(name, heads, hidden, layers, pp, gpus, batch, sel, t)
    for name, heads, hidden, layers, pp, gpus, batch, times in (
        ("22B", 64, 6144, 48, 1, 8, 4, (1.42, 1.10)),
        ("175B", 96, 12288, 96, 8, 64, 64, (18.13, 13.75)),
        ("530B", 128, 20480, 105, 35, 280, 280, (49.05, 37.83)),
        ("1T", 160, 25600, 128, 64, 512, 512, (94.42, 71.49)),
    )
    for sel, t in ((False, times[0]), (True, times[1])))
"""Korthikanti et al. 2022 Table 5: measured iteration time (s) of four GPT models (Table 3: tensor-parallel
8, micro-batch 1, sequence 2,048, vocabulary 51,200, data-parallel 1) with full recomputation and with
sequence parallelism + selective recomputation."""

LLAMA31_405B = "layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,gated=1,tied=0"
MEGATRON_BRIDGE = ("NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md (commit 067f987), Pre-Training "
                   "Performance, the latest container listing each (model, system, precision, GPU count): ")
"""NVIDIA's DGX systems: 8 GPUs per node with NVLink, 8 x 400 Gb/s InfiniBand (50 GB/s per GPU)."""


GPUS_PER_NVLINK_DOMAIN = {"GB200": 72, "GB300": 72}
"""DGX GB200 and GB300 racks join 72 GPUs in one NVLink domain; DGX H100/B200 nodes 8."""
BRIDGE_NIC_BYTES_PER_S = {"GB300": 100e9}
"""Scale-out bandwidth per GPU where it is not DGX's 400 Gb/s InfiniBand (50 GB/s): the GB300 NVL72 has a ConnectX-8
SuperNIC at 800 Gb/s per GPU (NVIDIA GB300 NVL72 specifications: 72 ConnectX-8 NICs per rack)."""


def _bridge(label: str, arch: str, gpu: str, gpus: int, strategy: Strategy, tokens_per_gpu_s: float,
            where: str) -> Paper:
    return _tokens_per_gpu("megatron-bridge", label, arch, 8192, gpu, gpus, strategy, tokens_per_gpu_s,
                           MEGATRON_BRIDGE + where, BRIDGE_NIC_BYTES_PER_S.get(gpu, 50e9),
                           GPUS_PER_NVLINK_DOMAIN.get(gpu, 8))


MEGATRON_BRIDGE_ROWS: tuple[Paper, ...] = (
    # Megatron-FSDP 8 (FSDP column 8): optplan's Megatron shards only the optimizer (zero 1), the closest plan
    _bridge("Llama 3 8B fp8-cs 8 H100 Megatron-FSDP mbs1 ga16", LLAMA3_8B, "H100-SXM", 8,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=8, mbs=1, grad_accum=16, comm_overlap=True),
            14451.0, "25.11, System DGX-H100, LLAMA3_8B FP8-CS (GBS 128, FSDP 8)"),
    _bridge("Llama 3 70B fp8 64 H100 tp4 pp8 vpp5", LLAMA3_70B, "H100-SXM", 64,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=2, tp=4, pp=8, vpp=5, mbs=1, grad_accum=128,
                     comm_overlap=True),
            1664.0, "26.04.01, Model LLAMA3_70B, DGX-H100 FP8 (GBS 256)"),
    _bridge("Llama 3.1 405B fp8 1024 H100 tp8 pp8 cp2 vpp8", LLAMA31_405B, "H100-SXM", 1024,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=8, tp=8, pp=8, cp=2, vpp=8, mbs=1,
                     grad_accum=192, comm_overlap=True),
            326.0, "26.06, Model LLAMA3.1_405B, DGX-H100 FP8 (GBS 1536)"),
    _bridge("Llama 3 8B fp8-cs 8 B200 mbs2 ga8", LLAMA3_8B, "B200", 8,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=8, mbs=2, grad_accum=8, comm_overlap=True),
            30624.0, "25.11, System DGX-B200, LLAMA3_8B FP8-CS (GBS 128)"),
    _bridge("Llama 3.1 405B fp8-cs 128 B200 tp4 pp8 cp2 vpp8", LLAMA31_405B, "B200", 128,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=2, tp=4, pp=8, cp=2, vpp=8, mbs=1,
                     grad_accum=32, comm_overlap=True),
            661.0, "25.11, System DGX-B200, LLAMA3.1_405B FP8-CS (GBS 64)"),
    # MXFP8 (32x32-block scaling, the parenthesised figures of 25.11) priced as optplan's per-tensor fp8 recipe
    _bridge("Llama 3 8B mxfp8 8 B200 mbs2 ga8", LLAMA3_8B, "B200", 8,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=8, mbs=2, grad_accum=8, comm_overlap=True),
            29521.0, "25.11, System DGX-B200, LLAMA3_8B FP8-MX (GBS 128)"),
    _bridge("Llama 3.1 405B mxfp8 128 B200 tp4 pp8 cp2 vpp8", LLAMA31_405B, "B200", 128,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=2, tp=4, pp=8, cp=2, vpp=8, mbs=1,
                     grad_accum=32, comm_overlap=True),
            624.0, "25.11, System DGX-B200, LLAMA3.1_405B FP8-MX (GBS 64)"),
    _bridge("Llama 3 8B fp8-cs 8 GB200 mbs2 ga8", LLAMA3_8B, "GB200", 8,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=8, mbs=2, grad_accum=8, comm_overlap=True),
            31508.0, "25.11, System DGX-GB200, LLAMA3_8B FP8-CS (GBS 128)"),
    _bridge("Llama 3 8B mxfp8 8 GB200 mbs2 ga8", LLAMA3_8B, "GB200", 8,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=8, mbs=2, grad_accum=8, comm_overlap=True),
            29789.0, "25.11, System DGX-GB200, LLAMA3_8B FP8-MX (GBS 128)"),
    # Megatron-FSDP 64 (FSDP column 64): priced as the distributed optimizer (zero 1), as the H100 8B row
    _bridge("Llama 3 70B fp8 64 GB200 Megatron-FSDP mbs2 ga2", LLAMA3_70B, "GB200", 64,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=64, mbs=2, grad_accum=2, comm_overlap=True),
            4224.0, "26.04.01, Model LLAMA3_70B, DGX-GB200 FP8 (GBS 256, FSDP 64)"),
    _bridge("Llama 3 70B mxfp8 64 GB200 tp2 pp4 vpp5", LLAMA3_70B, "GB200", 64,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=8, tp=2, pp=4, vpp=5, mbs=1, grad_accum=32,
                     comm_overlap=True),
            3712.0, "26.04.01, Model LLAMA3_70B, DGX-GB200 MXFP8 (GBS 256)"),
    _bridge("Llama 3.1 405B fp8 256 GB200 tp4 pp16 vpp4", LLAMA31_405B, "GB200", 256,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=4, tp=4, pp=16, vpp=4, mbs=1, grad_accum=384,
                     comm_overlap=True),
            843.0, "26.06, Model LLAMA3.1_405B, DGX-GB200 FP8 (GBS 1536)"),
    _bridge("Llama 3.1 405B mxfp8 256 GB200 tp4 pp16 vpp8", LLAMA31_405B, "GB200", 256,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=4, tp=4, pp=16, vpp=8, mbs=1, grad_accum=384,
                     comm_overlap=True),
            783.0, "26.06, Model LLAMA3.1_405B, DGX-GB200 MXFP8 (GBS 1536)"),
    # DGX-GB300 (Blackwell Ultra, added 2026-12-03 with the catalogue's GB300; transcribed before any prediction)
    _bridge("Llama 3 8B fp8-cs 8 GB300 mbs2 ga8", LLAMA3_8B, "GB300", 8,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=8, mbs=2, grad_accum=8, comm_overlap=True),
            37556.0, "25.11, System DGX-GB300, LLAMA3_8B FP8-CS (GBS 128)"),
    _bridge("Llama 3 8B mxfp8 8 GB300 mbs2 ga8", LLAMA3_8B, "GB300", 8,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=8, mbs=2, grad_accum=8, comm_overlap=True),
            36108.0, "25.11, System DGX-GB300, LLAMA3_8B FP8-MX (GBS 128)"),
    _bridge("Llama 3 70B fp8 64 GB300 Megatron-FSDP mbs2 ga2", LLAMA3_70B, "GB300", 64,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=64, mbs=2, grad_accum=2, comm_overlap=True),
            5248.0, "26.04.01, Model LLAMA3_70B, DGX-GB300 FP8 (GBS 256, FSDP 64)"),
    _bridge("Llama 3 70B mxfp8 64 GB300 pp4 vpp5", LLAMA3_70B, "GB300", 64,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=16, pp=4, vpp=5, mbs=1, grad_accum=16,
                     comm_overlap=True),
            4864.0, "26.04.01, Model LLAMA3_70B, DGX-GB300 MXFP8 (GBS 256)"),
    _bridge("Llama 3.1 405B fp8 256 GB300 tp4 pp8 vpp4", LLAMA31_405B, "GB300", 256,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=8, tp=4, pp=8, vpp=4, mbs=1, grad_accum=192,
                     comm_overlap=True),
            1048.0, "26.06, Model LLAMA3.1_405B, DGX-GB300 FP8 (GBS 1536)"),
    _bridge("Llama 3.1 405B mxfp8 256 GB300 tp2 pp8 cp2 vpp4", LLAMA31_405B, "GB300", 256,
            Strategy(precision="fp8", engine="megatron", zero=1, dp=8, tp=2, pp=8, cp=2, vpp=4, mbs=1, grad_accum=192,
                     comm_overlap=True),
            952.0, "26.06, Model LLAMA3.1_405B, DGX-GB300 MXFP8 (GBS 1536)"),
)
"""NVIDIA's Megatron-Bridge (NeMo) dense pre-training runs on H100, B200, GB200 and GB300 (tokens/s per GPU; sequence
8,192; Transformer Engine fp8 with current scaling, or MXFP8 block scaling priced as it), as its performance recipes run them (``perf_recipes/llama/h100/llama3.py``,
``llama31.py``): the tensor-parallel overlap with userbuffers, the distributed optimizer's overlapped gradient
reduce-scatter and parameter all-gather (optplan's ``comm_overlap``), no recomputation where the recipe sets none.
One row per (model, system, precision, GPU count): the latest container listing it, chosen before any prediction. A
GB200 or GB300 row runs in one 72-GPU NVLink domain per rack (gpus_per_node 72), a GB300 with its 800 Gb/s NIC per GPU.
The DGX-B300 rows are MoE only (benchmarks/fidelity_moe.py's concern); NVFP4 rows are left out (optplan has no fp4
recipe), and so are the SFT and LoRA tables."""

DGXC_NEMO = HERE / "data" / "dgxc_nemo_published.json"
DGXC_NEMO_2505 = HERE / "data" / "dgxc_nemo_v25_05_published.json"
DGXC_NIC_BYTES_PER_S = 50e9
"""DGX H100: 8 x 400 Gb/s InfiniBand per node; a GB200 NVL72 tray 4 x 400 Gb/s per 4 GPUs: 50 GB/s per GPU either way."""


def dgxc_nemo_rows(path: Path = DGXC_NEMO, set_: str = "dgxc-nemo") -> tuple[Paper, ...]:
    """NVIDIA's DGX Cloud benchmarking recipes (benchmarks/data/dgxc_nemo_*published.json): NeMo/Megatron-Core
    dense pre-training, bf16 and Transformer Engine fp8, the measured step time (s); a table's ``gpu`` (DGX H100 when
    absent; a GB200 runs in its rack's 72-GPU NVLink domain, ``GPUS_PER_NVLINK_DOMAIN``).
    Every run as its recipe ran it: the distributed optimizer (zero 1) with overlapped gradient reduce-scatter and
    parameter all-gather, sequence parallelism and the userbuffers tensor-parallel overlap when tp > 1 (optplan's
    ``comm_overlap``), flash attention; a run's own layers/pp/vpp where its configure.sh shortens the model."""
    doc = json.loads(path.read_text())
    release = doc["release"]
    out = []
    for table in doc["tables"]:
        lay = table["layout"]
        gpu = table.get("gpu", "H100-SXM")
        for run in table["runs"]:
            layers, pp, vpp = run.get("layers"), run.get("pp", lay["pp"]), run.get("vpp", lay["vpp"])
            arch = table["arch"] if layers is None else ",".join(
                f"layers={layers}" if part.startswith("layers=") else part for part in table["arch"].split(","))
            gpus, tp, cp, mbs = run["gpus"], lay["tp"], lay["cp"], lay["mbs"]
            dp = gpus // (tp * pp * cp)
            accum = run["global_batch"] // (dp * mbs)
            if dp * tp * pp * cp != gpus or dp * mbs * accum != run["global_batch"]:
                raise ValueError(f"{table['model']} {gpus} GPUs: layout does not divide the GPUs or the batch")
            strategy = Strategy(precision=table["precision"], engine="megatron", zero=1, dp=dp, tp=tp, pp=pp, cp=cp,
                                vpp=vpp, mbs=mbs, grad_accum=accum, sp=tp > 1, comm_overlap=True,
                                checkpointing=table["recompute"])
            shape = f"{layers}L " if layers is not None else ""
            layout = " ".join(f"{k}{v}" for k, v in (("tp", tp), ("pp", pp), ("cp", cp), ("vpp", vpp)) if v > 1)
            batch = f" gbs{run['global_batch']}" if gpu != "H100-SXM" else ""
            label = (f"{table['model']} {shape}{table['precision']} {gpus} {gpu.removesuffix('-SXM')} "
                     f"{layout}{batch}").rstrip()
            out.append(Paper(set=set_, label=label, arch=arch, seq=table["seq"], gpu=gpu, gpus=gpus,
                             strategy=strategy, measured_s=lambda t=run["step_s"]: t,
                             source=f"{table['source']['table']} ({release['repository']} {release['tag']})",
                             nic_bytes_per_s=DGXC_NIC_BYTES_PER_S,
                             gpus_per_node=GPUS_PER_NVLINK_DOMAIN.get(gpu, 8)))
    return tuple(out)


BLOOM = HERE / "data" / "bigscience_bloom_published.json"
BLOOM_NIC_BYTES_PER_S = 6.25e9
"""Jean Zay: 4 Omni-Path links of 100 Gb/s per 8-GPU node, 50 GB/s per node, 6.25 GB/s per GPU."""


def bloom_rows(path: Path = BLOOM) -> tuple[Paper, ...]:
    """BigScience's BLOOM-176B benchmarks (benchmarks/data/bigscience_bloom_published.json): Megatron-DeepSpeed on
    384 A100 80GB, bf16, the measured iteration time (s). Priced as optplan's Megatron engine with the run's layout:
    ZeRO-1 (DeepSpeed's BF16_Optimizer shards the optimizer state over data parallelism), full activation
    checkpointing, no flash attention, no sequence parallelism, the plain 1F1B schedule (DeepSpeed's pipeline
    engine), no communication overlap (neither Megatron's userbuffers nor an overlapped gradient reduction)."""
    doc = json.loads(path.read_text())
    out = []
    for run in doc["runs"]:
        layers, hidden, heads = run["layers"], run["hidden"], run["heads"]
        tp, pp, dp, mbs = run["tp"], run["pp"], run["dp"], run["mbs"]
        accum = run["global_batch"] // (dp * mbs)
        if dp * mbs * accum != run["global_batch"]:
            raise ValueError(f"BLOOM {layers}L h{hidden}: dp x mbs does not divide the global batch")
        strategy = Strategy(precision="bf16", engine="megatron", zero=1, dp=dp, tp=tp, pp=pp, mbs=mbs,
                            grad_accum=accum, sp=False, flash=False, checkpointing="full", vpp=1)
        arch = f"layers={layers},hidden={hidden},heads={heads},vocab=250880,ffn={4 * hidden},gated=0,tied=1"
        out.append(Paper(set="bigscience-bloom", label=f"BLOOM shape {layers}L h{hidden} a{heads} tp{tp} pp{pp} "
                         f"mbs{mbs} 384 A100", arch=arch, seq=2048, gpu="A100-80GB", gpus=dp * tp * pp,
                         strategy=strategy, measured_s=lambda t=run["step_s"]: t, source=run["source"],
                         nic_bytes_per_s=BLOOM_NIC_BYTES_PER_S))
    return tuple(out)


NEMO_LONG_CONTEXT = HERE / "data" / "nemo_long_context_published.json"


def nemo_flops_per_token(shape: dict[str, int], seq: int) -> float:
    """Model FLOPs per token, forward + backward (FLOP/token), as NeMo counted them until August 2025: L h^2 (12 + 12 g/a
    + 18 F/h + 12 s/h + 6 V/(L h)) for ``shape`` (layers L, hidden h, heads a, query groups g, MLP width F, vocabulary
    V) at ``seq`` tokens per sequence, the attention term over the whole s x s matrix (``nemo/utils/flops_formulas.py``
    ``llama2``/``llama3``; NeMo PR #14424, 6251117f, 2025-08-09, halved it for causal attention, after both sweeps were
    published). What turns a row's reported TFLOP/s into tokens/s."""
    L, h, a, g = shape["layers"], shape["hidden"], shape["heads"], shape["query_groups"]
    return L * h * h * (12 + 12 * g / a + 18 * shape["ffn"] / h + 12 * seq / h + 6 * shape["vocab"] / (L * h))


OUTSIDE_DOMAIN = "outside"
"""A row's ``domain`` when it is judged in its set's figures but left out of the time domain
(fidelity_published.py ``--write-domain``): it was priced with an attention kernel the engine no longer runs, so its
sequence lengths and layouts say nothing about how sure a plan priced with today's kernel is."""


def in_time_domain(row: Row) -> bool:
    """Whether ``row`` counts in the time domain's ranges and bands (every judged row but the :data:`OUTSIDE_DOMAIN`
    ones)."""
    return row.domain != OUTSIDE_DOMAIN


def nemo_long_context_rows(path: Path = NEMO_LONG_CONTEXT) -> tuple[Paper, ...]:
    """NeMo's long-sequence sweeps (benchmarks/data/nemo_long_context_published.json): Megatron-Core with Transformer
    Engine fp8 at 4K-1M tokens per sequence and context parallelism 1-32 on DGX H100 and DGX B200, each row its own
    layout (tp, pp, dp, cp; micro-batch 1), priced as the recipes ran them: the distributed optimizer (zero 1) with its
    overlapped collectives, sequence parallelism and the userbuffers overlap with tp > 1 (``comm_overlap``), the
    table's recomputation and attention kernel (the H100 container's Transformer Engine ran context parallelism on
    FlashAttention-2 only; each table's ``assumptions`` says what the source leaves unstated). Step time (s) = global
    batch x sequence / (tokens/s per GPU x GPUs), tokens/s from the reported model TFLOP/s by NeMo's count of the time
    (:func:`nemo_flops_per_token`). Rows priced with a kernel other than their engine's own stay out of the time
    domain (:data:`OUTSIDE_DOMAIN`)."""
    doc = json.loads(path.read_text())
    url = doc["release"]["table"]
    out = []
    for table in doc["tables"]:
        for run in table["runs"]:
            seq = run["seq_k"] * 1024
            tp, pp, dp, cp, gpus = run["tp"], run["pp"], run["dp"], run["cp"], run["gpus"]
            accum = run["global_batch"] // dp
            if tp * pp * dp * cp != gpus or dp * accum != run["global_batch"]:
                raise ValueError(f"{table['model']} {run['seq_k']}K: layout does not divide the GPUs or the batch")
            strategy = Strategy(precision=table["precision"], engine="megatron", zero=1, dp=dp, tp=tp, pp=pp, cp=cp,
                                mbs=1, grad_accum=accum, sp=tp > 1, comm_overlap=True,
                                checkpointing=table["recompute"])
            tokens_per_gpu_s = run["tflops_per_gpu"] * 1e12 / nemo_flops_per_token(table["shape"], seq)
            layout = " ".join(f"{k}{v}" for k, v in (("tp", tp), ("pp", pp), ("cp", cp)) if v > 1)
            label = (f"{table['model']} {run['seq_k']}K {table['precision']} {gpus} {table['gpu'].removesuffix('-SXM')} "
                     f"{layout}").rstrip()
            out.append(_tokens_per_gpu("nemo-long-context", label, table["arch"], seq, table["gpu"], gpus, strategy,
                                       tokens_per_gpu_s, f"{url} ({table['system']}, {table['container']})",
                                       DGXC_NIC_BYTES_PER_S, attention_kernel=table["attention_kernel"],
                                       domain=OUTSIDE_DOMAIN if table["attention_kernel"] else ""))
    return tuple(out)


FMS_FSDP = HERE / "data" / "fms_fsdp_published.json"
FMS_FSDP_SEQ = 4096
"""fms-fsdp's sequence length (``train_config.seq_length``; the blog: "4k sequence length")."""


def fms_fsdp_rows(path: Path = FMS_FSDP) -> tuple[Paper, ...]:
    """IBM's fms-fsdp runs (benchmarks/data/fms_fsdp_published.json): PyTorch FSDP pre-training of Llama 2 7B-70B
    shapes on 128 A100 80GB and 96 H100 80GB GPUs, batch 2 per GPU at 4,096 tokens, priced as optplan's torch engine
    runs them: FSDP FULL_SHARD (``fsdp="full"``) or HYBRID_SHARD inside each node (``"hybrid"``) over every GPU,
    bf16, eager, SDPA flash attention, no accumulation; checkpointing every n-th block as ``full`` over
    ``layers // n`` blocks (``checkpoint_layers``), or none. The cluster's stated inter-node bandwidth is per node (the
    file's ``assumptions``): per GPU it is an eighth. Step time (s) = GPUs x batch x 4,096 / (tokens/s per GPU x
    GPUs)."""
    doc = json.loads(path.read_text())
    src = doc["source"]
    out = []
    for run in doc["runs"]:
        arch = doc["models"][run["model"]]
        layers = parse_arch(arch).layers
        every = run["checkpoint_every"]
        if (run["ac"] == "every") != (every is not None) or (every is not None and layers % every):
            raise ValueError(f"fms-fsdp {run['model']}: checkpoint_every must divide the layers when ac is 'every'")
        for gpu, tokens_per_gpu_s in run["tokens_per_s_per_gpu"].items():
            cl = doc["clusters"][gpu]
            gpus, per_node = cl["gpus"], cl["gpus_per_node"]
            strategy = Strategy(precision="bf16", engine="torch", fsdp=run["sharding"], dp=gpus,
                                fsdp_reduce_dtype="bf16",  # bfSixteen: MixedPrecision(reduce_dtype=torch.bfloat16)
                                mbs=run["local_batch"], checkpointing="none" if every is None else "full",
                                checkpoint_layers=None if every in (None, 1) else layers // every)
            ac = "no AC" if every is None else ("full AC" if every == 1 else f"AC every {every}")
            label = (f"Llama 2 {run['model'].upper()} {'HSDP' if run['sharding'] == 'hybrid' else 'FSDP'} {gpus} "
                     f"{gpu.removesuffix('-SXM')} s{FMS_FSDP_SEQ} {ac}")
            out.append(_tokens_per_gpu("fms-fsdp", label, arch, FMS_FSDP_SEQ, gpu, gpus, strategy,
                                       float(tokens_per_gpu_s), f"{src['title']} ({src['url']})",
                                       cl["inter_node_gbps_per_node"] * 1e9 / 8 / per_node, gpus_per_node=per_node))
    return tuple(out)


PAPER: tuple[Paper, ...] = (NARAYANAN_ROWS + KORTHIKANTI_ROWS + TORCHTITAN_ROWS + MEGATRON_BRIDGE_ROWS
                            + dgxc_nemo_rows() + dgxc_nemo_rows(DGXC_NEMO_2505, "dgxc-nemo-25.05") + bloom_rows()
                            + nemo_long_context_rows() + fms_fsdp_rows())
"""Published tables."""


def paper_rows(papers: tuple[Paper, ...] = PAPER) -> list[Row]:
    """Rows of the published tables in ``papers`` (all of ``PAPER`` by default)."""
    out = []
    for p in papers:
        prof = profile_from_arch(parse_arch(p.arch, seq_len=p.seq))
        cluster = Cluster(gpu=p.gpu_spec() if p.gpu_spec else find_gpu(p.gpu), gpus=p.gpus, gpus_per_node=p.gpus_per_node,
                          inter_node_bandwidth_bytes_per_s=p.nic_bytes_per_s)
        out.append(Row(set=p.set, label=p.label, profile=prof, cluster=cluster, strategy=p.strategy,
                       measured_s=p.measured_s(), extra={"source": p.source}, attention_kernel=p.attention_kernel,
                       domain=p.domain))
    return out


def all_rows() -> list[Row]:
    """Every given set, in a stable order."""
    return vtrain_rows() + llmfoundry_rows() + paper_rows()


def split(rows: list[Row]) -> tuple[list[Row], list[Row]]:
    """(fit, held-out): alternating rows in file order within each set."""
    seen: dict[str, int] = {}
    fit, held = [], []
    for r in rows:
        i = seen.get(r.set, 0)
        (fit if i % 2 == 0 else held).append(r)
        seen[r.set] = i + 1
    return fit, held
