"""torch's ring attention on gloo ranks: the memory-bound bytes its Python ring moves, against
estimators/ring_attention.py.

Each case runs torch's own ``_templated_ring_attention`` and ``_templated_ring_attention_backward``
(torch.distributed.tensor.experimental's context parallelism, the code every torch plan with ``cp`` > 1 runs) on
``cp`` gloo processes over localhost, with the CPU flash-attention kernels as the attention op (the ring calls its op
the same way on a GPU), and counts every memory-bound ATen operator's bytes (probes/traffic.py's ``TrafficCounter``;
the collectives, which move bytes over the link and not through a kernel's reads and writes, left out). The slowest
rank's forward and backward bytes are compared with ``ring_attention_time``'s, which prices the element-wise passes
the ring adds around the kernels (its fp32 merges and accumulations, its concatenations). Cases: cp 2 and 4, key/value
heads passed as they are (grouped-query, 2 of 8) or repeated to every query head, bf16: with the grouped-query K/V the
first rank moves the most in backward, with the repeated ones the last (the estimate takes the heavier).

What the CPU cannot show: the transfers' overlap with the sub-attentions (the estimate's all-gather and dK/dV ring
exposure) and the GPU kernels' speed; a GPU run of a torch CP plan is the check those need.

Run: ``python benchmarks/fidelity_ring_attention_cpu.py``. Last line: ``ring attention: bytes max error X% over N
cases``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HEADS, HEAD_DIM, TOKENS_LOCAL = 8, 64, 128
"""Query heads, head width and each rank's tokens (two load-balanced chunks of 64) of every case."""
CP_DEGREES: tuple[int, ...] = (2, 4)
KEY_HEADS: tuple[int, ...] = (2, 8)
"""Key/value heads the attention call receives: grouped-query 2 of 8 as they are, or repeated to all 8."""
COLLECTIVE_MARKERS = ("all_gather", "all_to_all", "wait_tensor", "broadcast", "permute", "reduce_scatter",
                      "wrap_tensor_autograd")
"""Operators of functional collectives (c10d_functional, and the wrapper of their results): link traffic, not a
memory-bound kernel."""
FILL_OPS = frozenset({"zeros_like", "ones_like", "full_like"})
"""Factories that write their output and read nothing of the tensor they copy the shape of (the traffic counter
counts that tensor as read: a profile's convention, here the kernel's bytes)."""


def child(rank: int, world: int, port: int, out: str) -> None:
    """One rank: run the ring's forward and backward under a traffic counter, for each of ``KEY_HEADS``, and write
    its bytes."""
    import torch
    import torch.distributed as dist

    from optplan.probes.traffic import TrafficCounter, _tensor_bytes

    class _Counter(TrafficCounter):
        """The traffic counter, with the bytes each fill writes kept apart (``FILL_OPS``)."""

        def __init__(self) -> None:
            super().__init__()
            self.fills: dict[str, int] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            name = func.overloadpacket.__name__
            if name in FILL_OPS:
                self.fills[name] = self.fills.get(name, 0) + _tensor_bytes(out)
            return out

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {str(key_heads): _case(rank, key_heads, _Counter) for key_heads in KEY_HEADS}
        Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _case(rank: int, key_heads: int, counter: Any) -> dict[str, Any]:
    """One rank's forward and backward bytes with ``key_heads`` key/value heads."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    torch.manual_seed(rank)
    q = torch.randn(1, HEADS, TOKENS_LOCAL, HEAD_DIM, dtype=torch.bfloat16)
    k = torch.randn(1, key_heads, TOKENS_LOCAL, HEAD_DIM, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fwd_op, bwd_op = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                      torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
    if key_heads != HEADS:  # the CPU kernel takes no grouped-query K/V: the ring's traffic is on the K/V it is given
        fwd_op, bwd_op = _grouped(fwd_op, HEADS // key_heads, backward=False), _grouped(
            bwd_op, HEADS // key_heads, backward=True)
    else:
        bwd_op = _backward_named(bwd_op)
    group = dist.group.WORLD
    with counter() as fwd:
        out, lse, *_ = ring._templated_ring_attention(group, 2, fwd_op, q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    with counter() as bwd:
        ring._templated_ring_attention_backward(group, 2, bwd_op, grad, "grad_out", q, k, v, out, lse, is_causal=True,
                                                dropout_p=0.0)
    return {"forward": _memory_bytes(fwd.traffic.by_op, fwd.fills),
            "backward": _memory_bytes(bwd.traffic.by_op, bwd.fills)}


def _memory_bytes(by_op: dict[str, int], fills: dict[str, int]) -> int:
    """The bytes of memory-bound kernels, the collectives' operators left out, the fills' written bytes only."""
    return sum(fills.get(name, n) for name, n in by_op.items() if not any(m in name for m in COLLECTIVE_MARKERS))


def _backward_named(op: Any) -> Any:
    """The CPU flash backward called the way the ring calls its op (query=, key=, ..., grad_out=)."""

    def call(*, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, is_causal: bool, grad_out: Any,
             dropout_p: float = 0.0) -> Any:
        return op(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal)

    return call


def _grouped(op: Any, rep: int, *, backward: bool) -> Any:
    """A grouped-query kernel out of the CPU one: K/V widened inside the call (the kernel's own business, not the
    ring's), their gradients summed back over the repeats; outside, the ring sees K/V of ``key_heads``."""
    import torch

    def widen(t: Any) -> Any:
        return torch.repeat_interleave(t, rep, dim=1)

    if not backward:
        def fwd(q: Any, k: Any, v: Any, *, is_causal: bool) -> Any:
            with _uncounted():
                return op(q, widen(k), widen(v), 0.0, is_causal)
        return fwd

    def bwd(*, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, is_causal: bool, grad_out: Any,
            dropout_p: float = 0.0) -> Any:
        with _uncounted():
            dq, dk, dv = op(grad_out, query, widen(key), widen(value), out, logsumexp, dropout_p, is_causal)
            shape = (dk.shape[0], dk.shape[1] // rep, rep, *dk.shape[2:])
            return dq, dk.view(shape).sum(2), dv.view(shape).sum(2)
    return bwd


def _uncounted() -> Any:
    """Leave the traffic counter while the stand-in kernel widens and sums: a real grouped-query kernel does that
    inside the fused kernel."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(cp: int, directory: Path) -> list[dict[str, Any]]:
    """One process per rank (this file with ``--child``: the tests import it by path, so the ranks start it as a
    script rather than by ``torch.multiprocessing``), gloo over localhost; each rank's counted bytes by key heads."""
    port = _port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = [directory / f"cp{cp}-rank{r}.json" for r in range(cp)]
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(r), str(cp), str(port), str(outs[r])],
                              env=env, stderr=subprocess.PIPE, text=True) for r in range(cp)]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    failed = [(i, e) for i, (p, e) in enumerate(zip(procs, errors, strict=True)) if p.returncode]
    if failed:
        rank, err = failed[0]
        raise RuntimeError(f"ring attention rank {rank} failed: {err[-2000:]}")
    return [json.loads(o.read_text()) for o in outs]


@dataclass(frozen=True)
class Row:
    cp: int
    key_heads: int
    real_fwd: int
    real_bwd: int
    pred_fwd: float
    pred_bwd: float

    @property
    def fwd_err(self) -> float:
        return 100.0 * (self.pred_fwd - self.real_fwd) / self.real_fwd

    @property
    def bwd_err(self) -> float:
        return 100.0 * (self.pred_bwd - self.real_bwd) / self.real_bwd


def run(directory: Path, cp_degrees: tuple[int, ...] = CP_DEGREES) -> list[Row]:
    """Every case: the slowest rank's counted bytes (the most of any rank) against the estimate's."""
    from optplan.estimators.comm import Link
    from optplan.estimators.ring_attention import ring_attention_time

    rows = []
    for cp in cp_degrees:
        ranks = launch(cp, directory)
        for key_heads in KEY_HEADS:
            rows.append(_row(cp, key_heads, [r[str(key_heads)] for r in ranks], ring_attention_time, Link))
    return rows


def _row(cp: int, key_heads: int, ranks: list[dict[str, Any]], ring_attention_time: Any, link: Any) -> Row:
    est = ring_attention_time(tokens_local=TOKENS_LOCAL, query_heads=HEADS, value_head_dim=HEAD_DIM,
                                  key_heads=key_heads, key_head_dim=HEAD_DIM, elem_bytes=2, cp=cp,
                                  link=link(bandwidth_bytes_per_s=1e9, alpha_s=0.0), core_fwd_s=0.0, core_bwd_s=0.0)
    return Row(cp=cp, key_heads=key_heads, real_fwd=max(r["forward"] for r in ranks),
               real_bwd=max(r["backward"] for r in ranks), pred_fwd=est.fwd_memory_bytes, pred_bwd=est.bwd_memory_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=4, metavar=("RANK", "WORLD", "PORT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        rank, world, port, out = args.child
        child(int(rank), int(world), int(port), out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(Path(tmp))
    print(f"torch's ring attention on gloo: {HEADS} query heads x {HEAD_DIM}, {TOKENS_LOCAL} tokens per rank, bf16; "
          "the slowest rank's memory-bound bytes")
    print(f"{'cp':>3}{'kv heads':>9} | {'fwd real':>12}{'fwd pred':>12}{'err':>8} | {'bwd real':>12}{'bwd pred':>12}"
          f"{'err':>8}")
    for r in rows:
        print(f"{r.cp:>3}{r.key_heads:>9} | {r.real_fwd:>12,}{r.pred_fwd:>12,.0f}{r.fwd_err:>+7.2f}% | "
              f"{r.real_bwd:>12,}{r.pred_bwd:>12,.0f}{r.bwd_err:>+7.2f}%")
    worst = max(max(abs(r.fwd_err), abs(r.bwd_err)) for r in rows)
    print(f"ring attention: bytes max error {worst:.1f}% over {len(rows)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
