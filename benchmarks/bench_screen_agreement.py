"""Does screening layouts lose the enumerated pick? Figures only, no assertions.

Run: python benchmarks/bench_screen_agreement.py [--cases NAME,...] [--keep N]

For each case (a model shape by ``--arch`` and a cluster), the same space is searched twice: ``enumerate``
(every group priced, the reference) and ``screen`` (every layout priced through its probe group, the
``screen_keep`` best enumerated in full; planner/search.py). Printed per case: the space (points, layouts),
each method's wall time and candidates priced, whether the picks are the same plan, and the screen pick's
robust figure (the objective's figure at the band's slow end, what ``rank`` sorts by: samples/s, time to train or
GPU-hours) as a share of the enumerated pick's.
A share of 100.0 % with another plan is a tie under the ranking's own order (same figure, simpler plan).

This is the evidence behind ``ENUMERATE_LIMIT`` (the space size above which ``auto`` screens): where the
shares stay at 100 %, screening costs nothing in plan quality and saves the wall time shown.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import NamedTuple

import optplan.planner.search as search_mod
from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.planner.goal import Goal
from optplan.planner.search import screen_keep, search
from optplan.planner.space import build_space

LLAMA_8B = "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,seq=8192,gated=1,tied=0"
LLAMA_70B = "layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256,seq=4096,gated=1,tied=0"
MIXTRAL = ("layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000,experts=8,topk=2,moe_ffn=14336,"
           "gated=1,tied=0,seq=4096")
DSV2_LITE = ("layers=27,hidden=2048,heads=16,ffn=10944,vocab=102400,experts=64,topk=6,moe_ffn=1408,shared_experts=2,"
             "first_dense=1,moe_every=1,gated=1,tied=0,kv_lora=512,rope_dim=64,nope_dim=128,v_dim=128,seq=4096")
DSV3 = ("layers=61,hidden=7168,heads=128,ffn=18432,vocab=129280,experts=256,topk=8,moe_ffn=2048,shared_experts=1,"
        "first_dense=3,moe_every=1,gated=1,tied=0,kv_lora=512,q_lora=1536,rope_dim=64,nope_dim=128,v_dim=128,seq=4096")
GPT3 = "layers=96,hidden=12288,heads=96,vocab=51200,seq=2048"
SMALL_MOE = "layers=13,hidden=2048,heads=16,ffn=8192,vocab=32000,gated=1,tied=0,experts=64,topk=8,moe_ffn=512,seq=4096"

class Case(NamedTuple):
    arch: str
    gpu: str
    gpus: int
    global_batch: int | None = None  # None: the free batch
    goal: Goal = Goal()
    gpu_counts: tuple[int, ...] | None = None  # the GPU counts searched (default: gpus)


CASES: dict[str, Case] = {
    "llama8b-8": Case(LLAMA_8B, "H100-SXM", 8),
    "llama8b-64-gb512": Case(LLAMA_8B, "H100-SXM", 64, 512),
    "llama70b-64-gb256": Case(LLAMA_70B, "H100-SXM", 64, 256),
    "mixtral-8-offload": Case(MIXTRAL, "H100-SXM", 8),  # fits only with CPU offload (the screen once found none)
    "mixtral-32": Case(MIXTRAL, "H100-SXM", 32),
    "mixtral-64-gb512": Case(MIXTRAL, "A100-80GB", 64, 512),
    "small-moe-16": Case(SMALL_MOE, "H100-SXM", 16, 512),
    "dsv2lite-16": Case(DSV2_LITE, "H100-SXM", 16),
    "dsv2lite-32": Case(DSV2_LITE, "H100-SXM", 32),
    "dsv2lite-64-gb1024": Case(DSV2_LITE, "H200", 64, 1024),
    # memory-tight: ZeRO-3/FSDP, offload and full recomputation compete with the probes' settings
    "llama8b-16-a100-40gb": Case(LLAMA_8B, "A100-40GB", 16, 256),
    "llama70b-32-a100-40gb": Case(LLAMA_70B, "A100-40GB", 32, 128),
    "mixtral-16-a100-40gb": Case(MIXTRAL, "A100-40GB", 16, 256),
    "dsv2lite-8-l40s": Case(DSV2_LITE, "L40S", 8, 64),
    # the other objectives, as benchmarks/bench_search_scale.py plans them
    "gpt3-1024-a100-time": Case(GPT3, "A100-80GB", 1024, 1536, Goal(objective="time", tokens=300e9)),
    "llama70b-512to4096-cost": Case(LLAMA_70B, "H100-SXM", 4096, 1024,
                                    Goal(objective="cost", tokens=15e12, price_per_gpu_hour=2.5),
                                    (512, 1024, 2048, 4096)),
    # the README's screened case (about 2 minutes to enumerate on 2 cores)
    "dsv3-2048-gb15360": Case(DSV3, "H100-SXM", 2048, 15360),
}


def run_case(name: str) -> tuple[float, bool]:
    case = CASES[name]
    prof = profile_from_arch(parse_arch(case.arch))
    cluster = Cluster(gpu=find_gpu(case.gpu), gpus=case.gpus, gpus_per_node=8)
    space = build_space(prof, cluster, global_batch=case.global_batch, gpu_counts=case.gpu_counts)
    goal = case.goal
    out = {}
    for method in ("enumerate", "screen"):
        t0 = time.perf_counter()
        res = search(prof, cluster, space, goal=goal, method=method)  # type: ignore[arg-type]
        out[method] = (res, time.perf_counter() - t0)
    (full, full_s), (scr, scr_s) = out["enumerate"], out["screen"]
    best, got = full.ranked[0], scr.ranked[0]
    f_best, f_got = goal.figure(best, "slow"), goal.figure(got, "slow")  # lower is better (-samples/s, s, GPU-h)
    share = f_got / f_best if f_best < 0 else f_best / f_got
    same = got.strategy == best.strategy
    kept = screen_keep(len(space.layouts))
    print(f"{name:<20} {space.size:>8,} {len(space.layouts):>6,} {min(kept, len(space.layouts)):>5,} | "
          f"{full_s:7.1f} s {full.evaluated:>7,} | {scr_s:6.1f} s {scr.evaluated:>7,} | "
          f"{'same' if same else 'other':>5} {share * 100:6.1f} %  {got.strategy.label()}")
    sys.stdout.flush()
    return share, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names (default: all)")
    ap.add_argument("--keep", type=int, default=None,
                    help="screen this many layouts at least (default: planner/search.py's SCREEN_KEEP_LAYOUTS)")
    args = ap.parse_args()
    if args.keep is not None:
        search_mod.SCREEN_KEEP_LAYOUTS = args.keep
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
    print(f"{'case':<20} {'points':>8} {'layouts':>6} {'kept':>5} | {'enumerate':>17} | {'screen':>16} | "
          f"{'pick':>5} {'share':>8}")
    results = [run_case(n) for n in names]
    worst = min(s for s, _ in results)
    print(f"screen agreement: same pick in {sum(same for _, same in results)} of {len(results)} cases; "
          f"worst share of the enumerated pick's robust figure {worst * 100:.1f} %")


if __name__ == "__main__":
    main()
