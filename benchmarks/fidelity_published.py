"""Out-of-sample check of the step-time model against published training throughputs (not fitted on).

Rows (each with its source):
- Narayanan et al. 2021 (arXiv 2104.04473) Table 1: GPT-3 175B on 1,536 A100-80GB, tp 8, pp 16, global
  batch 1,536, fp16, full recomputation, no sequence parallelism: 153 TFLOP/s per GPU counted with their
  eq. 3 (recomputation included), compared with ``hardware_tflops_per_gpu``.
- torchtitan docs/performance.md (pytorch/torchtitan, "Llama 3 performance numbers"): FSDP2 on 64
  A100-80GB, seq 8192, local batch 1: Llama 3 8B with selective (op) checkpointing 2,973 tokens/s per GPU;
  Llama 3 70B with full checkpointing 331 tokens/s per GPU.
- torchtitan docs/performance.md (Llama 3.1 8B, Table 1): FSDP on 8 H100 (96 GB HBM2e, 2.4 TB/s, 500 W
  power limit), local batch 2, seq 8192, selective checkpointing, eager: 5,762 tokens/s per GPU. The
  catalogue's H100-SXM (80 GB, 3.35 TB/s, 700 W) is a faster part, so this row is a loose check.

torchtitan's "selective op" checkpointing recomputes more than Korthikanti's selective recomputation
(optplan's ``selective``), so its memory is not comparable and only throughput is printed.

Run: python benchmarks/fidelity_published.py   (prints predicted vs reported; no assertions)
"""

from __future__ import annotations

from dataclasses import dataclass

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy

LLAMA3_8B = "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0"
LLAMA3_70B = "layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256,gated=1,tied=0"
GPT3_175B = "layers=96,hidden=12288,heads=96,vocab=51200"


@dataclass(frozen=True)
class Row:
    name: str
    arch: str
    seq: int
    gpu: str
    gpus: int
    strategy: Strategy
    reported: float
    metric: str  # "tokens_per_gpu" or "hardware_tflops_per_gpu"
    source: str


ROWS = (
    Row("GPT-3 175B, Megatron tp8 pp16", GPT3_175B, 2048, "A100-80GB", 1536,
        Strategy(precision="fp16", engine="megatron", tp=8, pp=16, dp=12, sp=False, grad_accum=128, mbs=1,
                 checkpointing="full", flash=False),
        153.0, "hardware_tflops_per_gpu", "Narayanan et al. 2021 Table 1"),
    Row("Llama 3 8B, FSDP2 64xA100, sel. AC", LLAMA3_8B, 8192, "A100-80GB", 64,
        Strategy(precision="bf16", engine="torch", fsdp="full", dp=64, mbs=1, checkpointing="selective"),
        2973.0, "tokens_per_gpu", "torchtitan docs/performance.md"),
    Row("Llama 3 70B, FSDP2 64xA100, full AC", LLAMA3_70B, 8192, "A100-80GB", 64,
        Strategy(precision="bf16", engine="torch", fsdp="full", dp=64, mbs=1, checkpointing="full"),
        331.0, "tokens_per_gpu", "torchtitan docs/performance.md"),
    Row("Llama 3.1 8B, FSDP 8xH100, sel. AC", LLAMA3_8B, 8192, "H100-SXM", 8,
        Strategy(precision="bf16", engine="torch", fsdp="full", dp=8, mbs=2, checkpointing="selective"),
        5762.0, "tokens_per_gpu", "torchtitan docs/performance.md (H100 96GB, 500 W)"),
)


def predicted(row: Row) -> float:
    profile = profile_from_arch(parse_arch(row.arch, seq_len=row.seq))
    cluster = Cluster(gpu=find_gpu(row.gpu), gpus=row.gpus, gpus_per_node=8)
    est = estimate(profile, cluster, row.strategy)
    if row.metric == "tokens_per_gpu":
        return (est.tokens_per_s or 0.0) / row.strategy.world_size
    return est.time.hardware_tflops_per_gpu


def main() -> None:
    print(f"{'case':<38} {'metric':<24} {'reported':>9} {'predicted':>10} {'ratio':>6}  source")
    ratios = []
    for row in ROWS:
        pred = predicted(row)
        ratios.append(pred / row.reported)
        print(f"{row.name:<38} {row.metric:<24} {row.reported:>9.0f} {pred:>10.0f} {pred / row.reported:>6.2f}  "
              f"{row.source}")
    print(f"predicted/reported: min {min(ratios):.2f}, max {max(ratios):.2f} over {len(ratios)} published runs")


if __name__ == "__main__":
    main()
