"""CPU fidelity of expert parallelism (issue 19): an expert-parallel MoE on 2 gloo ranks against optplan's ep terms.

The model: examples/moe.py reduced (:data:`CFG`: hidden 128, 2 MoE layers of 8 SwiGLU experts, top-2). Every rank
builds it with the same seed and keeps only its E/ep experts (Megatron-Core's expert parallelism carves the expert
group out of data parallelism: each rank runs its own batch). Each MoE layer then runs :func:`ep_forward`, the
dispatcher of Megatron-Core's ``MoEAlltoAllTokenDispatcher`` (token_dispatcher.py) written with torch's primitives:
route for real (softmax top-k of the rank's own tokens), sort the token copies by expert (the permuted send
buffer), exchange the per-expert counts (``dist.all_to_all_single``), send the copies to the ranks that hold their
experts (``torch.distributed.nn.functional.all_to_all_single``: gloo, variable splits, autograd), run each local
expert on the copies it received from every rank, send the outputs back the same way, un-permute and combine with
the router weights. Both of torch's primitives work on gloo (variable-split all-to-all, forward and backward).

Measured per rank, by the profiler's own ``StepRunner`` (probes/step_runner.py: one warm-up step, then the peak live
bytes of forward + loss + backward above the resident parameters and gradients, fp32; the smallest of
:data:`TRACKED_STEPS` steps, since gloo's worker thread now and then still holds a collective's input at the peak):
the parameters it holds and its activation peak at micro-batches 2 and 4.

Predicted: the model file's single-rank profile (``profile_contract``: the balanced dispatch of
probes/moe_dispatch.py) and the estimators' ep terms for ``Strategy(engine="megatron", ep=2, dp=2)``: parameters =
``profile.params`` - ``expert_parallel.expert_params_not_held`` (the other rank's experts), activations = the
profile's fp32 fit at the micro-batch + ``memory_breakdown``'s ``moe_all_to_all_receive`` (one layer's receive
buffer: tokens·topk·h at the activation width). The rows say how far the ep rank's peak is from that, with the
copies each rank actually received (real routing is not balanced).

Run: ``python benchmarks/fidelity_ep_cpu.py`` (~30 s); last line ``ep: parameters exact on R of R ranks;
activations max error X%``. tests/probes/test_ep_gloo.py asserts on the same rows.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from optplan.estimators.expert_parallel import expert_params_not_held
from optplan.estimators.memory import memory_breakdown
from optplan.estimators.strategy import Strategy
from optplan.probes.contract import load_contract
from optplan.probes.static import blocks_of, find_repeated_block, profile_contract
from optplan.probes.step_runner import StepRunner, batch_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity_cpu_memory import example_wrapper  # noqa: E402

CFG = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=512, num_experts=8,
           num_experts_per_tok=2, moe_ffn_dim=128, n_shared_experts=0, first_dense=0, max_seq_len=64)
SEQ = 64
EP = 2
MICRO_BATCHES = (2, 4)
TRACKED_STEPS = 3


def model_file(directory: Path) -> Path:
    """examples/moe.py at :data:`CFG` as a model file (fidelity_cpu_memory.py's wrapper)."""
    return example_wrapper(directory, "moe", "lite", CFG, SEQ)


# ---------------------------------------------------------------------------------------------------
# the expert-parallel rank
# ---------------------------------------------------------------------------------------------------
def ep_forward(layer: nn.Module, x: torch.Tensor, *, rank: int, world: int, experts: int,
               received: list[int]) -> torch.Tensor:
    """One MoE layer of examples/moe.py on this rank's tokens, its local experts ``layer.experts`` holding experts
    [rank·E/world, (rank+1)·E/world): Megatron-Core's all-to-all dispatch and combine (module docstring)."""
    from torch.distributed.nn.functional import all_to_all_single

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    probs = layer.router(x2).float().softmax(dim=-1)
    weights, chosen = probs.topk(layer.top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    send = x2.repeat_interleave(layer.top_k, dim=0)[order]  # the permuted copies, grouped by expert
    counts = torch.bincount(flat, minlength=experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)  # [source rank, local expert]
    local = experts // world
    send_splits = counts.view(world, local).sum(dim=1).tolist()
    recv_splits = recv_counts.view(world, local).sum(dim=1).tolist()
    got = all_to_all_single(x2.new_empty(sum(recv_splits), x2.shape[1]), send, recv_splits, send_splits)
    received.append(got.shape[0])
    # rows of `got` are (source rank, local expert) blocks: each local expert takes its block from every source
    starts = torch.cumsum(recv_counts, 0) - recv_counts
    out = torch.zeros_like(got)
    for e, expert in enumerate(layer.experts):
        rows = torch.cat([torch.arange(int(starts[p * local + e]), int(starts[p * local + e] + recv_counts[p * local + e]))
                          for p in range(world)])
        if rows.numel():
            out = out.index_put((rows,), expert(got[rows]))
    back = all_to_all_single(x2.new_empty(sum(send_splits), x2.shape[1]), out, send_splits, recv_splits)
    copies = back[torch.argsort(order)].view(-1, layer.top_k, shape[-1])
    return (copies * weights.unsqueeze(-1).to(copies.dtype)).sum(dim=1).view(shape)


def make_expert_parallel(model: nn.Module, rank: int, world: int, received: list[int]) -> int:
    """Keep this rank's experts of every MoE layer and route through :func:`ep_forward`; returns the MoE layers."""
    layers = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "router")]
    for layer in layers:
        experts = len(layer.experts)
        local = experts // world
        layer.experts = nn.ModuleList(list(layer.experts)[rank * local:(rank + 1) * local])
        layer.forward = (lambda x, _l=layer, _e=experts:  # type: ignore[method-assign]
                         ep_forward(_l, x, rank=rank, world=world, experts=_e, received=received))
    return len(layers)


def child(rank: int, world: int, path: str, port: int, out: str) -> None:
    warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated", category=FutureWarning)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        contract = load_contract(Path(path))
        torch.manual_seed(0)
        model = contract.build_real()
        received: list[int] = []
        make_expert_parallel(model, rank, world, received)
        torch.manual_seed(1000 + rank)  # each rank its own batch (data parallel over the expert group)
        spec, _ = batch_spec(contract, model, SEQ)
        block = find_repeated_block(model)
        runner = StepRunner(model=model, spec=spec, loss_fn=contract.loss_fn, display=contract.display,
                            blocks=blocks_of(model, block.cls if block else None))
        result: dict[str, Any] = {"rank": rank, "params": sum(p.numel() for p in model.parameters()), "act": {},
                                  "received": {}}
        runner.warm_up(MICRO_BATCHES[0])
        for mbs in MICRO_BATCHES:
            # the smallest of TRACKED_STEPS peaks: gloo's worker thread now and then still holds a collective's input
            # when the peak comes (a CPU-only effect, benchmarks/fidelity_tp_cpu.py measured the same)
            peaks = []
            for _ in range(TRACKED_STEPS):
                received.clear()
                peaks.append(runner.activation_bytes(mbs))
            result["act"][mbs] = min(peaks)
            result["received"][mbs] = max(received)
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(path: Path, directory: Path) -> None:
    """One process per rank (this file with ``--child``: it is imported by path in the tests, so the ranks start it
    as a script rather than by ``torch.multiprocessing``), gloo over localhost."""
    port = _port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(rank), str(EP), str(path), str(port),
                               str(directory / f"rank{rank}.json")], env=env, stderr=subprocess.PIPE, text=True)
             for rank in range(EP)]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    failed = [(i, e) for i, (p, e) in enumerate(zip(procs, errors, strict=True)) if p.returncode]
    if failed:
        rank, err = failed[0]
        raise RuntimeError(f"ep rank {rank} failed: {err[-2000:]}")


# ---------------------------------------------------------------------------------------------------
# predicted against measured
# ---------------------------------------------------------------------------------------------------
@dataclass
class Row:
    rank: int
    mbs: int
    params_pred: int
    params_real: int
    act_pred: int
    act_real: int
    act_profile: int
    """the single-rank profile's activations alone (no receive buffer)"""
    received: int
    balanced: int

    @property
    def act_err(self) -> float:
        return 100.0 * (self.act_pred - self.act_real) / self.act_real

    @property
    def profile_err(self) -> float:
        return 100.0 * (self.act_profile - self.act_real) / self.act_real


def run(directory: Path) -> list[Row]:
    path = model_file(directory)
    profile = profile_contract(load_contract(path))
    launch(path, directory)
    rows = []
    moe = profile.transformer.moe if profile.transformer is not None else None
    assert moe is not None
    for rank in range(EP):
        real = json.loads((directory / f"rank{rank}.json").read_text())
        for mbs in MICRO_BATCHES:
            strategy = Strategy(engine="megatron", precision="fp32", ep=EP, dp=EP, mbs=mbs)  # type: ignore[arg-type]
            mem = memory_breakdown(profile, strategy, 2**50, device="cpu")
            alone = profile.activation("fp32", "none").bytes_at(mbs)
            act = alone + mem.detail_bytes.get("moe_all_to_all_receive", 0)
            rows.append(Row(rank=rank, mbs=mbs, params_pred=round(profile.params - expert_params_not_held(
                profile, strategy, 1.0)), params_real=real["params"], act_pred=act, act_real=real["act"][str(mbs)],
                act_profile=alone,
                received=real["received"][str(mbs)], balanced=mbs * SEQ * moe.topk))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=5, metavar=("RANK", "WORLD", "MODEL", "PORT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        rank, world, path, port, out = args.child
        child(int(rank), int(world), path, int(port), out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(Path(tmp))
    print(f"examples/moe.py {CFG}, seq {SEQ}, ep {EP} on gloo (fp32)")
    print(f"{'rank':>4}{'mbs':>4} | {'params pred':>12}{'params real':>12} | {'act pred MiB':>13}{'act real MiB':>13}"
          f"{'err':>8} | {'profile alone':>13} | {'copies in':>9}{'balanced':>9}")
    for r in rows:
        print(f"{r.rank:>4}{r.mbs:>4} | {r.params_pred:>12,}{r.params_real:>12,} | {r.act_pred / 2**20:>13.2f}"
              f"{r.act_real / 2**20:>13.2f}{r.act_err:>+7.2f}% | {r.profile_err:>+12.2f}% | {r.received:>9}"
              f"{r.balanced:>9}")
    exact = sum(r.params_pred == r.params_real for r in rows if r.mbs == MICRO_BATCHES[0])
    print(f"ep: parameters exact on {exact} of {EP} ranks; activations max error "
          f"{max(abs(r.act_err) for r in rows):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
