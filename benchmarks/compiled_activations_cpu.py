"""What a block compiled by torch.compile saves for the backward, against the same block eager and optplan's counts,
measured on this CPU (bytes per token per layer, in units of the hidden width h).

Why: torchtitan's 8B runs reserved 5.0-5.4 GiB less with ``--training.compile`` than eager at the same plan
(benchmarks/fidelity_torchtitan.py, t1 and t3: 82.4 -> 77.0 and 67.0 -> 62.0 GiB), which optplan does not price
(a compiled plan's activations are the eager profile's). Inductor's min-cut partitioner recomputes cheap pointwise
operators in the backward instead of saving their outputs (an RMSNorm's fp32 upcast and its normalized output, the
repeated key/value heads, SiLU's output); what it saves depends on the model's code, so it is measured here on the
examples' blocks, not assumed.

How: examples/llama.py's ``TransformerBlock`` (RMSNorm in fp32, rotary embeddings, repeated k/v, SDPA, SwiGLU) and
examples/gpt2.py's ``Block`` (fused LayerNorm, fused qkv, SDPA, GELU), four layers at dim 512 (Llama: 8 heads, 2
key/value heads, FFN 1,792 = 3.5 h; GPT-2: 8 heads, FFN 4 h) and 8,192 tokens in bf16, each configuration in its
own process with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed buffers go back to the system): the resident bytes after
the forward above those before, less the output, over tokens x layers; after a warm-up step at the same shape
(Inductor compiles outside the measurement). Checkpointing: none, or optplan's op-level selective policy
(probes/trainloop.py ``selective_context``: torchtitan's save list, every other matmul). The CPU's Inductor stands for
the GPU's: the partitioner's choice of what to save is made on the graph, before code generation. The CPU's SDPA
(flash attention for CPU) saves the output and the log-sum-exp as the GPU's kernels do.

optplan's counts printed beside: Korthikanti et al. 2022 (arXiv 2205.05198) Table 2 generalised
(``TransformerShape.layer_bytes_per_token``: 12 h + 4 kv + 8 F for a gated layer, 34 h for GPT's) and the op-level
policy's ``selective.saved_bytes_per_token``.

Run: ``python benchmarks/compiled_activations_cpu.py [--write]`` (about 3 minutes; ``--write`` stores the table in
benchmarks/results/compiled_activations_cpu.txt). Last line: ``compiled activations: llama none E -> C h, selective
E -> C h; gpt2 none E -> C h, selective E -> C h`` (eager -> compiled, bytes per token per layer over h).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "compiled_activations_cpu.txt"
DIM, LAYERS, TOKENS = 512, 4, 8192
SHAPES = {"llama": dict(dim=DIM, n_layers=LAYERS, n_heads=8, n_kv_heads=2, ffn_dim=1792, vocab_size=256),
          "gpt2": dict(n_embd=DIM, n_layer=LAYERS, n_head=8, vocab_size=256, block_size=TOKENS, dropout=0.0)}

_CHILD = """
import importlib.util, json, sys
import torch
example, mode, compiled = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
spec = importlib.util.spec_from_file_location("optplan_example_" + example, {root!r} + "/examples/" + example + ".py")
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
from optplan.probes.trainloop import checkpointed_call, selective_context
sys.path.insert(0, {root!r} + "/benchmarks")
from compiled_loss_cpu import _status  # /proc/self/status in bytes
shape = json.loads(sys.argv[4])
tokens = int(sys.argv[5])
torch.manual_seed(0)
if example == "llama":
    cfg = module.make_config("8B", **shape)
    blocks = [module.TransformerBlock(cfg).to(torch.bfloat16) for _ in range(cfg.n_layers)]
    rope = module.RotaryEmbedding(cfg.dim // cfg.n_heads, cfg.rope_theta)
    cos, sin = rope(tokens, torch.device("cpu"), torch.bfloat16)
    extra, dim = (cos, sin), cfg.dim
else:
    cfg = module.make_config(**shape)
    blocks = [module.Block(cfg).to(torch.bfloat16) for _ in range(cfg.n_layer)]
    extra, dim = (), cfg.n_embd
context = selective_context() if mode == "selective" else None

def call(block, x):
    if mode == "none":
        return block(x, *extra)
    return checkpointed_call(block.forward, context, x, *extra)

steps = [torch.compile(lambda x, b=b: call(b, x)) if compiled else (lambda x, b=b: call(b, x)) for b in blocks]

def forward(x):
    for step in steps:
        x = step(x)
    return x

x = torch.randn(1, tokens, dim, dtype=torch.bfloat16, requires_grad=True)
forward(x).sum().backward()  # compiles at the measured shape, allocates the gradients
x = torch.randn(1, tokens, dim, dtype=torch.bfloat16, requires_grad=True)
before = _status("VmRSS")
y = forward(x)
held = _status("VmRSS") - before - y.numel() * y.element_size()
print(json.dumps({{"per_token_layer_over_h": held / tokens / len(blocks) / dim}}))
"""


def saved_over_h(example: str, mode: str, compiled: bool, tokens: int = TOKENS, layers: int = LAYERS) -> float:
    """Bytes per token per layer a forward of ``example``'s blocks holds for the backward, over h (module
    docstring), measured in a subprocess; ``layers`` blocks (the count is per layer: fewer is cheaper, the same
    figure)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    shape = {**SHAPES[example], ("n_layers" if example == "llama" else "n_layer"): layers}
    cmd = [sys.executable, "-c", _CHILD.format(root=str(ROOT)), example, mode, "1" if compiled else "0",
           json.dumps(shape), str(tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{example} {mode} compiled={compiled} failed: {done.stderr.strip()[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["per_token_layer_over_h"])


def optplan_counts(example: str) -> dict[str, float]:
    """optplan's counts for the example's shape (bytes per token per layer over h): Korthikanti's layer
    (``none``) and the op-level policy's kept bytes (``selective``)."""
    from optplan.estimators.profile import TransformerShape
    from optplan.estimators.selective import saved_bytes_per_token

    s = SHAPES[example]
    if example == "llama":
        shape = TransformerShape(hidden=DIM, layers=LAYERS, heads=s["n_heads"], kv_heads=s["n_kv_heads"], vocab=256,
                                 max_seq_len=TOKENS, ffn=s["ffn_dim"], gated=True)
    else:
        shape = TransformerShape(hidden=DIM, layers=LAYERS, heads=s["n_head"], vocab=256, max_seq_len=TOKENS,
                                 ffn=4 * DIM, gated=False)
    kept = saved_bytes_per_token(shape)
    return {"none": shape.layer_bytes_per_token() / DIM, "selective": sum(kept) / DIM if kept else float("nan")}


def measure() -> dict[str, dict[str, dict[str, float]]]:
    """{example: {mode: {"eager", "compiled", "optplan"}}} (bytes per token per layer over h)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for example in SHAPES:
        counts = optplan_counts(example)
        out[example] = {mode: {"eager": saved_over_h(example, mode, False),
                               "compiled": saved_over_h(example, mode, True),
                               "optplan": counts[mode]} for mode in ("none", "selective")}
    return out


def render(results: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [f"saved for the backward, bytes per token per layer / h (dim {DIM}, {LAYERS} layers, {TOKENS} tokens, "
             "bf16, this CPU)",
             f"{'block':6s} {'checkpointing':13s} {'eager':>7s} {'compiled':>9s} {'compiled/eager':>15s} "
             f"{'optplan counts':>15s}"]
    for example, modes in results.items():
        for mode, row in modes.items():
            lines.append(f"{example:6s} {mode:13s} {row['eager']:7.2f} {row['compiled']:9.2f} "
                         f"{row['compiled'] / row['eager']:15.3f} {row['optplan']:15.2f}")
    summary = "; ".join(f"{example} none {m['none']['eager']:.1f} -> {m['none']['compiled']:.1f} h, selective "
                        f"{m['selective']['eager']:.1f} -> {m['selective']['compiled']:.1f} h"
                        for example, m in results.items())
    lines.append(f"compiled activations: {summary}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(ROOT)}")
    args = parser.parse_args()
    text = render(measure())
    print(text, end="")
    if args.write:
        RESULTS.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
