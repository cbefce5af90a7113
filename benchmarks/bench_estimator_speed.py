"""Speed of the analytic estimators and the search (issue 3 target: a 175B --arch estimate on 1,536
GPUs under 50 ms).

Run: python benchmarks/bench_estimator_speed.py   (prints figures; no assertions)
"""

from __future__ import annotations

import time

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from optplan.planner.recommend import recommend

TARGET_MS = 50.0


def _per_estimate_s(prof, cluster, strategy, n: int = 1000) -> float:  # noqa: ANN001
    estimate(prof, cluster, strategy)  # warm caches (catalogue, recipes)
    t0 = time.perf_counter()
    for _ in range(n):
        estimate(prof, cluster, strategy)
    return (time.perf_counter() - t0) / n


def main() -> None:
    prof = profile_from_arch(parse_arch("layers=96,hidden=12288,heads=96,seq=2048"))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=1536, gpus_per_node=8)
    cases = {
        "ZeRO-3, dp 1536": Strategy(zero=3, mbs=1, dp=1536, checkpointing="full"),
        "tp 8 x pp 16 (vpp 2) x dp 12, 1F1B": Strategy(zero=1, mbs=1, grad_accum=64, tp=8, pp=16, vpp=2, dp=12,
                                                       checkpointing="selective", engine="megatron"),
        "tp 8 x cp 2 x pp 8 x dp 12": Strategy(zero=1, mbs=1, grad_accum=32, tp=8, cp=2, pp=8, dp=12,
                                               engine="megatron"),
    }
    for name, strategy in cases.items():
        per = _per_estimate_s(prof, cluster, strategy)
        est = estimate(prof, cluster, strategy)
        print(f"175B (GPT-3 shape) on 1,536 x H100, {name}: one estimate {per * 1e3:.3f} ms "
              f"(target < {TARGET_MS:.0f} ms); step {est.time.step_s:.2f} s, MFU {100 * est.mfu:.1f}%")
    gpt2 = profile_from_arch(parse_arch("layers=12,hidden=768,heads=12,vocab=50257,seq=1024"))
    node = Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8)
    t0 = time.perf_counter()
    rec = recommend(gpt2, node, global_batch=512)
    print(f"GPT-2 small on 8 x H100, full recommend (search {rec.search.evaluated} plans + rationale): "
          f"{(time.perf_counter() - t0) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
