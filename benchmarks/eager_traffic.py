"""Eager elementwise traffic of a transformer layer, measured: the bytes its memory-bound kernels move per token.

An eager PyTorch layer (what the torch and DeepSpeed engines run: the user's model as written) launches one
memory-bound kernel per elementwise ATen operator; probes/traffic.py counts the bytes each one reads and writes on
fake tensors. This benchmark counts them on the two reference blocks of examples/:

* ``gated``: examples/llama.py's ``TransformerBlock`` (the Hugging Face Llama layer's eager code: RMSNorm computed in
  fp32, rotate-half RoPE on q and k, grouped-query k/v repeated for SDPA, SwiGLU);
* ``plain``: examples/gpt2.py's ``Block`` (nanoGPT: LayerNorm, GELU, biases; the MLP width set per shape);

at micro-batch 1 and 2 (the difference is per token: weight casts and other per-step constants cancel), over
several widths, and fits bytes per token of one layer = c_h·h + c_ffn·F + c_kv·kv_width + c_d·head_dim
(+ c_gqa·h when grouped-query k/v heads are repeated for SDPA) by least squares; the counts are linear in the
widths, so the residual must be ~0 (printed). Precisions: ``fp32`` (no autocast), ``amp`` (bf16 autocast over
fp32 weights: its casts are kernels too) and ``bf16`` (the model cast to bf16, no autocast).

What it is for: optplan's time model prices a torch-engine layer's elementwise work as Megatron's fused kernel count
× one multiplier fitted on llm-foundry's MPT runs (a plain block). The table at the end says how many bytes an eager
gated (Llama) layer really moves next to a plain one of the same width: the gap the single multiplier cannot see.

Run: ``python benchmarks/eager_traffic.py [--write]`` (``--write`` also writes benchmarks/results/eager_traffic.txt).
Last line: ``eager traffic: gated/plain X at h=4096 (amp); largest fit residual Y%``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from optplan.probes.step_runner import cast_floating
from optplan.probes.traffic import TrafficCounter, block_attribution

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "eager_traffic.txt"
DATA = ROOT / "estimators" / "data" / "eager_traffic.yaml"
SEQ = 256
PRECISIONS = ("fp32", "amp", "bf16")
TERMS = ("h", "ffn", "kv", "head_dim", "gqa")


GATED_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (256, 1024, 4, 4), (256, 768, 4, 2), (512, 1024, 8, 2), (384, 1536, 6, 3), (512, 2048, 4, 1), (512, 1536, 8, 8),
    (384, 1024, 3, 1))
"""(hidden, MLP width, heads, k/v heads) of the Llama blocks counted: enough distinct widths for the five terms."""
PLAIN_SHAPES: tuple[tuple[int, int, int], ...] = ((256, 1024, 4), (256, 512, 4), (512, 1024, 8), (384, 1536, 4))
"""(hidden, MLP width, heads) of the GPT-2 blocks counted."""


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_optplan_ref_{name}", ROOT / "examples" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def per_token_block_bytes(model: nn.Module, blocks: list[nn.Module], batch: Callable[[int], torch.Tensor],
                          loss_fn: Callable[[Any, Any], torch.Tensor], precision: str) -> tuple[float, float]:
    """(forward, backward) bytes per token of one repeated block: the slope between micro-batch 1 and 2."""
    if precision == "bf16":
        cast_floating(model, lambda _name: torch.bfloat16)
    got = []
    for b in (1, 2):
        model.zero_grad(set_to_none=True)
        counter = TrafficCounter()
        with block_attribution(blocks, counter), counter:
            x = batch(b)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp"):
                loss = loss_fn(model(x), x)
            counter.backward = True
            loss.backward()
        got.append(counter.traffic.per_block())
    return (got[1][0] - got[0][0]) / SEQ, (got[1][1] - got[0][1]) / SEQ


def gated_rows(precision: str) -> list[tuple[dict[str, float], tuple[float, float]]]:
    """Measured (widths, (fwd, bwd) bytes per token) of examples/llama.py's block at several shapes."""
    llama = _load("llama")
    rows = []
    for dim, ffn, heads, kv_heads in GATED_SHAPES:
        with FakeTensorMode():
            cfg = llama.make_config("1B", dim=dim, ffn_dim=ffn, n_heads=heads, n_kv_heads=kv_heads, n_layers=2,
                                    vocab_size=512)
            model = llama.Llama(cfg)
            got = per_token_block_bytes(model, list(model.layers),
                                        lambda b, v=cfg.vocab_size: torch.randint(0, v, (b, SEQ)), llama.loss_fn,
                                        precision)
        d = dim // heads
        rows.append(({"h": dim, "ffn": ffn, "kv": kv_heads * d, "head_dim": d, "gqa": dim if kv_heads < heads else 0},
                     got))
    return rows


def plain_rows(precision: str) -> list[tuple[dict[str, float], tuple[float, float]]]:
    """The same for examples/gpt2.py's block, its MLP width set per shape (multi-head: kv width = h)."""
    gpt2 = _load("gpt2")
    rows = []
    for dim, ffn, heads in PLAIN_SHAPES:
        with FakeTensorMode():
            cfg = gpt2.GPTConfig(block_size=SEQ, vocab_size=512, n_layer=2, n_head=heads, n_embd=dim)
            model = gpt2.GPT(cfg)
            blocks = [m for m in model.modules() if isinstance(m, gpt2.Block)]
            for blk in blocks:
                blk.mlp.c_fc = nn.Linear(dim, ffn)
                blk.mlp.c_proj = nn.Linear(ffn, dim)
            got = per_token_block_bytes(model, blocks, lambda b: torch.randint(0, 512, (b, SEQ)), gpt2.loss_fn,
                                        precision)
        rows.append(({"h": dim, "ffn": ffn, "kv": 0.0, "head_dim": dim // heads}, got))
    return rows


def fit(rows: list[tuple[dict[str, float], tuple[float, float]]], terms: tuple[str, ...]
        ) -> tuple[dict[str, dict[str, float]], float]:
    """Least-squares coefficients per direction and the largest relative residual."""
    a = np.array([[w[t] for t in terms] for w, _ in rows], dtype=float)
    out: dict[str, dict[str, float]] = {}
    worst = 0.0
    for i, direction in enumerate(("fwd", "bwd")):
        y = np.array([got[i] for _, got in rows], dtype=float)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        worst = max(worst, float(np.max(np.abs(a @ coef - y) / y)))
        out[direction] = {t: round(float(c), 3) for t, c in zip(terms, coef, strict=True)}
    return out, worst


SHAPES: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("GPT-2 small", "plain", {"h": 768, "ffn": 3072, "kv": 0.0, "head_dim": 64, "gqa": 0.0}),
    ("MPT-7B", "plain", {"h": 4096, "ffn": 16384, "kv": 0.0, "head_dim": 128, "gqa": 0.0}),
    ("Llama-3 8B", "gated", {"h": 4096, "ffn": 14336, "kv": 1024, "head_dim": 128, "gqa": 4096}),
    ("Llama-3 70B", "gated", {"h": 8192, "ffn": 28672, "kv": 1024, "head_dim": 128, "gqa": 8192}),
)
"""Real shapes to print the fitted counts at (h, F, kv width, head width; gqa = h when k/v heads are repeated)."""


def bytes_at(coef: dict[str, float], widths: dict[str, float]) -> float:
    """Bytes per token of one layer for ``widths`` under the fitted ``coef``."""
    return sum(c * widths.get(t, 0.0) for t, c in coef.items())


def fit_all() -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str], float]]:
    """The coefficients of every block kind and precision, and each fit's largest relative residual."""
    fits: dict[str, dict[str, Any]] = {}
    residuals: dict[tuple[str, str], float] = {}
    for kind, rows_of, terms in (("gated", gated_rows, TERMS), ("plain", plain_rows, ("h", "ffn", "head_dim"))):
        fits[kind] = {}
        for precision in PRECISIONS:
            fits[kind][precision], residuals[kind, precision] = fit(rows_of(precision), terms)
    return fits, residuals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help=f"also write {RESULTS.relative_to(ROOT)} and {DATA.relative_to(ROOT)}")
    args = parser.parse_args()
    lines: list[str] = []
    fits, residuals = fit_all()
    worst_all = max(residuals.values())
    for kind, by_precision in fits.items():
        for precision, coef in by_precision.items():
            lines.append(f"{kind:6s} {precision:5s} fwd {coef['fwd']}  bwd {coef['bwd']}  "
                         f"residual {residuals[kind, precision]:.2%}")
    lines.append("")
    lines.append(f"{'layer':12s} {'kind':6s} " + " ".join(f"{p + ' fwd+bwd':>16s}" for p in PRECISIONS)
                 + "   (bytes per token per layer, ÷ h)")
    for name, kind, widths in SHAPES:
        cells = []
        for precision in PRECISIONS:
            c = fits[kind][precision]
            cells.append(f"{(bytes_at(c['fwd'], widths) + bytes_at(c['bwd'], widths)) / widths['h']:16.1f}")
        lines.append(f"{name:12s} {kind:6s} " + " ".join(cells))
    h = 4096.0
    gated = fits["gated"]["amp"]
    plain = fits["plain"]["amp"]
    llama = dict(SHAPES[2][2])
    mpt_like = {"h": h, "ffn": llama["ffn"], "head_dim": 128}
    ratio = ((bytes_at(gated["fwd"], llama) + bytes_at(gated["bwd"], llama))
             / (bytes_at(plain["fwd"], mpt_like) + bytes_at(plain["bwd"], mpt_like)))
    lines.append("")
    lines.append(f"eager traffic: gated/plain {ratio:.2f} at h=4096 (amp); largest fit residual {worst_all:.2%}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.write:
        RESULTS.write_text(text, encoding="utf-8")
        write_data(data_document(fits, worst_all))
        print(f"wrote {RESULTS.relative_to(ROOT)} and {DATA.relative_to(ROOT)}")


def data_document(fits: dict[str, dict[str, Any]], worst: float) -> dict[str, Any]:
    """The packaged coefficients (estimators/data/eager_traffic.yaml) of ``fits``."""
    return {"source": "measured by benchmarks/eager_traffic.py: probes/traffic.py's count of the bytes every "
                      "memory-bound ATen operator of one layer reads and writes (fake tensors, micro-batch 2 minus 1) "
                      "on examples/llama.py's block (gated) and examples/gpt2.py's (plain), fitted over several "
                      f"widths (largest residual {100 * worst:.1f}%)",
            "unit": UNIT,
            "blocks": fits}


UNIT = ("bytes per token per layer = sum of coefficient x width (h, ffn, kv = kv heads x head width, head_dim; gqa = h "
        "when k/v heads are repeated)")
"""The packaged coefficients' unit (eager and compiled alike)."""


def write_data(doc: dict[str, Any], data: Path = DATA,
               header: str = "Eager elementwise traffic of one transformer layer per token",
               benchmark: str = "eager_traffic.py") -> None:
    """Replace ``data`` (estimators/data/eager_traffic.yaml) atomically with ``doc`` under a generated-file header."""
    fd, tmp = tempfile.mkstemp(dir=data.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(f"# {header} (read by optplan.estimators.eager_traffic).\n# Written by `python "
                 f"benchmarks/{benchmark} --write`; do not edit by hand.\n")
        yaml.safe_dump(doc, fh, sort_keys=False, width=120)
    os.replace(tmp, data)


if __name__ == "__main__":
    main()
