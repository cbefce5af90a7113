"""Compiled elementwise traffic of a transformer layer, measured: the bytes torch.compile's fused kernels move per token.

A ``--compile`` plan compiles each repeated block with TorchInductor (torchtitan's order: after checkpointing, before
FSDP). Inductor fuses the block's elementwise operators into a few generated kernels between the GEMMs and the
attention call (which stay library calls: cuBLAS, the SDPA kernel). How many bytes those kernels move is what
the time model needs; until now it took Megatron's hand-fused kernel count for it (stated, never measured).

This benchmark compiles examples/llama.py's ``TransformerBlock`` (``gated``) and examples/gpt2.py's ``Block``
(``plain``) with Inductor on the CPU, runs the forward and the backward once, and sums, over the scheduler nodes of
the forward and backward graphs that are Inductor's own kernels (not ``ExternKernel`` nodes: matmuls, SDPA), the
bytes each node reads and writes (Inductor's own count, ``GraphLowering.count_bytes``: the same figure its
``num_bytes_accessed`` metric reports). Micro-batch 2 minus 1, per token (per-step constants such as weight casts
cancel), over the widths benchmarks/eager_traffic.py uses, fitted to the same terms (bytes per token of one layer =
c_h·h + c_ffn·F + c_kv·kv + c_d·d (+ c_gqa·h)). Inductor's CPU code generation stands for its Triton one: the
fusion decisions (which operators share a kernel, what the backward recomputes) are the scheduler's and the
min-cut partitioner's, device-independent (stated; what a GPU's Triton kernels then achieve of the HBM bandwidth
is the time model's, not this count's).

Run: ``python benchmarks/compiled_traffic.py [--write]`` (about 3 minutes: ~60 compilations; ``--write`` also writes
benchmarks/results/compiled_traffic.txt and estimators/data/compiled_traffic.yaml). Last line:
``compiled traffic: compiled/eager X at Llama-3 8B (amp), Y x Megatron's fused count; largest fit residual Z%``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eager_traffic import (  # noqa: E402
    GATED_SHAPES,
    PLAIN_SHAPES,
    PRECISIONS,
    SHAPES,
    TERMS,
    UNIT,
    _load,
    bytes_at,
    fit,
)
from eager_traffic import write_data as write_eager_data  # noqa: E402

from optplan.estimators.eager_traffic import layer_bytes_per_token  # noqa: E402
from optplan.probes.step_runner import cast_floating  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "compiled_traffic.txt"
DATA = ROOT / "estimators" / "data" / "compiled_traffic.yaml"
SEQ = 256


def _quiet_inductor() -> None:
    """Count bytes on every compilation: Inductor counts them only with its metrics log on, and a cached graph
    is not lowered again (no count)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor_config

    torch._logging.set_logs(inductor_metrics=True)
    metrics_log = compile_fx.inductor_metrics_log  # enabled at INFO (the count runs), its records dropped
    metrics_log.setLevel(logging.INFO)
    metrics_log.handlers = [logging.NullHandler()]
    metrics_log.propagate = False
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False


def fused_bytes(run: Callable[[int], None], b: int) -> float:
    """Bytes Inductor's generated kernels read and write in one forward + backward at micro-batch ``b``."""
    import torch._dynamo
    import torch._inductor.metrics as metrics
    from torch._inductor.scheduler import ExternKernelSchedulerNode

    torch._dynamo.reset()
    metrics.reset()
    run(b)
    return float(sum(4 * n for node, n in metrics.nodes_num_elem
                     if not isinstance(node, ExternKernelSchedulerNode)))


def per_token(run: Callable[[int], None]) -> float:
    """Bytes per token (forward + backward) of the compiled block: the slope between micro-batch 1 and 2."""
    return (fused_bytes(run, 2) - fused_bytes(run, 1)) / SEQ


def _runner(model: nn.Module, blocks: list[nn.Module], batch: Callable[[int], torch.Tensor],
            loss_fn: Callable[[Any, Any], torch.Tensor], precision: str) -> Callable[[int], None]:
    if precision == "bf16":
        cast_floating(model, lambda _name: torch.bfloat16)
    for blk in blocks:
        blk.compile(backend="inductor")  # each block on its own, as torchtitan and optplan's train.py do

    def run(b: int) -> None:
        model.zero_grad(set_to_none=True)
        x = batch(b)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp"):
            loss = loss_fn(model(x), x)
        loss.backward()

    return run


def gated_rows(precision: str) -> list[tuple[dict[str, float], tuple[float, float]]]:
    """(widths, (fwd + bwd, 0)) of examples/llama.py's compiled block at eager_traffic.py's shapes."""
    llama = _load("llama")
    rows = []
    for dim, ffn, heads, kv_heads in GATED_SHAPES:
        cfg = llama.make_config("1B", dim=dim, ffn_dim=ffn, n_heads=heads, n_kv_heads=kv_heads, n_layers=1,
                                vocab_size=512)
        model = llama.Llama(cfg)
        run = _runner(model, list(model.layers), lambda b, v=cfg.vocab_size: torch.randint(0, v, (b, SEQ)),
                      llama.loss_fn, precision)
        d = dim // heads
        rows.append(({"h": dim, "ffn": ffn, "kv": kv_heads * d, "head_dim": d, "gqa": dim if kv_heads < heads else 0},
                     (per_token(run), 0.0)))
    return rows


def plain_rows(precision: str) -> list[tuple[dict[str, float], tuple[float, float]]]:
    """The same for examples/gpt2.py's block, its MLP width set per shape."""
    gpt2 = _load("gpt2")
    rows = []
    for dim, ffn, heads in PLAIN_SHAPES:
        cfg = gpt2.GPTConfig(block_size=SEQ, vocab_size=512, n_layer=1, n_head=heads, n_embd=dim, dropout=0.0)
        model = gpt2.GPT(cfg)
        blocks = [m for m in model.modules() if isinstance(m, gpt2.Block)]
        for blk in blocks:
            blk.mlp.c_fc = nn.Linear(dim, ffn)
            blk.mlp.c_proj = nn.Linear(ffn, dim)
        run = _runner(model, blocks, lambda b: torch.randint(0, 512, (b, SEQ)), gpt2.loss_fn, precision)
        rows.append(({"h": dim, "ffn": ffn, "kv": 0.0, "head_dim": dim // heads}, (per_token(run), 0.0)))
    return rows


def fit_all() -> tuple[dict[str, dict[str, Any]], float]:
    """The forward + backward coefficients of every block kind and precision, and the largest relative residual."""
    fits: dict[str, dict[str, Any]] = {}
    worst = 0.0
    for kind, rows_of, terms in (("gated", gated_rows, TERMS), ("plain", plain_rows, ("h", "ffn", "head_dim"))):
        fits[kind] = {}
        for precision in PRECISIONS:
            rows = rows_of(precision)
            # one total per layer (Inductor's forward and backward graphs compile together): fit it as the forward
            # and a zero backward, so the packaged data keeps eager_traffic.yaml's schema
            coef, residual = fit([(w, (got[0], got[0])) for w, got in rows], terms)
            fits[kind][precision] = {"fwd": coef["fwd"], "bwd": {t: 0.0 for t in terms}}
            worst = max(worst, residual)
    return fits, worst


def megatron_count(widths: dict[str, float], kind: str, elem: int = 2) -> float:
    """Megatron's fused kernels' bytes per token of one layer, forward + backward (estimators/compute.py)."""
    h = widths["h"]
    f = widths["ffn"] * (1.5 if kind == "gated" else 1.0)  # a gated MLP priced as two matrices of the same size
    return h * (4 * elem + 2 * (3 * elem + 1)) + f * 2 * elem + h * (6 * elem + 2 * (5 * elem + 1)) + f * 3 * elem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help=f"also write {RESULTS.relative_to(ROOT)} and {DATA.relative_to(ROOT)}")
    args = parser.parse_args()
    _quiet_inductor()
    torch.manual_seed(0)
    fits, worst = fit_all()
    lines = [f"{kind:6s} {precision:5s} fwd+bwd {coef['fwd']}" for kind, by in fits.items()
             for precision, coef in by.items()]
    lines.append("")
    lines.append(f"{'layer':12s} {'kind':6s} " + " ".join(f"{p + ' compiled/eager':>20s}" for p in PRECISIONS)
                 + "   x Megatron (amp)")
    for name, kind, widths in SHAPES:
        cells = []
        for precision in PRECISIONS:
            compiled = bytes_at(fits[kind][precision]["fwd"], widths)
            eager = sum(layer_bytes_per_token(kind=kind, precision=precision, hidden=widths["h"], ffn=widths["ffn"],
                                              kv=widths["kv"], head_dim=widths["head_dim"],
                                              grouped_query=bool(widths.get("gqa"))))
            cells.append(f"{compiled / eager:20.2f}")
        mega = bytes_at(fits[kind]["amp"]["fwd"], widths) / megatron_count(widths, kind)
        lines.append(f"{name:12s} {kind:6s} " + " ".join(cells) + f"   {mega:.2f}")
    llama = SHAPES[2][2]
    amp = fits["gated"]["amp"]["fwd"]
    eager_amp = sum(layer_bytes_per_token(kind="gated", precision="amp", hidden=llama["h"], ffn=llama["ffn"],
                                          kv=llama["kv"], head_dim=llama["head_dim"], grouped_query=True))
    lines.append("")
    lines.append(f"compiled traffic: compiled/eager {bytes_at(amp, llama) / eager_amp:.2f} at Llama-3 8B (amp), "
                 f"{bytes_at(amp, llama) / megatron_count(llama, 'gated'):.2f} x Megatron's fused count; largest fit "
                 f"residual {worst:.2%}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.write:
        RESULTS.write_text(text, encoding="utf-8")
        write_data(data_document(fits, worst))
        print(f"wrote {RESULTS.relative_to(ROOT)} and {DATA.relative_to(ROOT)}")


def data_document(fits: dict[str, dict[str, Any]], worst: float) -> dict[str, Any]:
    """The packaged coefficients (estimators/data/compiled_traffic.yaml) of ``fits``."""
    return {"source": "measured by benchmarks/compiled_traffic.py: TorchInductor's own count of the bytes its generated "
                      "kernels read and write (GraphLowering.count_bytes over the non-extern scheduler nodes of the "
                      "forward and backward graphs; CPU code generation standing for Triton's) for examples/llama.py's "
                      "block (gated) and examples/gpt2.py's (plain), each compiled on its own, micro-batch 2 minus 1, "
                      f"fitted over several widths (largest residual {100 * worst:.1f}%); forward and backward in "
                      "one figure (fwd), bwd zero",
            "unit": UNIT,
            "blocks": fits}


def write_data(doc: dict[str, Any]) -> None:
    """Replace estimators/data/compiled_traffic.yaml atomically."""
    write_eager_data(doc, DATA, "Compiled (TorchInductor) elementwise traffic of one transformer layer per token",
                     "compiled_traffic.py")


if __name__ == "__main__":
    main()
