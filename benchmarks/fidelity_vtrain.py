"""Step-time fidelity against measured Megatron-DeepSpeed runs on A100 (vTrain data set).

Data: ../shared/data/vtrain_single_node.csv (vTrain, arXiv 2312.12391, MIT licence): iteration times of
GPT models (hidden 1024/2048, 12-24 layers, seq 1024) on 2-8 A100 GPUs, fp16 with activation
checkpointing. optplan's estimators cover data parallelism today, so only the rows with TP = PP = 1
are compared. Profiles are built from the GPT shape (no torch): parameters 12·L·h² + 13·L·h + V·h + s·h,
forward FLOPs per sample (2·N + 4·L·h·s)·s (PaLM Appendix B: 6N + 12·L·h·s per token for training),
activations from Korthikanti et al. Table 2 (Megatron without flash attention keeps the a·s² term).

Run: python benchmarks/fidelity_vtrain.py   (prints the error table; no assertions)
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.profile import ActivationFit, ModelProfile, RepeatedBlock, TransformerShape
from optplan.estimators.strategy import Strategy

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "vtrain_single_node.csv"
VOCAB = 50257


def gpt_profile(hidden: int, layers: int, heads: int, seq: int) -> ModelProfile:
    params = 12 * layers * hidden**2 + 13 * layers * hidden + VOCAB * hidden + seq * hidden
    fwd = (2 * params + 4 * layers * hidden * seq) * seq
    # Korthikanti et al. 2022 Table 2, no parallelism, 16-bit: s·h·(34 + 5·a·s/h) bytes per layer per sample
    per_layer = seq * hidden * (34 + 5 * heads * seq / hidden)
    full = int(layers * per_layer)
    ckpt = int(layers * 2 * seq * hidden + per_layer)
    acts = tuple(ActivationFit(precision=p, checkpointing=c, fixed_bytes=0,
                               per_sample_bytes=(full if c == "none" else ckpt) * (2 if p == "fp32" else 1))
                 for p in ("fp32", "bf16") for c in ("none", "full"))
    return ModelProfile(
        name=f"gpt-h{hidden}-l{layers}", path="vtrain", model_class="GPT", params=params, trainable_params=params,
        params_by_module={}, repeated_block=RepeatedBlock(class_name="Block", count=layers,
                                                          params_per_block=12 * hidden**2),
        input_kind="tokens", seq_len=seq, tokens_per_sample=seq, fwd_flops_per_sample=fwd,
        bwd_flops_per_sample=2 * fwd, activations=acts,
        transformer=TransformerShape(hidden=hidden, layers=layers, heads=heads, vocab=VOCAB))


def main() -> None:
    gpu = find_gpu("A100-80GB")
    rows = [r for r in csv.DictReader(DATA.open()) if r["tensor parallelism"] == "1"
            and r["pipeline parallelism"] == "1"]
    ratios = []
    by_shape: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        h, layers, dp = int(r["hidden size"]), int(r["# layers"]), int(r["data parallelism"])
        mbs, gb = int(r["micro batch"]), int(r["global batch"])
        prof = gpt_profile(h, layers, int(r["attention heads"]), int(r["sequence length"]))
        s = Strategy(precision="fp16", zero=0, mbs=mbs, grad_accum=gb // (mbs * dp), dp=dp, checkpointing="full")
        est = estimate(prof, Cluster(gpu=gpu, gpus=dp, gpus_per_node=8), s)
        ratio = est.time.step_s / (float(r["iteration time (ms)"]) / 1e3)
        ratios.append(ratio)
        by_shape.setdefault((h, mbs), []).append(ratio)
    ape = [abs(x - 1) for x in ratios]
    print(f"rows compared (TP=PP=1): {len(rows)} on A100-80GB, fp16, full checkpointing, ZeRO-0")
    print(f"predicted/measured step time: median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}; MAPE {100 * statistics.mean(ape):.1f}%")
    print(f"{'hidden':>6} {'mbs':>4} {'rows':>5} {'median ratio':>13}")
    for (h, mbs), rs in sorted(by_shape.items()):
        print(f"{h:>6} {mbs:>4} {len(rs):>5} {statistics.median(rs):>13.3f}")


if __name__ == "__main__":
    main()
