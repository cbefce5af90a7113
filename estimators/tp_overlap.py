"""Megatron-Core's communication overlaps: tensor-parallel collectives behind GEMMs, data-parallel reduction behind
the backward, pipeline sends behind other chunks (seconds).

Three mechanisms of the Megatron stack that NVIDIA's own performance recipes turn on (Megatron-Bridge
``recipes/llama/h100/llama3.py``, Llama 3 70B on H100: ``tp_comm_overlap=True`` with
``userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192``, ``ddp.overlap_grad_reduce = True``,
``ddp.overlap_param_gather = True``), which optplan prices when a plan sets ``comm_overlap`` (the first two) or
by default (the third):

- **Tensor parallelism** (``--tp-comm-overlap``, Transformer Engine userbuffers; Megatron requires sequence
  parallelism, ``arguments.py``: "Tensor parallel communication/GEMM overlap can happen only when sequence
  parallelism is enabled"). The all-gather before the QKV and FC1 GEMMs runs as a ring exchange, each step's
  chunk multiplied while the next arrives; the reduce-scatter after the projection and FC2 GEMMs is pipelined
  over ``num_splits`` = 4 GEMM chunks (Megatron-Bridge ``training/comm_overlap.py``: ``RingExchangeOverlapCfg``
  for qkv/fc1 fprop and proj/fc2 dgrad, ``PipelineOverlapCfg(num_splits=4)`` for proj/fc2 fprop, bulk overlaps
  for the wgrad/dgrad all-gathers). What stays exposed per pass is the collectives' excess over the linear GEMMs
  of that pass, and at least one split of them (the first chunk cannot hide behind a GEMM that needs it, the
  last reduce-scatter has no GEMM after it): exposed = max(comm − gemm, comm / :data:`TP_OVERLAP_SPLITS`).
  The hidden part still costs streaming multiprocessors: the bf16 configuration gives the pipelined
  reduce-scatters 16-24 SMs and the bulk overlaps 2-24, the ring exchanges run on copy engines;
  :data:`TP_OVERLAP_INTERFERENCE` of the hidden time is added back.
- **Data parallelism** (``--overlap-grad-reduce``, and with the distributed optimizer ``--overlap-param-gather``;
  Megatron ``arguments.py``: param gather only with the distributed optimizer and grad-reduce overlap). The
  gradient reduce-scatter (all-reduce without the distributed optimizer) runs bucket by bucket as the last
  micro-batch's backward produces them, the parameter all-gather bucket by bucket ahead of the next step's first
  forward: each exposes its excess over that window and at least its last bucket (one layer's share), plus
  :data:`DP_OVERLAP_INTERFERENCE` of what is hidden (NCCL's kernels run on SMs).
  Under Megatron's interleaved schedule each model chunk's collective is issued on its own, as soon as that
  chunk's last backward ends (and each chunk's all-gather a chunk round ahead of its first forward): all but the
  last chunk's hide behind the cool-down's later chunk passes (``interleaved_dp_s``).
- **Pipeline sends under interleaving**: Megatron's interleaved 1F1B posts each chunk's send/receive
  asynchronously and computes another chunk meanwhile (``--no-overlap-p2p-communication`` turns it off; on by
  default, ``arguments.py``; the non-interleaved schedule cannot overlap and Megatron sets it False there).
  The steady-state sends are hidden: :data:`P2P_EXPOSED_INTERLEAVED` of them stay on the critical path.
"""

from __future__ import annotations

from optplan.estimators.strategy import Strategy

TP_OVERLAP_SPLITS = 4
"""GEMM chunks a pipelined tensor-parallel overlap splits into (Megatron-Bridge's userbuffers configurations:
``PipelineOverlapCfg(num_splits=4)``); one chunk's worth of communication stays exposed (dimensionless)."""
HOPPER_SMS = 132
"""Streaming multiprocessors of an H100/H200 SXM (NVIDIA H100 Tensor Core GPU Architecture whitepaper)."""
TP_OVERLAP_INTERFERENCE = 10 / HOPPER_SMS
"""Share of the hidden tensor-parallel time that still delays the GEMMs (dimensionless, ≈ 0.08): half the
collectives (the pipelined reduce-scatters, 16-24 SMs in the bf16 H100 configuration) take ~20 of 132 SMs, the
ring-exchange all-gathers run on copy engines."""
DP_OVERLAP_INTERFERENCE = 20 / HOPPER_SMS
"""Share of the hidden data-parallel time that still delays compute (dimensionless, ≈ 0.15): NCCL's ring kernels
occupy 16-32 SMs while they run (NCCL's default channel count on NVLink/IB systems), stated as ~20 of 132."""
P2P_EXPOSED_INTERLEAVED = 0.0
"""Share of the interleaved schedule's pipeline sends left exposed in the steady state (dimensionless): Megatron's
``overlap_p2p_comm`` hides each behind another chunk's compute; the fill and drain, where a send has nothing to
hide behind, are the bubble's time already."""


def overlaps_tp(strategy: Strategy) -> bool:
    """Whether the plan hides its tensor-parallel collectives behind GEMMs (``comm_overlap`` with tp > 1)."""
    return strategy.comm_overlap and strategy.tp > 1


def overlaps_dp(strategy: Strategy) -> bool:
    """Whether the plan overlaps its data-parallel reduction (and, with the distributed optimizer, the parameter
    all-gather) with compute."""
    return strategy.comm_overlap and strategy.engine == "megatron"


def overlaps_p2p(strategy: Strategy) -> bool:
    """Whether the pipeline sends run behind other chunks: Megatron's interleaved schedule (its default)."""
    return strategy.engine == "megatron" and strategy.pp > 1 and strategy.vpp > 1


def overlapped_tp_s(comm_s: float, gemm_s: float) -> float:
    """Exposed seconds of one pass's tensor-parallel collectives (``comm_s``) run behind its linear GEMMs
    (``gemm_s``): their excess over the GEMMs, at least one split of them, plus the interference of the hidden
    rest."""
    if comm_s <= 0:
        return 0.0
    left = min(comm_s, max(comm_s - gemm_s, comm_s / TP_OVERLAP_SPLITS))
    return left + TP_OVERLAP_INTERFERENCE * (comm_s - left)


def overlapped_dp_s(comm_s: float, window_s: float, last_bucket_s: float) -> float:
    """Exposed seconds of a data-parallel collective (``comm_s``) run bucket by bucket behind ``window_s`` of
    compute: the excess over the window, at least the last bucket, plus the interference of the hidden rest."""
    if comm_s <= 0:
        return 0.0
    left = min(comm_s, max(comm_s - window_s, last_bucket_s))
    return left + DP_OVERLAP_INTERFERENCE * (comm_s - left)


def interleaved_dp_s(comm_s: float, chunk_pass_s: float, last_bucket_s: float, *, chunks: int,
                     rounds: int) -> float:
    """Exposed seconds of a data-parallel collective under Megatron's interleaved schedule, issued one model chunk
    at a time (``chunks`` virtual stages per rank, ``rounds`` micro-batches per chunk round = the pipeline degree):
    the gradient reduce-scatter of a chunk starts when that chunk's last backward ends, and the chunks' last
    backwards come ``rounds`` chunk passes apart in the cool-down, last chunk first; the parameter all-gather of
    chunk j is launched ``rounds`` forward chunk passes before chunk j's first forward (Megatron-Core
    ``schedules.forward_backward_pipelining_with_interleaving``: ``grad_sync_func`` on
    ``is_last_microbatch_for_model_chunk``, ``param_sync_func`` for the next chunk). ``chunk_pass_s`` is one chunk's
    pass of one micro-batch (backward for the reduce-scatter, forward for the all-gather). The last chunk's share
    hides only behind its own pass, bucket by bucket; the whole collective behind every pass that follows the first
    chunk's. One chunk (no interleaving) is ``overlapped_dp_s`` behind one pass. Seconds."""
    if comm_s <= 0:
        return 0.0
    if chunks <= 1:
        return overlapped_dp_s(comm_s, chunk_pass_s, last_bucket_s)
    share = comm_s / chunks
    window = ((chunks - 1) * rounds + 1) * chunk_pass_s
    left = min(comm_s, max(share - chunk_pass_s, last_bucket_s, comm_s - window))
    return left + DP_OVERLAP_INTERFERENCE * (comm_s - left)


def exposed_p2p_s(p2p_s: float, compute_s: float, exposed_share: float | None) -> float:
    """Exposed seconds of one stage's pipeline sends per micro-batch (``p2p_s``) when they run behind the stage's
    own chunks (``compute_s``: its layers and head per micro-batch, seconds). ``exposed_share`` None: they do not
    overlap (1F1B without ``overlap_p2p_comm``), all exposed. Otherwise the stated share stays on the path
    (:data:`P2P_EXPOSED_INTERLEAVED`, DualPipe's solo fraction), and never less than the sends' excess over the
    compute they hide behind: a send stream slower than the compute paces the stage (max(compute, sends) per
    micro-batch, the bound overlapped_tp_s and overlapped_dp_s use for their collectives)."""
    if exposed_share is None:
        return p2p_s
    return max(exposed_share * p2p_s, p2p_s - compute_s)
