"""Static profile of a model: parameters, structure, FLOPs and activation memory, without real weights.

Runs in the profiler child process. The model is built on the meta device; parameters and structure
are read from that full model. FLOPs and activations come from real forward + loss + backward steps
on fake CPU tensors (``FakeTensorMode``: shapes and dtypes only, no memory): the meta model is
materialised inside the fake mode with ``to_empty(device="cpu")`` and its tied weights re-tied.

Definitions the estimators rely on:

* FLOPs per sample: ``FlopCounterMode`` counts of forward + loss (``fwd``) and backward (``bwd``) at
  micro-batch 1 (2 when a model cannot run one sample), fp32, no checkpointing. Attention is counted
  with the math SDPA kernel (the fused CPU kernel is invisible to the counter). Of ``bwd``, what module forwards
  re-ran during it is the model's own checkpointing (``self_recompute``: probes/self_recompute.py).
* Activation bytes: the peak of live tensor bytes (``MemTracker``) during forward + loss + backward,
  minus the live bytes before the step, with the model's parameters and gradients already allocated
  (one warm-up step, then ``zero_grad(set_to_none=False)``). It includes the input batch, saved
  activations, temporaries and the gradients' transient copies before accumulation; under bf16
  autocast it also includes autocast's bf16 copies of the weights. The default SDPA kernel is used
  (no s x s attention matrix is stored). Measured for fp32 and bf16 autocast, with no checkpointing
  and with every repeated block checkpointed (``torch.utils.checkpoint``, non-reentrant); then, last, with
  the model cast to bf16 (``bf16-weights``: parameters, gradients and buffers in bf16, floating inputs cast,
  no autocast), what recipes with 16-bit weights run: there every gradient temporary (a tied embedding's
  two gradients and their sum) and the loss's own tensors are 16-bit, where autocast keeps them fp32 (2x
  the bytes: the CPU run of the generated train.py, benchmarks/fidelity_train.py, measured 12 MiB less than
  the autocast fit without its weight copies on a 3.7M-parameter GPT-2 with an 8192-token vocabulary). A
  model that does not run in bf16 has no such fit (a note says so).
* Micro-batch: the tracker records the live bytes after every allocation of the step, at micro-batch
  1 and 2 (2 and 4 for a model that cannot run one sample). Both runs execute the same operators, so
  their timelines line up allocation by allocation, and each allocation's live bytes are a line
  ``a + c * b`` through its two values (tensor sizes are linear in the batch). The peak at any ``b`` is
  the largest of those lines: the profile keeps their upper envelope (``ActivationFit.lines``; the
  steepest line is ``fixed_bytes + per_sample_bytes * b``). One line through the two peaks would not
  do: with a vocabulary, the peak at small ``b`` is the embedding's backward (vocab x hidden buffers
  that do not grow with ``b``) and at larger ``b`` the start of backward, which grows faster. The same
  is kept without autocast's copies of the weights (``lines_without_copies``, what a model holding
  bf16 weights needs); ``param_copy_bytes`` is the difference at micro-batch 1. One sample is often a
  step of its own: a tensor with a size-1 dimension is contiguous whatever that dimension's stride, so a
  transpose made contiguous (``nn.MultiheadAttention(batch_first=True)``) or a shifted loss's
  ``logits[:, :-1].reshape(...)`` is a view at 1 and a copy from 2 on. A phase whose timelines at 1 and 2
  do not line up is measured again at 3 and, where 2 and 3 line up, fitted through them (exact from 2 on,
  the copies counted at 1 too; :meth:`StepEnvelope.refitted`); one that lines up at neither pair is one
  line through its two peaks (a note names the phases either way).
* Depth reduction: when the repeated blocks are the only children of one ``nn.ModuleList`` /
  ``nn.Sequential`` of length L >= 3 and all have the same parameter count, FLOPs and activations are
  measured with the container cut to 1 and 2 blocks and extrapolated linearly:
  ``value(L) = value(1) + (value(2) - value(1)) * (L - 1)``. When only a leading run of ``head`` blocks differs
  (an MoE model's dense first layers, DeepSeek's ``first_k_dense_replace``) and at least 3 equal blocks follow,
  the cuts keep ``head + 1`` and ``head + 2`` blocks and the line runs from there. The activation envelope is extrapolated
  per phase of the step (:data:`PHASES`: before the first block, the model's forward, the loss's
  forward, the loss's backward, the model's backward until the first parameter gradient, on to the first
  block's input gradient, the rest of backward): each line of the 2-block envelope of a phase
  gets L - 2 times the phase's growth per block (its 2-block minus its 1-block peak, a line over
  ``b``). Within one phase the points that can be the peak grow alike with depth, while the phases
  grow at different rates (the embedding's backward not at all, the start of backward by a block's
  saved activations, the loss's forward also by autocast's cached weight copies, which its backward no
  longer holds). The same phases, grouped into the moments of ``STEP_PHASES``, give
  ``ActivationFit.phase_lines``: the estimators add each engine buffer only at the moments it is alive
  (FSDP's gathered units while the model runs, DeepSpeed's gradient partitions from the first parameter
  gradient on). When the first block's input does not require grad (blocks first, no embedding
  or stem before them, or a LoRA model's frozen embedding) the first block skips its input gradient and depth 1
  is off the line, so 2 and 3 blocks are measured instead; one warm-up step of the 1-block cut tells which
  before any depth is measured in full (depth 1 is then never measured: a third of such a profile). If the cut
  model fails to run, the full depth is profiled instead (with a note).

Sequence length used for ``example_batch(batch_size, seq_len)`` (or the inferred token batch):
the ``seq_len`` argument, else ``OPTPLAN["seq_len"]``, else the model's maximum position length when
readable (``block_size``, ``max_position_embeddings``, ``max_seq_len``... on ``model.config`` or the
model), else 1024. The profile's ``seq_len`` is the batch's token count for token models, and the
explicitly known value (argument, OPTPLAN or model maximum) or None for other models.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from optplan.estimators.own_checkpointing import own_checkpointing_note
from optplan.estimators.profile import ModelProfile
from optplan.probes.activation_measure import (
    Measurement,
    deeper_step,
    extrapolate,
    fit_activations,
    measure,
)
from optplan.probes.adapters import LoraRequest, adapter_profile, apply_lora, resolve_targets
from optplan.probes.blocks import (  # noqa: F401 - re-exported: tests and benchmarks import them from here
    CONTAINERS,
    MIN_BLOCKS_FOR_REDUCTION,
    BlockInfo,
    _cut,
    find_repeated_block,
    outermost,
    stack_notes,
    truncated_copy,
)
from optplan.probes.contract import DEFAULT_TOKEN_SEQ_LEN, ModelContract, apply_keeping_ties
from optplan.probes.dropout import gpu_dropout
from optplan.probes.envelope import PHASES
from optplan.probes.loader import ModelFileError
from optplan.probes.model_census import (
    buffer_bytes,
    count_params,
    factored_state_elements,
    small_param_counts,
    sparse_grad_params,
    trainable_numels,
)
from optplan.probes.model_shape import (  # noqa: F401 - re-exported
    GATE_NAMES,
    HIDDEN_NAMES,
    config_sources,
    max_positions,
    read_transformer_shape,
)
from optplan.probes.moe_layers import find_moe_layers
from optplan.probes.moe_profile import balanced_note, moe_shape, with_balanced_moe
from optplan.probes.position_bounds import PositionTracker
from optplan.probes.quant_inputs import bnb_keeps_4bit_inputs_here, quant_input_elements
from optplan.probes.step_runner import (
    BatchSpec,
    FakeTensorLimit,
    StepRunner,
    batch_spec,
    ignores_seq_len,
)
from optplan.probes.tensor_plan import read_tensor_plan

REAL_RUN_MAX_BYTES = 1 << 28
"""Largest model (parameter and buffer bytes: 256 MiB, ~64 M fp32 parameters) profiled by a real CPU run
when fake tensors cannot run its forward: the run takes about ten real steps on the host (a minute at
this size on two cores) and also holds gradients and activations."""



# ---------------------------------------------------------------------------------------------------
# structure (full model, meta device)
# ---------------------------------------------------------------------------------------------------
def _fresh(contract: ModelContract, meta: nn.Module, path: str | None = None, keep: int = 0) -> nn.Module:
    """A meta model to measure: a (cut) deep copy of ``meta``, or a new build when it cannot be copied; its MoE
    layers run the balanced dispatch (probes/moe_dispatch.py)."""
    model = _copy_or_build(contract, meta, path, keep)
    with_balanced_moe(model, contract.display)
    return model


def _copy_or_build(contract: ModelContract, meta: nn.Module, path: str | None, keep: int) -> nn.Module:
    try:
        return truncated_copy(meta, path, keep) if path is not None else copy.deepcopy(meta)
    except Exception:  # noqa: BLE001 - e.g. attributes that cannot be deep-copied: build again
        model = contract.build_meta()
        if path is None:
            return model
        if not path:
            return _cut(model, keep)
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        parent._modules[attr] = _cut(model.get_submodule(path), keep)
        return model


def materialize_fake(model: nn.Module) -> nn.Module:
    """Inside an active FakeTensorMode: move a meta model to fake CPU tensors, keeping tied weights."""
    return apply_keeping_ties(model, lambda m: m.to_empty(device="cpu"))


def blocks_of(model: nn.Module, cls: type | None) -> list[nn.Module]:
    """The outermost instances of the repeated block class, wherever they are held: what train.py checkpoints and
    wraps (trainloop.find_blocks), so the profile measures the same blocks. A container class as the block (a
    stage's ``nn.Sequential`` units) is taken where containers hold it: its outermost instances are the stages."""
    if cls is None:
        return []
    if not issubclass(cls, CONTAINERS):
        return outermost(model, cls)
    out: dict[int, nn.Module] = {}
    for mod in model.modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            for child in mod.children():
                if type(child) is cls:
                    out.setdefault(id(child), child)
    return list(out.values())


def _fake_runner(meta_model: nn.Module, spec: BatchSpec, contract: ModelContract,
                 block_cls: type | None) -> StepRunner:
    """A step runner of ``meta_model`` materialised on fake CPU tensors (call it inside a ``FakeTensorMode``)."""
    model = materialize_fake(meta_model)
    return StepRunner(model=model, spec=spec, loss_fn=contract.loss_fn, display=contract.display,
                      blocks=blocks_of(model, block_cls))


def measure_fake(meta_model: nn.Module, spec: BatchSpec, contract: ModelContract, block_cls: type | None,
                 batch_sizes: tuple[int, int]) -> Measurement:
    """Materialise a meta model on fake CPU tensors and :func:`measure` it."""
    tracker = PositionTracker()  # fake tensors index past an embedding table silently; a real run would not
    with FakeTensorMode(allow_non_fake_inputs=True):
        runner = _fake_runner(meta_model, spec, contract, block_cls)
        try:
            with tracker:
                result = measure(runner, batch_sizes)
        except ModelFileError:
            if not tracker.overruns:
                raise
            result = None  # the overrun came first and is the cause (e.g. a causal-mask buffer sized like it)
    if tracker.overruns or result is None:
        top, rows = max(tracker.overruns)
        raise ModelFileError(contract.display,
                             f"the forward looks up position {top} in an embedding table of {rows} rows: the model "
                             f"takes at most {rows} positions, and the batch ({spec.describe(batch_sizes[0])}) has more",
                             f"use --seq-len {rows} or less (or OPTPLAN['seq_len']), or build the model with a longer "
                             "position table")
    return result



# ---------------------------------------------------------------------------------------------------
# the profile
# ---------------------------------------------------------------------------------------------------
def resolve_seq_len(contract: ModelContract, model: nn.Module, seq_len: int | None) -> tuple[int | None, str]:
    """(explicit sequence length or None, where it came from)."""
    if seq_len is not None:
        return int(seq_len), "the seq_len argument"
    if contract.defaults.seq_len is not None:
        return contract.defaults.seq_len, 'OPTPLAN["seq_len"]'
    limit = max_positions(model)
    if limit is not None:
        return limit, "the model's maximum position length"
    return None, "default"


def _at_batch_one_or_two(run: Callable[[tuple[int, int]], Measurement],
                         notes: list[str]) -> tuple[Measurement, tuple[int, int]]:
    """``run`` at batch sizes (1, 2); a model that cannot run one sample is measured at (2, 4)."""
    try:
        return run((1, 2)), (1, 2)
    except ModelFileError as first:
        if "forward raised" not in first.problem:
            raise
        try:
            result = run((2, 4))
        except ModelFileError:
            raise first from None
        notes.append(f"the model cannot run a single sample ({first.problem}); profiled at batch 2 and 4")
        return result, (2, 4)


def _measure_with_fallback(contract: ModelContract, make_model: Callable[[], nn.Module], spec: BatchSpec,
                           block_cls: type | None, notes: list[str]) -> tuple[Measurement, tuple[int, int]]:
    """:func:`measure_fake` of a fresh ``make_model()`` at batch sizes (1, 2), else (2, 4)."""
    return _at_batch_one_or_two(lambda sizes: measure_fake(make_model(), spec, contract, block_cls, sizes), notes)


def first_block_input_grad(meta_model: nn.Module, spec: BatchSpec, contract: ModelContract, block_cls: type | None,
                           batch_size: int) -> bool | None:
    """Whether the first repeated block's tensor inputs require grad, from one warm-up step of ``meta_model`` on fake
    CPU tensors at ``batch_size`` (:meth:`StepRunner.warm_up`); None when that step fails (the full measurement then
    meets the failure and reports it as it does)."""
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            runner = _fake_runner(meta_model, spec, contract, block_cls)
            with PositionTracker() as tracker:
                grad = runner.warm_up(batch_size)
    except Exception:  # noqa: BLE001 - a shortcut only: any failure is the measurement's to report
        return None
    return None if tracker.overruns else grad


def _measure_reduced(contract: ModelContract, meta: nn.Module, block: BlockInfo, spec: BatchSpec,
                     notes: list[str]) -> tuple[Measurement, tuple[int, int], int | None]:
    """Measure with the block container cut to 1 and 2 blocks and extrapolate to its length.

    When the first block's input does not require grad (the blocks come first, no embedding or stem
    before them, or a frozen embedding as under LoRA), the first block skips its input gradient, so depth 1 is not on
    the line: then 2 and 3 blocks are measured instead (just 3 when the model has 3). One warm-up step of the cut to 1
    block (:func:`first_block_input_grad`) tells which, before any of the ~40 measured steps of a depth is run.
    Returns (measurement, batch sizes, blocks profiled or None for full).
    """
    layers = len(block.blocks)
    path = block.path
    assert path is not None
    cls = block.cls
    head = block.head  # leading blocks of another size (dense layers before the MoE ones) are kept in both cuts
    if head == 0 and first_block_input_grad(_fresh(contract, meta, path, 1), spec, contract, cls, 1) is False:
        if layers == 3:
            m3, sizes = _measure_with_fallback(contract, lambda: _fresh(contract, meta, path, 3), spec, cls, notes)
            return m3, sizes, None
        m2, sizes = _measure_with_fallback(contract, lambda: _fresh(contract, meta, path, 2), spec, cls, notes)
        lo, hi, base = m2, measure_fake(_fresh(contract, meta, path, 3), spec, contract, cls, sizes), 2
    else:
        m1, sizes = _measure_with_fallback(contract, lambda: _fresh(contract, meta, path, head + 1), spec, cls, notes)
        m2 = measure_fake(_fresh(contract, meta, path, head + 2), spec, contract, cls, sizes)
        lo, hi, base = m1, m2, head + 1
        if m1.first_block_input_grad is False and head == 0:  # the warm-up step could not tell: the measurement did
            m3 = measure_fake(_fresh(contract, meta, path, 3), spec, contract, cls, sizes)
            if layers == 3:
                return m3, sizes, None
            lo, hi, base = m2, m3, 2
    extra = layers - (base + 1)
    envelopes = {k: hi.envelopes[k].deeper(lo.envelopes[k], extra) for k in hi.envelopes if k in lo.envelopes}
    measurement = Measurement(
        fwd_flops=round(extrapolate(lo.fwd_flops, hi.fwd_flops, layers, base)),
        bwd_flops=round(extrapolate(lo.bwd_flops, hi.bwd_flops, layers, base)),
        envelopes=envelopes, batch_info=lo.batch_info, loss_note=lo.loss_note,
        weights_16bit_note=lo.weights_16bit_note or hi.weights_16bit_note,
        selective_recompute_flops=(None if lo.selective_recompute_flops is None or hi.selective_recompute_flops is None
                                   else round(extrapolate(lo.selective_recompute_flops, hi.selective_recompute_flops,
                                                          layers, base))),
        self_recompute_flops=max(0, round(extrapolate(lo.self_recompute_flops, hi.self_recompute_flops, layers, base))),
        eager_block_bytes=hi.eager_block_bytes,  # a mean over the blocks that ran: depth does not change it
        eager_block_ops=hi.eager_block_ops,
        attention_key_heads=hi.attention_key_heads or lo.attention_key_heads,
        eager_step={k: deeper_step(lo.eager_step[k], step, layers, base)
                    for k, step in hi.eager_step.items() if k in lo.eager_step})
    notes.append(f"profiled {base + 1} of {layers} blocks and scaled by layers")
    return measurement, sizes, base + 1


def measure_real(contract: ModelContract, meta: nn.Module, spec: BatchSpec, block_cls: type | None,
                 limit: FakeTensorLimit, notes: list[str]) -> tuple[Measurement, tuple[int, int]]:
    """The fallback when fake tensors cannot run forward: build the whole model on the CPU with real
    weights and :func:`measure` real steps (same trackers, FLOP counter and fit as the fake profile), if
    its parameters and buffers take at most ``REAL_RUN_MAX_BYTES``; else ``limit`` is raised, saying why
    there is no fallback. A module-level instance cannot be rebuilt with real weights (optplan moved it to
    the meta device), so it has no fallback either."""
    state_bytes = sum(p.numel() * p.element_size() for p in meta.parameters()) + buffer_bytes(meta)
    if contract.source.startswith("instance "):
        raise FakeTensorLimit(contract.display, limit.problem,
                              f"{limit.fix}; or define build_model() so that optplan can profile it by a real "
                              "CPU run") from None
    if state_bytes > REAL_RUN_MAX_BYTES:
        raise FakeTensorLimit(contract.display, f"{limit.problem}; a real CPU run instead would hold "
                              f"{state_bytes / 2**30:.1f} GiB of weights, over the {REAL_RUN_MAX_BYTES / 2**30:g} "
                              "GiB optplan allows", limit.fix) from None
    torch.manual_seed(0)
    model = contract.build_real()
    with_balanced_moe(model, contract.display)

    def run(batch_sizes: tuple[int, int]) -> Measurement:
        runner = StepRunner(model=model, spec=spec, loss_fn=contract.loss_fn, display=contract.display,
                            blocks=blocks_of(model, block_cls))
        return measure(runner, batch_sizes)

    measurement, sizes = _at_batch_one_or_two(run, notes)
    notes.append(f"{limit.problem}: profiled by a real CPU run of the whole model at micro-batch {sizes[0]} "
                 f"and {sizes[1]}; memory that depends on the data (e.g. routing) is what these batches produced")
    return measurement, sizes



def profile_contract(contract: ModelContract, *, seq_len: int | None = None,
                     started: float | None = None, lora: LoraRequest | None = None) -> ModelProfile:
    """Profile the model of ``contract`` (see the module docstring); ``started`` is a perf_counter(); ``lora``:
    profile it with LoRA adapters (probes/adapters.py) on every build. Dropout runs as on a GPU (probes/dropout.py)."""
    with gpu_dropout():
        return _profile_contract(contract, seq_len=seq_len, started=started, lora=lora)


def _profile_contract(contract: ModelContract, *, seq_len: int | None, started: float | None,
                      lora: LoraRequest | None) -> ModelProfile:
    t0 = time.perf_counter() if started is None else started
    notes = list(contract.notes)
    meta = contract.build_meta()
    adapter = None
    tensor_plan = read_tensor_plan(meta) if lora is None else None  # LoRA plans run without tensor parallelism
    if lora is not None:
        contract, meta, lora = _with_lora(contract, meta, lora)
        adapter = adapter_profile(meta, lora)
    params, trainable, by_module, dtype = count_params(meta)
    moe_layers = find_moe_layers(meta, config_sources(meta), contract.display)
    block = find_repeated_block(meta)
    if block is not None:
        notes.extend(stack_notes(block))
    shape, moe_notes = moe_shape(meta, read_transformer_shape(meta, block), block.blocks if block else [],
                                 moe_layers, contract.display)
    if moe_layers:
        notes.append(balanced_note(moe_layers, shape))
    notes.extend(moe_notes)
    explicit_seq, seq_source = resolve_seq_len(contract, meta, seq_len)
    limit = max_positions(meta)
    if explicit_seq is not None and limit is not None and explicit_seq > limit:
        raise ModelFileError(contract.display,
                             f"sequence length {explicit_seq} (from {seq_source}) is longer than the model's "
                             f"maximum of {limit} positions",
                             f"use --seq-len {limit} or less, or build the model with a longer context")
    used_seq = explicit_seq if explicit_seq is not None else DEFAULT_TOKEN_SEQ_LEN
    spec, batch_note = batch_spec(contract, meta, used_seq)
    block_cls = block.cls if block else None

    if adapter is not None and block is not None and block.reducible and block.path is not None:
        adapter = adapter.model_copy(update=_quant_inputs(contract, meta, block, spec, notes))
    measurement: Measurement | None = None
    profiled_blocks: int | None = None
    if block is not None and block.reducible and block.path is not None:
        layers = len(block.blocks)
        try:
            measurement, sizes, profiled_blocks = _measure_reduced(contract, meta, block, spec, notes)
        except FakeTensorLimit as exc:
            measurement, sizes = measure_real(contract, meta, spec, block_cls, exc, notes)
        except ModelFileError as exc:
            notes.append(f"could not profile with the block list cut to 1-3 blocks ({exc.problem}); "
                         f"profiled all {layers} blocks")
    if measurement is None:
        try:
            measurement, sizes = _measure_with_fallback(contract, lambda: _fresh(contract, meta), spec, block_cls,
                                                        notes)
        except FakeTensorLimit as exc:
            measurement, sizes = measure_real(contract, meta, spec, block_cls, exc, notes)

    info = measurement.batch_info
    misaligned = sorted({p for env in measurement.envelopes.values() for p in env.misaligned}, key=PHASES.index)
    later = sorted({p for env in measurement.envelopes.values() for p in env.later}, key=PHASES.index)
    if later:
        third = 2 * sizes[1] - sizes[0]
        notes.append(f"micro-batch {sizes[0]} ran other operators than {sizes[1]} and {third} (phases: "
                     f"{', '.join(later)}; e.g. a transpose made contiguous is a copy only with more than one "
                     f"sample): there the activation bytes are fitted through micro-batches {sizes[1]} and {third}, "
                     f"which count those copies at micro-batch {sizes[0]} too")
    if misaligned:
        notes.append(f"the step ran different operators at micro-batch {sizes[0]} and {sizes[1]} (phases: "
                     f"{', '.join(misaligned)}); there the activation bytes are one line through the two peaks")
    if batch_note:
        notes.append(batch_note)
    if measurement.loss_note:
        notes.append(measurement.loss_note)
    if measurement.weights_16bit_note:
        notes.append(measurement.weights_16bit_note)
    if info.input_kind == "tokens":
        profile_seq = info.tokens_per_sample
        if explicit_seq is None:
            notes.append(f"sequence length {used_seq} (default for token models; set OPTPLAN['seq_len'] or "
                         "--seq-len)")
        else:
            notes.append(f"sequence length {explicit_seq} from {seq_source}")
    else:
        profile_seq = explicit_seq
        if explicit_seq is not None and seq_source == "the seq_len argument" and ignores_seq_len(contract,
                                                                                                 explicit_seq):
            raise ModelFileError(contract.display,
                                 f"--seq-len {explicit_seq} changes nothing: the model takes no token sequence and "
                                 "example_batch(batch_size, seq_len) returns inputs of the same shape at any seq_len",
                                 "drop --seq-len (it sets the tokens per sample of language models)")
        if contract.example_batch is not None and explicit_seq is None:
            notes.append(f"example_batch was called with seq_len={used_seq} (no sequence length known; it matters only "
                         "if example_batch uses it: --seq-len or OPTPLAN['seq_len'] sets it)")
    sparse = sparse_grad_params(meta)
    if sparse:
        notes.append(f"{sparse:,} parameters have sparse gradients (an Embedding/EmbeddingBag with sparse=True): "
                     "torch's AdamW refuses them, so plans use SGD (torch.optim.SGD takes them); their gradients "
                     "are priced as dense, an upper bound")
    b0 = sizes[0]
    if measurement.self_recompute_flops > 0 and measurement.fwd_flops > 0:
        notes.append(own_checkpointing_note(measurement.self_recompute_flops / measurement.fwd_flops))
    return ModelProfile(
        name=contract.name,
        path=str(contract.path),
        model_class=type(meta).__name__,
        params=params,
        trainable_params=trainable,
        params_by_module=by_module,
        factored_state_elements=factored_state_elements(meta),
        small_param_counts=small_param_counts(meta),
        sparse_grad_params=sparse,
        buffer_bytes=buffer_bytes(meta),
        param_dtype=dtype,
        repeated_block=block.summary() if block else None,
        input_kind=info.input_kind,  # type: ignore[arg-type]
        seq_len=profile_seq,
        tokens_per_sample=info.tokens_per_sample,
        fwd_flops_per_sample=measurement.fwd_flops / b0,
        bwd_flops_per_sample=measurement.bwd_flops / b0,
        self_recompute_flops_per_sample=measurement.self_recompute_flops / b0,
        attention_key_heads=measurement.attention_key_heads,
        selective_recompute_flops_per_sample=(None if measurement.selective_recompute_flops is None
                                              else measurement.selective_recompute_flops / b0),
        eager_layer_bytes_per_token=(
            {k: (f / info.tokens_per_sample, b / info.tokens_per_sample)
             for k, (f, b) in measurement.eager_block_bytes.items()}
            if info.input_kind == "tokens" and info.tokens_per_sample and measurement.eager_block_bytes else None),
        eager_layer_ops=dict(measurement.eager_block_ops) or None,
        eager_step=dict(measurement.eager_step) or None,
        activations=fit_activations(measurement.envelopes),
        param_numels=trainable_numels(meta),
        transformer=shape,
        profiled_blocks=profiled_blocks,
        defaults=contract.defaults,
        adapter=adapter,
        tensor_plan=tensor_plan,
        notes=tuple(notes),
        torch_version=torch.__version__,
        profile_s=round(time.perf_counter() - t0, 3),
    )


def _quant_inputs(contract: ModelContract, meta: nn.Module, block: BlockInfo, spec: BatchSpec,
                  notes: list[str]) -> dict[str, int | bool]:
    """AdapterProfile fields for a quantised base (probes/quant_inputs.py): the inputs of the quantisable layers of
    a block, measured in one fake forward of the model cut to two blocks, and what the installed bitsandbytes
    keeps of them. An empty dict (a note says why) when the cut model cannot run on fake tensors."""
    assert block.path is not None
    keeps = bnb_keeps_4bit_inputs_here()
    cut = _fresh(contract, meta, block.path, min(2, len(block.blocks)))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = materialize_fake(cut)
        blocks = blocks_of(model, block.cls)
        if not blocks:
            return {}
        runner = StepRunner(model=model, spec=spec, loss_fn=contract.loss_fn, display=contract.display, blocks=blocks)
        model.train()

        def run_step() -> int:
            batch = runner.make_batch(1)
            runner.loss(runner.forward(batch, 1), batch)
            assert runner.batch_info is not None
            return runner.batch_info.tokens_per_sample or 1

        try:
            every, unkept = quant_input_elements(blocks[-1], run_step)
        except (ModelFileError, FakeTensorLimit) as exc:
            notes.append(f"the inputs of the quantisable layers were not measured ({exc.problem}): a quantised base's "
                         "kept inputs are not counted")
            return {}
    return {"quant_input_elements": every, "quant_input_unkept_elements": unkept, "bnb_4bit_keeps_inputs": keeps}


def _with_lora(contract: ModelContract, meta: nn.Module, lora: LoraRequest
               ) -> tuple[ModelContract, nn.Module, LoraRequest]:
    """The contract whose every build carries the LoRA adapters, the adapted meta model, and the request with
    its targets resolved (the default targets come from the repeated blocks of the model as built)."""
    block = find_repeated_block(meta)
    targets = resolve_targets(meta, lora, block.blocks if block else [])
    lora = lora.model_copy(update={"targets": targets})
    build = contract.builder
    display = contract.display

    def builder() -> Any:
        model = build()
        return apply_lora(model, lora, display) if isinstance(model, nn.Module) else model

    return dataclasses.replace(contract, builder=builder), apply_lora(meta, lora, display), lora
