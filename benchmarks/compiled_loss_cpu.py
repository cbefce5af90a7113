"""A compiled cross entropy against an eager one, measured on this CPU: the bytes the loss holds at its peak and the
bytes its kernels move, per logit (estimators/compiled_loss.py's constants).

The loss is the one torchtitan and optplan's examples write, ``cross_entropy(logits.flatten(0, 1).float(), targets)``
over 16-bit (or fp32) logits that require a gradient. For each dtype, eager and under ``torch.compile`` (TorchInductor,
compiled and run once before the measurement):

* **held**: the process's resident-memory high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) over one
  forward + backward, less the resident memory before it (the logits and targets already allocated), per logit. The
  tensors are hundreds of MB, so glibc serves them by ``mmap`` and returns them at once: the high-water mark is the
  peak of the live tensors (allocator noise is a few MB against the GBs measured);
* **moved** (compiled only): Inductor's own count of the bytes its generated kernels read and write in the forward
  and the backward (``GraphLowering.count_bytes``, as benchmarks/compiled_traffic.py reads it), the slope between two
  batch sizes per logit.

Inductor's CPU code generation stands for its Triton one: what the min-cut partitioner saves for backward and which
operators share a kernel are device-independent (stated; what the GPU's kernels achieve of its bandwidth is the time
model's). Eager, the CPU runs the same ATen composite (log_softmax, nll_loss) as CUDA.

And the whole training step of a wide-vocabulary Llama (:data:`STEP_MODEL`) under optplan's training loop, eager and
with its ``loss_fn`` compiled, each in its own process: what the compiled loss saves at the step's resident peak
against what the estimate saves from the model file's measured profile (:func:`step_saving`).

Run: ``python benchmarks/compiled_loss_cpu.py [--logits N]`` (about 2 minutes). Last line: ``compiled loss: held X / Y
bytes per 16-bit logit (compiled / eager, optplan counts A / B), moved Z (optplan C)``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compiled_traffic import _quiet_inductor, fused_bytes  # noqa: E402
from example_files import example_source  # noqa: E402

from optplan.estimators.arch import LOGIT_BYTES  # noqa: E402
from optplan.estimators.compiled_loss import (  # noqa: E402
    COMPILED_LOSS_PEAK_BYTES_PER_LOGIT,
    COMPILED_LOSS_TRAFFIC_BYTES_PER_LOGIT,
)

VOCAB = 32_000
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """torchtitan's cross entropy (``torchtitan/components/loss.py``), examples/llama.py's."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def held_bytes_per_logit(fn: Any, dtype: torch.dtype, logits: int) -> float:
    """Peak resident bytes of one forward + backward of ``fn`` above the held logits, per logit."""
    tokens = logits // VOCAB
    x = torch.randn(2, tokens // 2, VOCAB, dtype=dtype).requires_grad_()
    y = torch.randint(0, VOCAB, (2, tokens // 2))
    before = _status("VmRSS")
    _reset_high_water()
    fn(x, y).backward()
    peak = _status("VmHWM")
    return (peak - before) / x.numel()


def moved_bytes_per_logit(dtype: torch.dtype) -> float:
    """Bytes Inductor's compiled loss kernels read and write per logit (forward + backward), at 512 tokens: the
    loss has no per-step constant (no weights), and its per-row statistics add 8 bytes per 32,000 logits."""
    seq = 256

    def run(b: int) -> None:
        x = torch.randn(b, seq, VOCAB, dtype=dtype).requires_grad_()
        torch.compile(loss_fn)(x, torch.randint(0, VOCAB, (b, seq))).backward()

    return fused_bytes(run, 2) / (2 * seq * VOCAB)


def measure(logits: int = 2**26, dtypes: tuple[str, ...] = ("bf16", "fp32")) -> dict[str, dict[str, float]]:
    """{dtype: {"eager": held, "compiled": held, "moved": moved}} per logit (bytes)."""
    torch.manual_seed(0)
    _quiet_inductor()
    compiled = torch.compile(loss_fn)
    out: dict[str, dict[str, float]] = {}
    for name in dtypes:
        dtype = DTYPES[name]
        tokens = logits // VOCAB
        warm = torch.randn(2, tokens // 2, VOCAB, dtype=dtype).requires_grad_()  # the measured shape: no recompile
        compiled(warm, torch.randint(0, VOCAB, (2, tokens // 2))).backward()  # compile outside the measurement
        del warm
        out[name] = {"eager": held_bytes_per_logit(loss_fn, dtype, logits),
                     "compiled": held_bytes_per_logit(compiled, dtype, logits),
                     "moved": moved_bytes_per_logit(dtype)}
    return out


STEP_MODEL = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=128_256)
"""examples/llama.py at a tiny width with Llama 3's vocabulary: the logits dominate the step's activations."""
STEP_SEQ, STEP_MBS = 512, 2

_STEP_CHILD = """
import json, sys, torch
sys.path.insert(0, {bench!r})
import compiled_loss_cpu as b
from optplan.probes.trainloop import Trainer, load_model_file
module = load_model_file({path!r})
trainer = Trainer({strategy!r}, block_class="TransformerBlock")
torch.manual_seed(0)
model = module.build_model()
trainer.setup_training(model, trainer.setup_device())
trainer.loss_fn = module.loss_fn
batch = module.example_batch({mbs}, {seq})
trainer.one_step(lambda _i: batch)  # compiles, allocates gradients and optimizer states
before = b._status("VmRSS")
model.register_forward_hook(lambda *_a: b._reset_high_water())  # the loss and the backward: the CPU's bf16 matmul
trainer.one_step(lambda _i: batch)                            # writes fp32 before its cast, a GPU does not
print(json.dumps({{"peak_bytes": b._status("VmHWM") - before, "compiled": trainer.compiled_loss_fn is not None}}))
"""


def _model_file(folder: Path) -> Path:
    path = folder / "llama_wide_vocab.py"
    path.write_text(example_source("llama", "1B", STEP_MODEL, {"seq_len": STEP_SEQ}), encoding="utf-8")
    return path


def step_saving() -> tuple[float, float, float]:
    """(measured, predicted bytes the compiled loss saves at the training step's peak, eager step's peak bytes)
    of :data:`STEP_MODEL` in bf16 under optplan's training loop (probes/trainloop.py), each step in its own process:
    the resident high-water mark of the second step from the end of its forward (the loss and the backward) above
    the memory before the step (states allocated), against the estimate's activation peak
    (estimators/activations.py) from the model file's measured profile. The forward is left out: the CPU's bf16
    matmul writes an fp32 output before casting it (6 bytes per logit at the output head, measured), which a GPU's
    cuBLAS does not and the profile (the GPU's bytes) does not count."""
    import json
    import subprocess
    import tempfile

    from optplan.estimators.activations import activation_bytes
    from optplan.estimators.strategy import Strategy
    from optplan.probes.loader import profile_model_file

    with tempfile.TemporaryDirectory(prefix="optplan-compiled-loss-") as tmp:
        path = _model_file(Path(tmp))
        peaks = {}
        for compiled in (False, True):
            strategy = {"engine": "torch", "precision": "bf16", "mbs": STEP_MBS, "compile_loss": compiled}
            code = _STEP_CHILD.format(bench=str(Path(__file__).resolve().parent), path=str(path),
                                      strategy=strategy, mbs=STEP_MBS, seq=STEP_SEQ)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            doc = json.loads(out.stdout.strip().splitlines()[-1])
            assert doc["compiled"] == compiled
            peaks[compiled] = float(doc["peak_bytes"])
        profile = profile_model_file(path, seq_len=STEP_SEQ)
    plan = Strategy(engine="torch", precision="bf16", mbs=STEP_MBS)
    predicted = (activation_bytes(profile, plan.model_copy(update={"compile_loss": False}))
                 - activation_bytes(profile, plan.model_copy(update={"compile_loss": True})))
    return peaks[False] - peaks[True], float(predicted), peaks[False]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logits", type=int, default=2**26, help="logits of the measured step (tokens x 32,000)")
    args = ap.parse_args()
    got = measure(args.logits)
    print("bytes per logit; held = peak above the logits the harness holds (optplan's eager count: the loss's fp32 "
          "tensors, the loop freeing the logits; its compiled count less the held logits: their gradient)")
    print(f"{'dtype':6s} {'eager held':>10s} {'compiled held':>13s} {'optplan eager':>13s} {'optplan compiled':>16s} "
          f"{'moved':>6s} {'optplan':>7s}")
    for name, row in got.items():
        itemsize = DTYPES[name].itemsize
        print(f"{name:6s} {row['eager']:10.2f} {row['compiled']:13.2f} {LOGIT_BYTES[name]:13d} "
              f"{COMPILED_LOSS_PEAK_BYTES_PER_LOGIT[name] - itemsize:16d} {row['moved']:6.2f} "
              f"{COMPILED_LOSS_TRAFFIC_BYTES_PER_LOGIT[name]:7d}")
    measured, predicted, eager_peak = step_saving()
    logits = STEP_MBS * STEP_SEQ * STEP_MODEL["vocab_size"]
    print(f"training step (examples/llama.py dim {STEP_MODEL['dim']}, vocabulary {STEP_MODEL['vocab_size']:,}, "
          f"bf16, {STEP_MBS} x {STEP_SEQ} tokens; optplan's training loop; the loss and backward): the compiled loss saves "
          f"{measured / 2**20:.0f} MiB measured ({measured / logits:.2f} B/logit) of the eager step's "
          f"{eager_peak / 2**20:.0f} MiB peak, {predicted / 2**20:.0f} MiB predicted ({predicted / logits:.2f} B/logit):"
          f" ratio {predicted / measured:.2f}")
    b = got["bf16"]
    print(f"compiled loss: held {b['compiled']:.2f} / {b['eager']:.2f} bytes per 16-bit logit (compiled / eager, "
          f"optplan counts {COMPILED_LOSS_PEAK_BYTES_PER_LOGIT['bf16'] - 2} / {LOGIT_BYTES['bf16']}), moved "
          f"{b['moved']:.2f} (optplan {COMPILED_LOSS_TRAFFIC_BYTES_PER_LOGIT['bf16']})")


if __name__ == "__main__":
    main()
