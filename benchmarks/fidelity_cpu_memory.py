"""CPU exact-accounting fidelity (issue 3): predicted vs measured activation and step-peak bytes.

For each example model, at two micro-batches, for fp32 and amp-bf16 (``torch.autocast("cpu", bf16)`` on
fp32 weights) and checkpointing none / full (every repeated block, ``torch.utils.checkpoint``
non-reentrant, as the profile does):

* predicted: ``optplan.probes.loader.profile_model_file`` (the fake-tensor profile, in a child process)
  and ``optplan.estimators.memory.memory_breakdown`` for ``Strategy(precision, optimizer="adamw", mbs,
  checkpointing)`` (dp 1, ZeRO 0, everything else default). Activations = ``activations_bytes``;
  total = params + grads + optimizer + activations (``buffers_bytes`` and ``overhead_bytes`` are
  GPU/distributed terms and are left out): the "memory.py" column. The "total pred" column adds what
  ``estimators/temporaries.py`` models and ``memory.py`` does not (yet): the AdamW step's scratch
  tensors (the step's peak is ``states + max(activations, optimizer scratch)``), Adam's
  ``state["step"]`` tensors (4 B per parameter tensor, on the CPU) and the model's own buffers
  (``profile.buffer_bytes``).
* measured: a REAL training step on the CPU with real weights, tracked by
  ``optplan.probes.memtrack.MemTracker``: forward + loss (under autocast for bf16), backward,
  ``torch.optim.AdamW(model.parameters()).step()`` with torch's default implementation (the
  single-tensor loop on CPU; ``--adamw foreach`` forces the multi-tensor one, CUDA's default), then
  ``zero_grad``. Every row is measured on the second or a later iteration of the same model and
  optimizer, so gradients and optimizer states already exist: by default the gradients stay allocated
  between steps (``zero_grad(set_to_none=False)``, the profile's definition); ``--grads freed`` uses
  torch's default ``zero_grad()`` (set to None: gradients are allocated again during each backward).
  The batch is the model file's ``example_batch`` (or the inferred token batch) at the profile's
  sequence length, created inside the tracked step, and the loss is the file's ``loss_fn`` (or the
  default loss), exactly as the profiler's ``StepRunner`` does.
  Activations = peak live bytes during forward + loss + backward minus the resident parameters,
  gradients, optimizer states and buffers; total = the step's peak live bytes (whichever phase).

Run: ``python benchmarks/fidelity_cpu_memory.py`` (40 rows: ~3 min on 2 idle cores, ~8 min when other
jobs share them) or ``--quick`` (20 smaller rows, ~30 s). Prints a table per model and, last,
``activations: max error X%; total peak: max error Y%``. No assertions (tests/probes/test_cpu_accounting.py
asserts on tiny models).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from optplan.estimators.memory import memory_breakdown
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.temporaries import (
    AdamImpl,
)
from optplan.probes.contract import DEFAULT_TOKEN_SEQ_LEN, load_contract
from optplan.probes.loader import profile_model_file
from optplan.probes.memtrack import MemTracker
from optplan.probes.static import blocks_of, find_repeated_block, resolve_seq_len
from optplan.probes.step_runner import StepRunner, batch_spec, checkpointed, step_autocast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_files import example_source  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MIB = 2**20
PRECISIONS = {"fp32": "fp32", "bf16": "amp-bf16"}  # profile precision -> Strategy recipe
CAPACITY = 2**50  # "unlimited": fits is irrelevant here

LLAMA_SHAPE = dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=2, ffn_dim=1536)
LLAMA_QUICK_SHAPE = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=1, ffn_dim=768)
MOE_SHAPE = dict(dim=512, n_layers=5, n_heads=8, n_kv_heads=2, ffn_dim=1536, vocab_size=32000, num_experts=16,
                 num_experts_per_tok=4, moe_ffn_dim=256, n_shared_experts=1, first_dense=1)
MOE_TEXT = ("examples/moe.py build_model('lite', {args}): DeepSeekMoE layout reduced (dense first layer, 16 routed "
            "experts top-4 + 1 shared, routed for real by its torch.where loop), seq 256")


@dataclass
class Case:
    """One model file to compare, and how it was reduced (said in the output)."""

    name: str
    path: Path
    seq_len: int | None
    shape: str
    precisions: tuple[str, ...] = ("fp32", "bf16")
    checkpointing: tuple[str, ...] = ("none", "full")


@dataclass
class Row:
    model: str
    precision: str
    checkpointing: str
    mbs: int
    act_pred: int
    act_real: int | None  # None when the gradients are freed between steps (no resident baseline)
    total_pred_memory_py: int
    total_pred: int
    total_real: int
    peak_phase: str
    seconds: float

    @property
    def act_err(self) -> float | None:
        return None if self.act_real is None else pct(self.act_pred, self.act_real)

    @property
    def total_err(self) -> float:
        return pct(self.total_pred, self.total_real)

    @property
    def total_err_memory_py(self) -> float:
        return pct(self.total_pred_memory_py, self.total_real)


def pct(pred: float, real: float) -> float:
    """Signed percent error of ``pred`` against ``real``."""
    return 100.0 * (pred - real) / real if real else (0.0 if pred == real else float("inf"))


# ---------------------------------------------------------------------------------------------------
# the models
# ---------------------------------------------------------------------------------------------------
def example_wrapper(directory: Path, example: str, size: str, shape: dict[str, int], seq_len: int) -> Path:
    """A model file building a reduced examples/<example>.py through its ``build_model(size, **overrides)``, with
    token ids below the reduced config's vocabulary."""
    path = directory / f"{example}_reduced.py"
    path.write_text(example_source(example, size, shape, {"seq_len": seq_len}), encoding="utf-8")
    return path


def llama_wrapper(directory: Path, shape: dict[str, int], seq_len: int) -> Path:
    """A reduced Llama (vocabulary 128256 and tied embeddings of the 1B size kept)."""
    return example_wrapper(directory, "llama", "1B", shape, seq_len)


def llama_shape_text(shape: dict[str, int], seq_len: int) -> str:
    cfg = {k: v for k, v in shape.items()}
    args = ", ".join(f"{k}={v}" for k, v in cfg.items())
    return (f"examples/llama.py build_model('1B', {args}): Llama-3 1B layout reduced (vocab 128256, tied "
            f"embeddings, GQA, SwiGLU, RoPE), seq {seq_len}")


def cases(quick: bool, tmp: Path) -> list[Case]:
    if quick:
        return [
            Case("mlp", EXAMPLES / "mlp.py", None, "examples/mlp.py as is (in 64, hidden 256, depth 4)"),
            Case("gpt2-128", EXAMPLES / "gpt2.py", 128, "examples/gpt2.py GPT-2 small (124M) as is, seq 128",
                 checkpointing=("none",)),
            Case("llama", llama_wrapper(tmp, LLAMA_QUICK_SHAPE, 128), 128,
                 llama_shape_text(LLAMA_QUICK_SHAPE, 128)),
        ]
    return [
        Case("mlp", EXAMPLES / "mlp.py", None, "examples/mlp.py as is (in 64, hidden 256, depth 4)"),
        Case("gpt2", EXAMPLES / "gpt2.py", 1024, "examples/gpt2.py GPT-2 small (124M) as is, seq 1024"),
        Case("gpt2-256", EXAMPLES / "gpt2.py", 256,
             "examples/gpt2.py GPT-2 small (124M) as is, seq 256 (short sequences: the vocabulary-sized "
             "tensors weigh more)"),
        Case("resnet", EXAMPLES / "resnet.py", None, "examples/resnet.py ResNet-50 as is, 224x224 images"),
        Case("llama", llama_wrapper(tmp, LLAMA_SHAPE, 256), 256, llama_shape_text(LLAMA_SHAPE, 256)),
        Case("moe", example_wrapper(tmp, "moe", "lite", MOE_SHAPE, 256), 256,
             MOE_TEXT.format(args=", ".join(f"{k}={v}" for k, v in MOE_SHAPE.items()))),
    ]


# ---------------------------------------------------------------------------------------------------
# predicted
# ---------------------------------------------------------------------------------------------------
@dataclass
class Prediction:
    act: int
    total_memory_py: int
    total: int


def checkpoint_mode(checkpointing: str) -> tuple[str, int | None]:
    """``none``, ``selective``, ``full`` (every block) or ``full:N`` (the first N blocks: partial checkpointing,
    estimators/partial_checkpointing.py) -> (mode, block count or None)."""
    mode, _, count = checkpointing.partition(":")
    return mode, int(count) if count else None


def predict(profile: ModelProfile, precision: str, checkpointing: str, mbs: int, impl: AdamImpl) -> Prediction:
    """Activation and step-peak bytes from ``estimators.memory.memory_breakdown`` for a CPU step with the
    AdamW implementation ``impl``: its GPU-only overhead (CUDA context, fragmentation margin) left out.
    ``total_memory_py`` is the old composition without the optimizer-step items, for reference."""
    mode, count = checkpoint_mode(checkpointing)
    strategy = Strategy(precision=PRECISIONS[precision], optimizer="adamw", mbs=mbs, engine="torch",  # type: ignore[arg-type]
                        checkpointing=mode, checkpoint_layers=count)  # type: ignore[arg-type]
    m = memory_breakdown(profile, strategy, capacity_bytes=CAPACITY, adam_impl=impl, device="cpu")
    states = m.params_bytes + m.grads_bytes + m.optimizer_bytes
    return Prediction(act=m.activations_bytes, total_memory_py=states + m.activations_bytes,
                      total=m.total_bytes - m.overhead_bytes)


# ---------------------------------------------------------------------------------------------------
# measured: real CPU training steps
# ---------------------------------------------------------------------------------------------------
@dataclass
class Measured:
    act: int | None  # peak of forward + loss + backward above the resident states (None: grads freed)
    total: int  # peak live bytes of the whole step
    phase: str  # where the step's peak was: fwd, bwd or opt
    seconds: float


@dataclass
class RealTrainer:
    """A real model, its AdamW optimizer and the profiler's StepRunner, warmed up by one full step."""

    path: Path
    seq_len: int | None
    impl: AdamImpl = "single_tensor"
    grads: str = "resident"
    model: Any = None
    runner: Any = None
    opt: Any = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        contract = load_contract(self.path)
        torch.manual_seed(0)
        model = contract.builder()  # real weights on the CPU
        model.train()
        explicit, _ = resolve_seq_len(contract, model, self.seq_len)
        spec, note = batch_spec(contract, model, explicit if explicit is not None else DEFAULT_TOKEN_SEQ_LEN)
        if note:
            self.notes.append(note)
        block = find_repeated_block(model)
        self.model = model
        self.runner = StepRunner(model=model, spec=spec, loss_fn=contract.loss_fn, display=contract.display,
                                 blocks=blocks_of(model, block.cls if block else None))
        self.opt = torch.optim.AdamW(model.parameters(), foreach=self.impl == "foreach")

    def warm_up(self, mbs: int) -> None:
        """Iteration 1: allocates the gradients and the optimizer states."""
        self.runner.step(mbs)
        self.opt.step()
        self.opt.zero_grad(set_to_none=self.grads == "freed")

    def measure(self, precision: str, checkpointing: str, mbs: int) -> Measured:
        """One more training step (forward, loss, backward, AdamW step, zero_grad) under MemTracker."""
        t0 = time.perf_counter()
        params = list(self.model.parameters())
        tracker = MemTracker()
        tracker.track(params, category="param")
        tracker.track([p.grad for p in params], category="grad")
        tracker.track([t for state in self.opt.state.values() for t in state.values()
                       if isinstance(t, torch.Tensor)], category="optimizer")
        tracker.track(list(self.model.buffers()), category="buffer")
        resident = tracker.live_bytes
        runner = self.runner
        mode, count = checkpoint_mode(checkpointing)
        with checkpointed(runner.blocks[:count], mode), tracker:
            batch = runner.make_batch(mbs)
            with step_autocast(precision):  # type: ignore[arg-type]
                out = runner.forward(batch, mbs)
                loss = runner.loss(out, batch)
            del out, batch
            fwd = tracker.peak_bytes
            tracker.reset_peak()
            runner.backward(loss)
            del loss
            bwd = tracker.peak_bytes
            tracker.reset_peak()
            self.opt.step()
            opt = tracker.peak_bytes
            self.opt.zero_grad(set_to_none=self.grads == "freed")
        phases = {"fwd": fwd, "bwd": bwd, "opt": opt}
        phase = max(phases, key=phases.__getitem__)
        # with freed gradients, backward allocates them as it goes: no activation figure separates out
        act = max(fwd, bwd) - resident if self.grads == "resident" else None
        return Measured(act=act, total=phases[phase], phase=phase,
                        seconds=time.perf_counter() - t0)

    def close(self) -> None:
        self.model = self.runner = self.opt = None
        gc.collect()


# ---------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------
def run_case(case: Case, micro_batches: tuple[int, ...], impl: AdamImpl, grads: str,
             log: Any = print) -> tuple[list[Row], ModelProfile, float]:
    t0 = time.perf_counter()
    profile = profile_model_file(case.path, seq_len=case.seq_len, use_cache=False)  # profile_s is printed: a real one
    profile_s = time.perf_counter() - t0
    trainer = RealTrainer(case.path, case.seq_len, impl=impl, grads=grads)
    rows: list[Row] = []
    try:
        trainer.warm_up(micro_batches[0])
        ckpts = case.checkpointing if profile.supports_checkpointing else ("none",)
        for precision in case.precisions:
            for ckpt in ckpts:
                for mbs in micro_batches:
                    pred = predict(profile, precision, ckpt, mbs, impl)
                    real = trainer.measure(precision, ckpt, mbs)
                    row = Row(case.name, precision, ckpt, mbs, pred.act, real.act, pred.total_memory_py,
                              pred.total, real.total, real.phase, real.seconds)
                    rows.append(row)
                    log(format_row(row))
    finally:
        trainer.close()
    return rows, profile, profile_s


HEADER = (f"{'model':<9}{'prec':<6}{'ckpt':<5}{'mbs':>4} | {'act pred':>10}{'act real':>10}{'err':>8} | "
          f"{'total pred':>11}{'total real':>11}{'err':>8}{'peak':>5} | {'memory.py':>10}{'err':>8} | {'s':>5}")


def format_row(r: Row) -> str:
    act = (f"{'n/a':>10}{'n/a':>8}" if r.act_real is None or r.act_err is None
           else f"{r.act_real / MIB:>10.2f}{r.act_err:>+7.2f}%")
    return (f"{r.model:<9}{r.precision:<6}{r.checkpointing:<5}{r.mbs:>4} | {r.act_pred / MIB:>10.2f}"
            f"{act} | {r.total_pred / MIB:>11.2f}{r.total_real / MIB:>11.2f}"
            f"{r.total_err:>+7.2f}%{r.peak_phase:>5} | {r.total_pred_memory_py / MIB:>10.2f}"
            f"{r.total_err_memory_py:>+7.2f}% | {r.seconds:>5.1f}")


@contextlib.contextmanager
def _tmpdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="optplan_fidelity_") as d:
        yield Path(d)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer and smaller rows (~1 min)")
    parser.add_argument("--mbs", default="2,4", help="the two micro-batches (default 2,4: one inside the "
                        "profile's fitted range 1-2, one beyond it)")
    parser.add_argument("--models", default=None, help="comma-separated subset of mlp,gpt2,gpt2-256,resnet,llama,moe "
                        "(--quick: mlp,gpt2-128,llama)")
    parser.add_argument("--adamw", choices=("single_tensor", "foreach"), default="single_tensor",
                        help="AdamW implementation of the real step (default: torch's CPU default)")
    parser.add_argument("--grads", choices=("resident", "freed"), default="resident",
                        help="keep gradients allocated between steps (zero_grad(set_to_none=False), the "
                             "profile's definition) or free them (torch's default zero_grad())")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's); the tracked bytes do not depend on it")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    micro_batches = tuple(int(x) for x in args.mbs.split(","))
    wanted = set(args.models.split(",")) if args.models else None
    start = time.perf_counter()
    print(f"CPU exact accounting: torch {torch.__version__}, {torch.get_num_threads()} threads; AdamW "
          f"{args.adamw}, gradients {args.grads} between steps; micro-batches {micro_batches}")
    print("act = peak of forward+loss+backward above params+grads+optimizer states+buffers; total = the "
          "step's peak live tensor bytes; MiB; err = (pred - real) / real")
    print("total pred = memory.py states + max(activations, AdamW step scratch) + Adam step counters + "
          "model buffers (estimators/temporaries.py); memory.py = params + grads + optimizer + activations")
    rows: list[Row] = []
    with _tmpdir() as tmp:
        for case in cases(args.quick, tmp):
            if wanted is not None and case.name not in wanted:
                continue
            print(f"\n{case.name}: {case.shape}")
            print(HEADER, flush=True)
            case_rows, profile, profile_s = run_case(case, micro_batches, args.adamw, args.grads,
                                                     log=lambda line: print(line, flush=True))
            how = f"; {profile.notes[0]}" if profile.profiled_blocks else "; profiled at full depth"
            print(f"  ({profile.params:,} parameters; fake-tensor profile {profile_s:.1f} s{how})")
            rows.extend(case_rows)
    if not rows:
        print("no rows (check --models)")
        return 2
    act_errs = [abs(r.act_err) for r in rows if r.act_err is not None]
    act_max = f"{max(act_errs):.2f}%" if act_errs else "n/a (gradients freed)"
    total_max = max(abs(r.total_err) for r in rows)
    mem_max = max(abs(r.total_err_memory_py) for r in rows)
    print(f"\nwall time {time.perf_counter() - start:.0f} s; {len(rows)} rows")
    print(f"total peak with memory.py alone (no optimizer-step term): max error {mem_max:.2f}%")
    print(f"activations: max error {act_max}; total peak: max error {total_max:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
