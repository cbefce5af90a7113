"""CPU fidelity of tensor parallelism by the model's own tp_plan (issue 18): predicted against measured live bytes.

For a small Hugging Face Llama (hidden 256, 4 layers, 8 heads, 4 key-value heads, vocab 4096, untied head), saved
with random weights to a temporary folder:

* predicted: ``optplan.probes.loader.profile_model_file`` of the model file ``optplan --hf`` generates
  (``planner.hf_source.write_hf_model_file``; the profile carries the model's ``tensor_plan``) and
  ``optplan.estimators.memory.memory_breakdown(..., device="cpu")`` for ``Strategy(engine="torch", tp=2, dp=1,
  fsdp="none")`` and ``Strategy(engine="torch", tp=2, dp=2, fsdp="full")`` (one node of 2 or 4 ranks): the
  allocated bytes ``total_bytes - overhead_bytes`` (a plan's ``cpu_allocated_bytes``: no CUDA context, no
  fragmentation margin on a CPU). This raw figure is the one printed and scored.
* measured: ``torchrun --nproc-per-node 2|4`` (gloo, ``OMP_NUM_THREADS=1``) of this file's child mode, which loads
  the model as ``finetune.py`` does, ``AutoModelForCausalLM.from_pretrained(folder, dtype=float32,
  distributed_config=DistributedConfig(tp_size=2, fsdp_size=dp, fsdp_mixed_precision=...))`` (transformers 5:
  DTensor parameters by the model's ``tp_plan``; with dp > 1 FSDP2 by the model's fsdp plan over the 2-D mesh),
  turns the generation cache off as the profiled model file does, checkpoints every decoder layer
  (``gradient_checkpointing_enable``, non-reentrant) when asked, builds ``torch.optim.AdamW`` with torch's
  defaults (the single-tensor loop on CPU, what ``engine_adam_impl("torch", "cpu")`` assumes) and runs ``forward
  (with the loss) + backward + optimizer.step + zero_grad(set_to_none=False)``: one warm-up step, then
  :data:`TRACKED_STEPS` steps under a live-tensor tracker. A rank's figure is the smallest of those steps' peaks
  (gloo's worker thread now and then still holds a collective's input, e.g. the head's local logits under the
  all-gather, when the peak comes: up to +3 MiB here, a CPU-only effect; ``--detail`` shows the largest too), and
  the case's figure the largest over ranks.

Precision as the recipes say: ``fp32`` no autocast; ``amp-bf16`` fp32 parameters (FSDP all-gathers fp32) under
``torch.autocast("cpu", bf16)``; ``bf16`` (tp2 x dp2 only) transformers' ``fsdp_mixed_precision``
(transformers/distributed/fsdp.py ``_get_fsdp_policy_kwargs``: ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, fp32 shards) under the autocast SFTConfig(bf16=True) adds: bf16 all-gathered weights and
compute, fp32 sharded parameters, gradients and moments, 4 + 4 + 8 bytes per sharded parameter, the 16 of optplan's
``bf16`` recipe (2 + 2 + 12) on FSDP2, which is how the runtime probe runs that recipe. With dp 1 there is no FSDP
to carry the mixed precision (finetune.py then loads fp32 weights under autocast: an amp-bf16 run), so ``bf16`` is
measured under FSDP only. finetune.py also sets ``fsdp_mixed_precision`` for ``amp-bf16`` plans with FSDP: such a
run is this file's ``bf16`` run, not its ``amp-bf16`` one (fp32 all-gathers).

How the bytes are counted, and why not with a bare ``MemTracker``:

* transformers' TP parameters, their gradients and AdamW's moments are DTensors: wrapper subclasses whose own
  ``untyped_storage()`` is sized to the GLOBAL tensor, holding the rank's shard in ``_local_tensor``. A bare
  ``optplan.probes.memtrack.MemTracker`` counts a DTensor at its global size and the same shard again when its
  local tensor shows up in an op (measured: 149 MB for a 53 MB step). The tracker here is the runtime probe's
  (``probes.probe_tracker.ProbeTracker``: a DTensor counted once, by its local tensor's storage) that, in
  addition, returns ``NotImplemented`` for every op with a DTensor argument, so that DTensor's own dispatch runs
  the op on the local tensors under the tracker: it also sees the temporaries DTensor makes inside an op
  (redistributions, masks), not only their outputs (checked on a matmul whose sharding makes DTensor re-shard an
  input: +0.5 MB seen, missed without it). It skips FakeTensors: the first time DTensor meets an op it runs it on
  fake tensors to propagate shapes (``_propagate_tensor_meta_non_cached``), which ProbeTracker counts as real
  bytes (+4 MB, once, in the first tracked step). Storages FSDP2 frees and refills with ``UntypedStorage.resize_``
  are followed with ``MemTracker.watch_resizes``.
* On a CPU, ``from_pretrained`` leaves every dim-0 shard (column-parallel weights, the vocabulary-parallel
  embedding, the head) a view into the memory-mapped safetensors file whose storage is the whole tensor
  (``sharding_utils.shard_tensor``: ``source[slices].to(device)`` copies nothing on the same device); the rank
  writes, and so holds privately, only its shard. On a GPU ``.to("cuda")`` copies the shard alone. The child gives
  each such shard a storage of its own (``set_`` to a contiguous clone) before the optimizer is built, so that the
  CPU bytes are a GPU rank's (without it: +8 MB of "parameters" here).

``--detail`` also prints, per case, the measured peak of each phase (forward with the loss, backward, optimizer
step) by category, optplan's categories, and a PROTOTYPE (:func:`prototype`, not optplan's figure) that prices the
mechanisms this benchmark found: the rank-local profile (:data:`RANK_LOCAL_FILE`), the whole embedding gradient
without FSDP and FSDP2's tail unit held twice through forward (benchmarks/results/fidelity_tp_cpu.txt).

Run: ``python benchmarks/fidelity_tp_cpu.py [--quick] [--detail]`` (full: 20 runs in 5 torchrun launches, about
2 min on 2 cores; --quick: a smaller model, 8 runs in 4 launches, about 65 s; --detail profiles the rank-local
model too, +10 s). One line per case; the last line is ``tp cpu: max error X% over N runs``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIB = 2**20
CAPACITY = 2**50
TP = 2
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 688, "num_attention_heads": 8, "num_hidden_layers": 4, "num_key_value_heads": 4,
         "vocab_size": 4096, "max_position_embeddings": 512, "tie_word_embeddings": False}
LLAMA_QUICK = {**LLAMA, "hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 2048}
SEQ, SEQ_QUICK = 128, 64
TRACKED_STEPS = 3
"""Tracked steps per case after the warm-up; a rank's figure is the smallest of their peaks (module docstring:
gloo's worker thread sometimes still holds a collective's input when the peak comes)."""
TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Launch:
    """One torchrun launch: a mesh and a precision, measured over several (checkpointing, micro-batch) cases."""

    dp: int
    precision: str
    cases: tuple[tuple[str, int], ...]

    @property
    def nproc(self) -> int:
        return TP * self.dp

    @property
    def fsdp_mixed_precision(self) -> bool:
        return self.precision == "bf16"


def launches(quick: bool) -> list[Launch]:
    """The matrix: tp2 (fp32, amp-bf16) and tp2 x dp2 FSDP2 (fp32, amp-bf16, bf16), checkpointing none and full,
    micro-batches 1 and 2 (--quick: micro-batch 1, and no amp-bf16 under FSDP)."""
    sub = tuple((c, m) for c in ("none", "full") for m in ((1,) if quick else (1, 2)))
    meshes = [(1, "fp32"), (1, "amp-bf16"), (2, "fp32"), (2, "bf16")]
    if not quick:
        meshes.insert(3, (2, "amp-bf16"))
    return [Launch(dp, p, sub) for dp, p in meshes]


def strategy_for(launch: Launch, checkpointing: str, mbs: int) -> Any:
    from optplan.estimators.strategy import Strategy

    return Strategy(engine="torch", tp=TP, dp=launch.dp, fsdp="full" if launch.dp > 1 else "none", mbs=mbs,
                    precision=launch.precision, checkpointing=checkpointing)  # type: ignore[arg-type]


def predict(profile: Any, launch: Launch, checkpointing: str, mbs: int) -> tuple[int, dict[str, int]]:
    """optplan's CPU bytes for the case (total - overhead) and its categories and named items (bytes)."""
    from optplan.estimators.memory import memory_breakdown

    m = memory_breakdown(profile, strategy_for(launch, checkpointing, mbs), CAPACITY,
                         gpus_per_node=launch.nproc, device="cpu")
    parts = {"params": m.params_bytes, "grads": m.grads_bytes, "optimizer": m.optimizer_bytes,
             "activations": m.activations_bytes}
    parts.update({k: v for k, v in m.detail_bytes.items() if k not in ("cuda_context", "fragmentation_margin")})
    return m.total_bytes - m.overhead_bytes, parts


# ---------------------------------------------------------------------------------------------------
# prototype (--detail): what memory.py would predict with the mechanisms this benchmark found; not optplan's figure
# ---------------------------------------------------------------------------------------------------
RANK_LOCAL_FILE = '''"""One tensor-parallel rank of {name} (fidelity_tp_cpu.py's prototype): the blocks' split projections
narrowed to 1/{tp} (heads, key-value heads and MLP width over {tp}; head_dim kept), norms, residuals and the embedding
whole, and the output head's 1/{tp} slice whose logits are gathered as DTensor does."""

import json

import torch
import transformers

OPTPLAN = {{"name": "rank_local", "seq_len": {seq}}}
CONFIG = json.loads({config!r})


class GatheredHead(torch.nn.Module):
    """This rank's vocabulary slice of the head; its output all-gathered along dim 0 and re-concatenated along the
    vocabulary (``funcol.all_gather_single`` + ``_chunk_or_narrow_cat``), as Replicate() output layouts do."""

    def __init__(self, hidden, vocab, tp):
        super().__init__()
        self.local = torch.nn.Linear(hidden, vocab // tp, bias=False)
        self.tp = tp

    def forward(self, x):
        local = self.local(x)  # alive until the gather returns, as the DTensor it came from
        gathered = torch.cat([local] * self.tp, dim=0)
        return torch.cat(torch.chunk(gathered, self.tp, dim=0), dim=-1)


def build_model():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, use_cache=False))
    model.lm_head = GatheredHead(CONFIG["hidden_size"], CONFIG["vocab_size"], {tp})
    return model


def example_batch(batch_size, seq_len):
    ids = torch.randint(0, CONFIG["vocab_size"], (batch_size, seq_len))
    return {{"input_ids": ids, "labels": ids}}


def loss_fn(output, batch):
    return output.loss
'''


def rank_local_profile(folder: Path, config: dict[str, Any], seq: int) -> Any:
    """The fake-tensor profile of what one TP rank runs (:data:`RANK_LOCAL_FILE`): its activation fits are the TP
    rank's, measured, with their moments, instead of a formula's split of the whole model's."""
    from optplan.probes.loader import profile_model_file

    local = {**config, "num_attention_heads": config["num_attention_heads"] // TP,
             "num_key_value_heads": config["num_key_value_heads"] // TP,
             "intermediate_size": config["intermediate_size"] // TP,
             "head_dim": config["hidden_size"] // config["num_attention_heads"]}
    path = folder / "rank_local.py"
    path.write_text(RANK_LOCAL_FILE.format(name=config["architectures"][0], tp=TP, seq=seq,
                                           config=json.dumps(local)), encoding="utf-8")
    return profile_model_file(path, seq_len=seq)


def prototype(profile: Any, local: Any, launch: Launch, checkpointing: str, mbs: int) -> tuple[int, dict[str, int]]:
    """Bytes of the case with the mechanisms found here (bytes, and the peak's parts):

    * model states as memory.py has them (the tp_plan's shards, ZeRO-3 over dp);
    * without FSDP, the vocabulary-parallel embedding's gradient whole on every rank (DTensor's embedding backward
      gives a Replicate() gradient, kept as ``.grad``): + V*h*(1 - 1/tp) * gradient bytes;
    * the activations of each moment from the rank-local profile (measured, gathered logits included), the
      largest moment winning, not a formula's split summed with every buffer;
    * with FSDP2 by transformers' fsdp plan (embedding, each block, then the final norm with the head kept unsharded
      from forward to backward, ``reshard_after_forward=False``): through forward's end the tail unit unsharded
      AND its all-gather output, which FSDP2 keeps until the root's post-forward (``FSDPCommContext.
      all_gather_state``); in backward the tail unit unsharded until its post-backward.
    """
    from optplan.estimators.memory import activation_moments, memory_breakdown, optimizer_step_scratch_bytes
    from optplan.estimators.precision import get_recipe
    from optplan.estimators.strategy import Strategy

    strategy = strategy_for(launch, checkpointing, mbs)
    m = memory_breakdown(profile, strategy, CAPACITY, gpus_per_node=launch.nproc, device="cpu")
    states = (m.params_bytes + m.optimizer_bytes + m.detail_bytes.get("adam_step_counters", 0)
              + m.detail_bytes.get("model_buffers", 0))
    recipe = get_recipe(launch.precision)
    shape = profile.transformer
    grads = m.grads_bytes
    plan = profile.tensor_plan
    if launch.dp == 1 and not (plan is not None and plan.replicated_grad_params):
        # optplan counts it itself since estimators/tensor_plan.replicated_grad_bytes_per_rank
        grads += round(shape.vocab * shape.hidden * (1 - 1 / TP) * recipe.grad_bytes)
    one_rank = Strategy(engine="torch", precision=launch.precision, checkpointing=checkpointing, mbs=mbs)  # type: ignore[arg-type]
    acts = activation_moments(local, one_rank)
    tail = 0
    if launch.dp > 1:
        gathered_bytes = 2 if launch.fsdp_mixed_precision else recipe.weight_bytes
        tail = (shape.vocab // TP * shape.hidden + shape.hidden) * gathered_bytes
    moments = {name: b + (2 * tail if name in ("forward", "loss") else tail) for name, b in acts.items()}
    moments["optimizer_step"] = optimizer_step_scratch_bytes(profile, strategy, device="cpu")
    worst = max(moments, key=lambda k: moments[k])
    return states + grads + moments[worst], {"states": states, "grads": grads, worst: moments[worst]}


@dataclass
class Row:
    dp: int
    precision: str
    checkpointing: str
    mbs: int
    predicted: int
    measured: int
    predicted_parts: dict[str, int] = field(default_factory=dict)
    measured_phases: dict[str, Any] = field(default_factory=dict)
    measured_max: int = 0
    measured_states: int = 0
    prototype: int | None = None
    prototype_parts: dict[str, int] = field(default_factory=dict)

    @property
    def prototype_error_pct(self) -> float | None:
        return None if self.prototype is None else 100.0 * (self.prototype - self.measured) / self.measured

    @property
    def name(self) -> str:
        mesh = f"tp{TP}" + (f"xfsdp{self.dp}" if self.dp > 1 else "")
        return f"{mesh:<10}{self.precision:<10}{'ckpt-' + self.checkpointing:<11}mbs {self.mbs}"

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted - self.measured) / self.measured


# ---------------------------------------------------------------------------------------------------
# parent: model, profile, launches
# ---------------------------------------------------------------------------------------------------
def save_model(folder: Path, config: dict[str, Any]) -> Path:
    """A LlamaForCausalLM of ``config`` with random weights (seed 0), saved to ``folder``; returns the model file
    ``optplan --hf`` generates for it."""
    import torch
    import transformers

    from optplan.planner.hf_source import find_hf_config, write_hf_model_file

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model.save_pretrained(folder)
    del model
    return write_hf_model_file(find_hf_config(str(folder)), folder)


def run_launch(launch: Launch, folder: Path, seq: int, out: Path) -> dict[str, Any]:
    """The child's result for ``launch`` (max over ranks per case); RuntimeError with the tail of its output."""
    spec = {"folder": str(folder), "dp": launch.dp, "precision": launch.precision, "seq": seq,
            "fsdp_mixed_precision": launch.fsdp_mixed_precision, "cases": launch.cases, "out": str(out)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={launch.nproc}",
           str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0 or not out.exists():
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise RuntimeError(f"torchrun tp{TP} dp{launch.dp} {launch.precision} exited {proc.returncode}: {tail}")
    return json.loads(out.read_text(encoding="utf-8"))


def run(quick: bool, log: Any = print, detail: bool = False) -> list[Row]:
    """Profile once, run every launch; one Row per case (logged as it comes)."""
    from optplan.probes.loader import profile_model_file

    config, seq = (LLAMA_QUICK, SEQ_QUICK) if quick else (LLAMA, SEQ)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="optplan_tp_") as tmp:
        folder = Path(tmp) / "model"
        path = save_model(folder, config)
        profile = profile_model_file(path, seq_len=seq)
        plan = profile.tensor_plan
        if plan is None:
            raise RuntimeError(f"the profile of {path} has no tensor_plan")
        log(f"model: {profile.model_class} {profile.params:,} parameters ({plan.sharded_params:,} split by its "
            f"tp_plan, gathers logits: {plan.gathers_logits}), seq {seq}")
        local = rank_local_profile(Path(tmp), config, seq) if detail else None
        log(f"{'case':<42} | {'predicted':>10}{'measured':>10}{'err':>9}   (MiB)")
        for i, launch in enumerate(launches(quick)):
            t0 = time.perf_counter()
            result = run_launch(launch, folder, seq, Path(tmp) / f"result{i}.json")
            wall = time.perf_counter() - t0
            for ckpt, mbs in launch.cases:
                got = result[f"{ckpt}/{mbs}"]
                predicted, parts = predict(profile, launch, ckpt, mbs)
                row = Row(launch.dp, launch.precision, ckpt, mbs, predicted, int(got["peak"]), parts, got["phases"],
                          int(got["max_over_steps"]), int(got["baseline"]))
                if local is not None:
                    row.prototype, row.prototype_parts = prototype(profile, local, launch, ckpt, mbs)
                rows.append(row)
                log(f"{row.name:<42} | {row.predicted / MIB:>10.2f}{row.measured / MIB:>10.2f}"
                    f"{row.error_pct:>+8.2f}%")
                if detail:
                    log(describe(row))
            log(f"{'':<42}   ({wall:.0f} s, {launch.nproc} ranks)")
    return rows


def describe(row: Row) -> str:
    """The measured peak of each phase by category and the predicted parts (MiB), for --detail."""
    def mib(d: dict[str, int]) -> str:
        return ", ".join(f"{k} {v / MIB:.2f}" for k, v in d.items() if abs(v) >= 0.005 * MIB)

    lines = [f"    predicted: {mib(row.predicted_parts)}",
             f"    prototype (not optplan's): {(row.prototype or 0) / MIB:.2f} ({row.prototype_error_pct or 0:+.2f}%): "
             f"{mib(row.prototype_parts)}",
             f"    measured: alive before the step {row.measured_states / MIB:.2f}, the largest of the tracked steps' "
             f"peaks {row.measured_max / MIB:.2f}"]
    for phase, got in row.measured_phases.items():
        lines.append(f"    measured {phase:<9} {got['peak'] / MIB:8.2f}: {mib(got['by_category'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(json.loads(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, 8 runs (about 1 min)")
    parser.add_argument("--detail", action="store_true", help="per-phase measured and predicted categories")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    rows = run(args.quick, detail=args.detail)
    worst = max(abs(r.error_pct) for r in rows)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.detail:
        proto = max(abs(r.prototype_error_pct or 0.0) for r in rows)
        print(f"prototype (rank-local profile, embedding gradient, FSDP tail unit; not optplan's): max error "
              f"{proto:.2f}%")
    print(f"tp cpu: max error {worst:.2f}% over {len(rows)} runs")
    return 0


# ---------------------------------------------------------------------------------------------------
# child: one rank under torchrun
# ---------------------------------------------------------------------------------------------------
PHASES = ("forward", "backward", "step")


def _tracker_class() -> Any:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    from optplan.probes.probe_tracker import ProbeTracker

    class DTensorTracker(ProbeTracker):
        """ProbeTracker (DTensors counted by their local storage) that lets DTensor run each op on the local
        tensors under it (module docstring), and keeps each phase's peak with its categories."""

        def __init__(self) -> None:
            super().__init__()
            self.phase_peaks: dict[str, tuple[int, dict[str, int]]] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _note_phase_peak(self) -> None:
            if self.live_bytes > self.phase_peaks.get(self.phase, (-1, {}))[0]:
                self.phase_peaks[self.phase] = (self.live_bytes, dict(self.live_by_category))

        def _add(self, t: Any, category: str = "activation") -> None:
            if isinstance(t, FakeTensor) or isinstance(getattr(t, "_local_tensor", None), FakeTensor):
                return  # DTensor's sharding propagation runs an op on fake tensors the first time it sees it
            super()._add(t, category)
            self._note_phase_peak()

        def note_resize(self, storage: Any) -> None:
            super().note_resize(storage)
            self._note_phase_peak()

    return DTensorTracker


def _own_shards(model: Any) -> int:
    """Give every parameter whose storage is larger than itself (a shard viewing the memory-mapped checkpoint) a
    storage of its own; returns how many (module docstring)."""
    import torch

    from optplan.probes.probe_tracker import local_tensor as _local

    owned = 0
    with torch.no_grad():
        for p in model.parameters():
            local = _local(p)
            if local.untyped_storage().nbytes() > local.numel() * local.element_size():
                local.set_(local.clone(memory_format=torch.contiguous_format))
                owned += 1
    return owned


def child(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from optplan.probes.probe_tracker import live_python_tensors as _live_python_tensors

    config = DistributedConfig(tp_size=TP, fsdp_size=spec["dp"], fsdp_mixed_precision=spec["fsdp_mixed_precision"])
    model = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.float32, distributed_config=config)
    model.config.use_cache = False  # as the --hf model file that was profiled (planner/hf_source.py)
    model.train()
    owned = _own_shards(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)  # torch's default implementation (single-tensor on CPU)
    autocast = spec["precision"] in ("amp-bf16", "bf16")
    tracker_cls = _tracker_class()
    vocab = model.config.vocab_size
    state: dict[str, Any] = {"tracker": None}

    def phase(name: str) -> None:
        if state["tracker"] is not None:
            state["tracker"].phase = name

    def step(batch: dict[str, torch.Tensor]) -> None:
        phase("forward")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        phase("backward")
        loss.backward()
        del loss
        phase("step")
        opt.step()
        opt.zero_grad(set_to_none=False)

    results: dict[str, Any] = {}
    for ckpt, mbs in spec["cases"]:
        if ckpt == "full":
            model.gradient_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        gen = torch.Generator().manual_seed(1234)  # the same tokens on every rank (TP ranks share the batch)
        ids = torch.randint(0, vocab, (mbs, spec["seq"]), generator=gen)
        batch = {"input_ids": ids, "labels": ids}
        step(batch)  # warm-up: AdamW's states, FSDP2's lazy init
        steps: list[dict[str, Any]] = []
        for _ in range(TRACKED_STEPS):
            tracker = tracker_cls()
            params = list(model.parameters())
            tracker.track(params, category="param")
            tracker.track([p.grad for p in params], category="grad")
            tracker.track([v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)],
                          category="optimizer")
            tracker.track(list(model.buffers()), category="buffer")
            tracker.track([ids], category="input")
            rest = _live_python_tensors("cpu")
            tracker.track([t for t in rest if isinstance(t, torch.nn.Parameter)], category="unsharded_param")
            tracker.track(rest, category="other")
            del rest
            state["tracker"] = tracker
            with tracker, tracker.watch_resizes():
                step(batch)
            state["tracker"] = None
            steps.append({"peak": int(tracker.peak_bytes), "baseline": int(tracker.baseline_bytes),
                          "phases": {name: {"peak": int(b), "by_category": {k: int(v) for k, v in cats.items() if v}}
                                     for name, (b, cats) in sorted(tracker.phase_peaks.items(),
                                                                   key=lambda kv: PHASES.index(kv[0]))}})
        best = min(steps, key=lambda r: r["peak"])
        best["max_over_steps"] = max(r["peak"] for r in steps)
        results[f"{ckpt}/{mbs}"] = best
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"results": results, "owned": owned})
    if dist.get_rank() == 0:
        merged: dict[str, Any] = {}
        for key in results:
            merged[key] = max((g["results"][key] for g in gathered), key=lambda r: r["peak"])
            merged[key]["max_over_steps"] = max(g["results"][key]["max_over_steps"] for g in gathered)
        merged["owned_shards"] = [g["owned"] for g in gathered]
        tmp = Path(spec["out"] + ".tmp")
        tmp.write_text(json.dumps(merged), encoding="utf-8")
        tmp.rename(spec["out"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
