"""Expert-parallel all-to-all overlap: how much of the MoE dispatch/combine a batch-level overlap hides (seconds).

Megatron-Core's ``--overlap-moe-expert-parallel-comm`` (with ``--delay-wgrad-compute``; MoE guide,
``megatron/core/transformer/moe/README.md`` "EP A2A Overlap: overlaps All-to-All with computation by merging
FWD-BWD passes of adjacent microbatches"; MRs 3470 ff., 2025) runs one micro-batch's forward together with another
micro-batch's backward, layer by layer, on two streams: the schedule DeepSeek-V3 introduced (DeepSeek-V3 technical
report, arXiv 2412.19437 §3.2.1 and Figure 4: attention and MLP of one direction hide the dispatch and combine of
the other). What it hides, per layer:

- the forward all-to-alls (dispatch + combine) of one micro-batch run behind the other micro-batch's backward
  compute of that layer, the backward all-to-alls behind its forward compute; whatever exceeds the window it
  hides behind stays on the critical path: exposed = max(0, a2a_fwd − backward) + max(0, a2a_bwd − forward);
- passes with no partner are not overlapped at all: with one pipeline stage the schedule is F1, (F2 B1), ...,
  (Fm Bm−1), Bm, so 1/m of the passes run alone; with pp stages and v virtual stages per rank the first rank's
  warm-up runs 2·(pp − 1) + (v − 1)·pp chunk forwards alone (Megatron's interleaved warm-up,
  ``megatron/core/pipeline_parallel/schedules.py``), as many backwards cool down alone, out of m·v each;
- the hidden communication still takes streaming multiprocessors from the compute it hides behind: DeepSeek-V3
  dedicates 20 of the H100's 132 SMs to it (§3.2.1, "only 20 SMs are sufficient"; Megatron's DeepEP default,
  ``moe_deepep_num_sms`` = 20), so compute runs at (132 − 20)/132 for the hidden time: a stated
  :data:`EP_OVERLAP_INTERFERENCE` of the hidden time is added back.

Megatron's rules for the option (``TransformerConfig.__post_init__``): expert parallelism > 1, the alltoall or flex
dispatcher, no full recomputation and no recomputed ``moe`` module, a bf16 or fp16 model, and virtual pipeline stages when pp > 1
(Strategy enforces them).
"""

from __future__ import annotations

EP_OVERLAP_COMM_SMS = 20
"""SMs the overlapped all-to-all kernels occupy (DeepSeek-V3 report §3.2.1; Megatron-Core's DeepEP default)."""
HOPPER_SMS = 132
"""Streaming multiprocessors of an H100/H200/H800 SXM (NVIDIA H100 Tensor Core GPU Architecture whitepaper)."""
EP_OVERLAP_INTERFERENCE = EP_OVERLAP_COMM_SMS / HOPPER_SMS
"""Share of the hidden all-to-all time that still delays compute (dimensionless, ≈ 0.15; Hopper's SM count, used
for every GPU: Blackwell's 148 SMs would make it 0.14)."""


OVERLAP_PRECISIONS = ("bf16", "fp16", "fp8")
"""Recipes whose Megatron model is bf16 or fp16 (fp8 runs on a bf16 model), which the overlap requires."""
OVERLAP_EXCLUDED_RECOMPUTE = ("full", "moe")
"""Recomputation the overlap excludes: full layers, and the ``moe`` module (Megatron's rules)."""


def recipe_allows_overlap(precision: str, checkpointing: str) -> bool:
    """Whether Megatron's overlap rules admit the recipe: a 16-bit model, no full recomputation and no "moe" among
    the recomputed modules."""
    return precision in OVERLAP_PRECISIONS and checkpointing not in OVERLAP_EXCLUDED_RECOMPUTE


def solo_fraction(pp: int, vpp: int, microbatches: int) -> float:
    """Share of the forward (and of the backward) chunk passes that have no other micro-batch's pass to overlap
    with (dimensionless, 0-1): 1/m with one stage; the first rank's interleaved warm-up
    (2·(pp − 1) + (vpp − 1)·pp chunk passes) out of m·vpp with pipeline stages."""
    m = max(1, microbatches)
    if pp <= 1:
        return 1.0 / m
    warmup = 2 * (pp - 1) + (max(1, vpp) - 1) * pp
    return min(1.0, warmup / (m * max(1, vpp)))


def overlapped_a2a_s(a2a_fwd_s: float, a2a_bwd_s: float, fwd_window_s: float, bwd_window_s: float,
                     solo: float) -> float:
    """The exposed all-to-all time of one layer and micro-batch under the batch-level overlap (seconds): passes
    alone (``solo``) expose all of it; paired passes expose the forward all-to-alls' excess over the partner's
    backward (``bwd_window_s``) and the backward's over its forward (``fwd_window_s``), plus
    :data:`EP_OVERLAP_INTERFERENCE` of what was hidden."""
    total = a2a_fwd_s + a2a_bwd_s
    left = max(0.0, a2a_fwd_s - bwd_window_s) + max(0.0, a2a_bwd_s - fwd_window_s)
    paired = left + EP_OVERLAP_INTERFERENCE * (total - left)
    return solo * total + (1.0 - solo) * paired
