"""CPU fidelity of LoRA fine-tuning (issue 18): predicted against measured live bytes of real training steps.

For a small Hugging Face Llama (the model file ``optplan --hf`` generates from a config.json) with LoRA
adapters on every projection of its blocks:

* predicted: ``optplan.probes.loader.profile_model_file(..., lora=...)`` (the fake-tensor profile, in a child
  process, adapters built by peft) and ``optplan.estimators.memory.memory_breakdown`` for ``Strategy(precision,
  engine="torch", mbs, checkpointing)`` with ``device="cpu"`` and torch's single-tensor AdamW (the CPU default);
  the GPU-only overhead (CUDA context, fragmentation margin) left out.
* measured: the same model built on the CPU with real weights, the same adapters (``optplan.probes.adapters``:
  peft's ``inject_adapter_in_model``), held as the recipe says: ``amp-bf16`` a bf16 base with fp32 adapters
  under ``torch.autocast("cpu", bf16)`` (peft's default, with ``Trainer(bf16=True)``); ``bf16-pure`` everything
  bf16 (TRL's QLoRA adapters); ``fp32`` as built. One warm-up iteration, then a tracked one
  (``optplan.probes.memtrack.MemTracker``): forward + loss, backward, ``torch.optim.AdamW`` over the adapters,
  ``zero_grad(set_to_none=False)``; the peak live bytes of the whole step.

The same for a timm Vision Transformer (``vit_tiny_patch16_224`` through a ``--hf`` timm config, built by
transformers' TimmWrapperForImageClassification; adapters on its blocks' qkv, proj, fc1 and fc2, the default
targets) on a 16-bit and an fp32 base (no quantised base: 4-bit vision fine-tuning is rare). Building it needs timm
(and, on a CPU-only torch, benchmarks/torchvision_ops/install.py).

Run: ``python benchmarks/fidelity_finetune_cpu.py`` (~2 min) or ``--quick``. Last line:
``finetune cpu: max error X% over N runs``. The tests (tests/probes/test_adapters.py) call :func:`run` with a
Llama they have already profiled (:class:`Profiled`, so the profiles serve their own checks too): the ``full`` tier's
--quick matrix with a smaller ViT image, the default run two quantised bases without the ViT (``only``, ``vit``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from optplan.estimators.finetune import LoraRequest
from optplan.estimators.memory import memory_breakdown
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.planner.hf_source import find_hf_config, write_hf_model_file
from optplan.probes.adapters import apply_lora, resolve_targets
from optplan.probes.contract import load_contract
from optplan.probes.dropout import gpu_dropout
from optplan.probes.loader import profile_model_file
from optplan.probes.memtrack import MemTracker
from optplan.probes.static import blocks_of, find_repeated_block
from optplan.probes.step_runner import StepRunner, batch_spec, cast_floating, checkpointed, step_autocast

MIB = 2**20
CAPACITY = 2**50
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 688, "num_attention_heads": 8, "num_hidden_layers": 4, "num_key_value_heads": 2,
         "vocab_size": 4096, "max_position_embeddings": 512, "tie_word_embeddings": False}
LLAMA_QUICK = {**LLAMA, "hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4,
               "num_hidden_layers": 3, "vocab_size": 2048}
RUNS: tuple[tuple[str, str], ...] = (("amp-bf16", "none"), ("bf16-pure", "none"), ("fp32", "none"),
                                     ("bf16-pure", "nf4-dq"), ("bf16-pure", "nf4"), ("bf16-pure", "int8"))
"""(recipe, quantised base): LoRA on a 16-bit (or fp32) base, and on bitsandbytes' 4-bit and 8-bit bases."""
DROPOUT = 0.1
DROPOUT_RUNS: tuple[tuple[str, str], ...] = (("bf16-pure", "none"), ("amp-bf16", "none"), ("bf16-pure", "nf4-dq"),
                                             ("bf16-pure", "int8"))
"""The same with LoRA dropout: each adapted layer keeps a mask and a dropped input, and the int8 base's kept inputs
are no longer the adapters' (the profiler measures which are not); the steps run dropout as a GPU does
(probes/dropout.py)."""
VIT: dict[str, Any] = {"architecture": "vit_tiny_patch16_224", "num_classes": 100,
                       "pretrained_cfg": {"input_size": [3, 224, 224], "num_classes": 100}}
"""A timm config (the timm/... hub layout): ViT-Tiny/16 at 224 x 224 (197 tokens), 100 classes."""
VIT_RUNS = ("amp-bf16", "bf16-pure", "fp32")


@dataclass
class Row:
    model: str
    recipe: str
    quant: str
    checkpointing: str
    mbs: int
    predicted: int
    measured: int
    dropout: float = 0.0

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted - self.measured) / self.measured


@dataclass
class Profiled:
    """A Llama model file the caller has profiled already: ``profile`` with ``request``'s adapters at ``seq`` tokens,
    ``dropped`` the same with LoRA dropout (``request.dropout`` 0, ``dropped.adapter.dropout`` > 0)."""

    path: Path
    seq: int
    request: LoraRequest
    profile: ModelProfile
    dropped: ModelProfile


def model_file(folder: Path, config: dict[str, Any]) -> Path:
    """The model file ``--hf`` generates for ``config`` (written into ``folder``)."""
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return write_hf_model_file(find_hf_config(str(folder)), folder)


def predict(profile: ModelProfile, recipe: str, quant: str, checkpointing: str, mbs: int) -> int:
    strategy = Strategy(precision=recipe, engine="torch", mbs=mbs, checkpointing=checkpointing,  # type: ignore[arg-type]
                        quant=quant)  # type: ignore[arg-type]
    m = memory_breakdown(profile, strategy, CAPACITY, adam_impl="single_tensor", device="cpu")
    return m.total_bytes - m.overhead_bytes


class LoraTrainer:
    """The model with adapters, held as ``recipe`` says, its AdamW and the profiler's StepRunner."""

    def __init__(self, path: Path, seq_len: int | None, request: LoraRequest, recipe: str, quant: str = "none") -> None:
        contract = load_contract(path)
        torch.manual_seed(0)
        model = contract.builder()
        block = find_repeated_block(model)
        blocks = block.blocks if block else []
        request = request.model_copy(update={"targets": resolve_targets(model, request, blocks)})
        self.quant_states: list[torch.Tensor] = quantize(model, quant) if quant != "none" else []
        model = apply_lora(model, request, contract.display)
        model.train()
        if recipe == "amp-bf16":
            frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
            cast_floating(model, lambda name: torch.bfloat16 if name in frozen else None)
        elif recipe == "bf16-pure":
            cast_floating(model, lambda _name: torch.bfloat16)
        spec, _ = batch_spec(contract, model, seq_len)
        self.model = model
        self.precision = {"amp-bf16": "bf16-frozen", "bf16-pure": "fp32", "fp32": "fp32"}[recipe]
        self.runner = StepRunner(model=model, spec=spec, loss_fn=contract.loss_fn, display=contract.display,
                                 blocks=blocks_of(model, block.cls if block else None),
                                 input_dtype=torch.bfloat16 if recipe == "bf16-pure" else None)
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)

    def step(self, mbs: int, checkpointing: str, tracker: MemTracker | None = None) -> None:
        runner = self.runner
        with checkpointed(runner.blocks, checkpointing), gpu_dropout():
            batch = runner.make_batch(mbs)
            with step_autocast(self.precision):  # type: ignore[arg-type]
                out = runner.forward(batch, mbs)
                loss = runner.loss(out, batch)
            del out, batch
            runner.backward(loss)
            del loss
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)

    def measure(self, mbs: int, checkpointing: str) -> int:
        """The peak live bytes of one tracked training step (after a warm-up step)."""
        self.step(mbs, checkpointing)
        params = list(self.model.parameters())
        tracker = MemTracker()
        tracker.track(params, category="param")
        tracker.track([p.grad for p in params if p.grad is not None], category="grad")
        tracker.track([t for state in self.opt.state.values() for t in state.values()
                       if isinstance(t, torch.Tensor)], category="optimizer")
        tracker.track(list(self.model.buffers()), category="buffer")
        tracker.track(self.quant_states, category="param")
        with tracker:
            self.step(mbs, checkpointing)
        return tracker.peak_bytes


def quantize(model: torch.nn.Module, quant: str) -> list[torch.Tensor]:
    """Replace every nn.Linear but the output head by bitsandbytes' 4-bit (NF4, with double quantisation for
    ``nf4-dq``) or 8-bit (LLM.int8) layer, quantised on the CPU as ``transformers.BitsAndBytesConfig`` would;
    returns the quant-state tensors (absmax constants, row scales) that live beside the packed weights."""
    import bitsandbytes as bnb

    head = model.get_output_embeddings()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    states: list[torch.Tensor] = []
    for name in names:
        lin = model.get_submodule(name)
        parent, _, attr = name.rpartition(".")
        if quant == "int8":
            q: torch.nn.Module = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                                     has_fp16_weights=False)
            q.weight = bnb.nn.Int8Params(lin.weight.data, requires_grad=False, has_fp16_weights=False)
        else:
            dq = quant == "nf4-dq"
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                  compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=dq)
            q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4",
                                         compress_statistics=dq)
        q = q.to("cpu")
        model.get_submodule(parent).__setattr__(attr, q)
        w = q.weight
        if quant == "int8":
            states.append(w.SCB)
        else:
            qs = w.quant_state
            states += [qs.absmax, qs.code] + ([qs.state2.absmax, qs.offset] if qs.nested else [])
    return states


def run(quick: bool, log: Any = print, *, llama: Profiled | None = None, vit_side: int = 224,
        only: Collection[tuple[str, str, bool]] | None = None, vit: bool = True) -> list[Row]:
    """The rows of every run (module docstring); ``llama``: that model and its profiles instead of
    :data:`LLAMA` (:data:`LLAMA_QUICK` when ``quick``) at 128 (64) tokens, rank-8 adapters and :data:`DROPOUT`;
    ``vit_side``: the ViT's image side in pixels (``model_args.img_size``; 224 as the config names it); ``only``:
    the Llama's runs of those (recipe, base, with dropout) alone; ``vit``: whether the ViT's rows run."""
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="optplan_finetune_") as tmp:
        if llama is None:
            seq = 64 if quick else 128
            request = LoraRequest(rank=8)
            path = model_file(Path(tmp), LLAMA_QUICK if quick else LLAMA)
            profile = profile_model_file(path, seq_len=seq, lora=request)
            dropped = profile_model_file(path, seq_len=seq, lora=request.model_copy(update={"dropout": DROPOUT}))
        else:
            path, seq, request, profile, dropped = llama.path, llama.seq, llama.request, llama.profile, llama.dropped
        dropout = dropped.adapter.dropout if dropped.adapter else DROPOUT
        log(f"model: {profile.model_class} {profile.params:,} parameters ({profile.trainable_params:,} LoRA, rank "
            f"{request.rank}, targets {','.join(profile.adapter.targets if profile.adapter else ())}), seq {seq}")
        log(f"{'recipe':<10}{'base':<7}{'ckpt':<6}{'mbs':>4}{'drop':>6} | {'predicted':>10}{'measured':>10}{'err':>9}"
            "   (MiB)")
        plan = [(r, q, request, profile) for r, q in RUNS]
        plan += [(r, q, request.model_copy(update={"dropout": dropout}), dropped) for r, q in DROPOUT_RUNS]
        for recipe, quant, req, prof in plan:
            if only is not None and (recipe, quant, req.dropout > 0) not in only:
                continue
            trainer = LoraTrainer(path, seq, req, recipe, quant)
            for ckpt in ("none", "full"):
                for mbs in ((2,) if quick else (1, 4)):  # --quick (the tests): one micro-batch size
                    row = Row("llama", recipe, quant, ckpt, mbs, predict(prof, recipe, quant, ckpt, mbs),
                              trainer.measure(mbs, ckpt), req.dropout)
                    rows.append(row)
                    log(row_line(row))
            del trainer
            gc.collect()
        if vit:
            rows += run_vit(Path(tmp), quick, request, log, vit_side)
    return rows


def row_line(row: Row) -> str:
    return (f"{row.recipe:<10}{row.quant:<7}{row.checkpointing:<6}{row.mbs:>4}{row.dropout:>6g} | "
            f"{row.predicted / MIB:>10.2f}{row.measured / MIB:>10.2f}{row.error_pct:>+8.2f}%")


def run_vit(tmp: Path, quick: bool, request: LoraRequest, log: Any, side: int = 224) -> list[Row]:
    """The timm ViT's rows (module docstring), at ``side`` x ``side`` pixels."""
    folder = tmp / "vit"
    folder.mkdir()
    config = VIT if side == 224 else {**VIT, "model_args": {"img_size": side},
                                      "pretrained_cfg": {**VIT["pretrained_cfg"], "input_size": [3, side, side]}}
    path = model_file(folder, config)
    profile = profile_model_file(path, seq_len=None, lora=request)
    log(f"model: {profile.model_class} (timm {VIT['architecture']}) {profile.params:,} parameters "
        f"({profile.trainable_params:,} LoRA, rank {request.rank}, targets "
        f"{','.join(profile.adapter.targets if profile.adapter else ())}), {side} x {side}")
    rows: list[Row] = []
    for recipe in VIT_RUNS[:1] if quick else VIT_RUNS:
        trainer = LoraTrainer(path, None, request, recipe)
        for ckpt in ("none", "full"):
            for mbs in ((2,) if quick else (1, 4)):
                row = Row("vit", recipe, "none", ckpt, mbs, predict(profile, recipe, "none", ckpt, mbs),
                          trainer.measure(mbs, ckpt))
                rows.append(row)
                log(row_line(row))
        del trainer
        gc.collect()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model (seconds)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    rows = run(args.quick)
    worst = max(abs(r.error_pct) for r in rows)
    print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"finetune cpu: max error {worst:.2f}% over {len(rows)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
