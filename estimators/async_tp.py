"""torch's async tensor parallelism: the sequence-parallel collectives of each forward pass fused with their
matmuls and micro-pipelined over symmetric memory (seconds hidden).

torchtitan's ``--parallelism.enable_async_tensor_parallel`` turns on Inductor's ``_micro_pipeline_tp`` pass
(``torch/_inductor/fx_passes/micro_pipeline_tp.py``), which rewrites two patterns of a compiled graph: an
all-gather whose result is the left operand of one or more matmuls (the QKV projections, w1/w3) into
``symm_mem.fused_all_gather_matmul``, and a reduce-scatter of one matmul's output (wo, w2) into
``fused_matmul_reduce_scatter`` (``_scaled_mm`` variants for float8). Each runs ``tp`` sub-matmuls, one per shard,
while the copy engines pull or push the other shards over NVLink (``torch/distributed/_symmetric_memory``
``_pipelined_multi_all_gather_and_consume``, ``_pipelined_produce_and_all2all``): the local shard's matmul, the
barriers and the final reduction of the partials stay on the critical path, and the smaller sub-matmuls lose
waves (Wang et al., "[Distributed w/ TorchTitan] Introducing Async Tensor Parallelism in PyTorch",
discuss.pytorch.org/t/209487, 2024). In the backward graph the reduce-scatters take sums of several dgrad
matmuls (dQ+dK+dV, dW1+dW3), which the single-matmul pattern does not match (pytorch PR #149946); the post's
end-to-end gains (~8 %) are its forward gains (20-30 % of the forward) and nothing in backward.

Priced: each forward pass's tensor-parallel collectives (also the forward that full recomputation re-runs, which
the partitioner compiles with the same fusions) hide :data:`ASYNC_TP_HIDDEN_SHARE` of the part of them that the
pass's linear GEMMs could cover (the whole layer's: in an MoE layer whose MLP has no TP collective the attention's
may count the experts' GEMMs, an optimistic bound). Assumed, not measured (the share was calibrated on forward
durations): backward's collectives, and the all-gathers that per-op selective checkpointing issues again in
backward (estimators/selective.py), stay exposed; the backward all-gather of the row-parallel layers' output
gradient and a recomputed all-gather feeding a recomputed matmul match the fused pattern and may hide some, which
would make the plan faster than priced. The symmetric-memory buffers (the gathered input, the partials) are not
priced in memory. Only inside one NVLink node (validity.py).

Units: seconds; the share is dimensionless.
"""

from __future__ import annotations

ASYNC_TP_HIDDEN_SHARE = 0.59
"""Share of a forward pass's tensor-parallel collective time (as optplan prices it, comm.tp_collective_s) that
async TP removes from the pass (dimensionless). Measured by the forward durations of the dev-discuss post's Fig. 9
(vanilla -> async TP, bf16, torch.compile, 64 H100 96 GB 500 W, FSDP 8 x TP 8, seq 8,192): Llama 3 8B batch 12
880 -> 678 ms and batch 8 597 -> 464 ms, 70B batch 12 5,629 -> 4,724 ms, batch 8 3,765 -> 3,124 ms, batch 4
1,937 -> 1,610 ms; against optplan's forward collectives of those layouts (329, 221, 1,632, 1,091, 551 ms) the
saving is 0.61, 0.60, 0.55, 0.59, 0.59 of them. Checked, not fitted, on torchtitan's June 2025 async-TP table
(benchmarks/fidelity_torchtitan.py: the end-to-end pairs, bf16 and float8)."""


def async_tp_hidden_s(pass_comm_s: float, pass_linear_gemm_s: float) -> float:
    """Seconds of one forward pass's tensor-parallel collectives (``pass_comm_s``) that async TP hides behind the
    pass's linear GEMMs (``pass_linear_gemm_s``; the attention core overlaps none): :data:`ASYNC_TP_HIDDEN_SHARE`
    of what the GEMMs could cover."""
    if pass_comm_s <= 0 or pass_linear_gemm_s <= 0:
        return 0.0
    return ASYNC_TP_HIDDEN_SHARE * min(pass_comm_s, pass_linear_gemm_s)
