"""Static profile of a model: parameters, structure, FLOPs and activation memory, without real weights.

Runs in the profiler child process. The model is built on the meta device; parameters and structure
are read from that full model. FLOPs and activations come from real forward + loss + backward steps
on fake CPU tensors (``FakeTensorMode``: shapes and dtypes only, no memory): the meta model is
materialised inside the fake mode with ``to_empty(device="cpu")`` and its tied weights re-tied.

Definitions the estimators rely on:

* FLOPs per sample: ``FlopCounterMode`` counts of forward + loss (``fwd``) and backward (``bwd``) at
  micro-batch 1 (2 when a model cannot run one sample), fp32, no checkpointing. Attention is counted
  with the math SDPA kernel (the fused CPU kernel is invisible to the counter).
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
  bf16 weights needs); ``param_copy_bytes`` is the difference at micro-batch 1.
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
  or stem before them) the first block skips its input gradient and depth 1 is off the line, so 2 and
  3 blocks are measured instead. If the cut model fails to run, the full depth is profiled instead
  (with a note).

Sequence length used for ``example_batch(batch_size, seq_len)`` (or the inferred token batch):
the ``seq_len`` argument, else ``OPTPLAN["seq_len"]``, else the model's maximum position length when
readable (``block_size``, ``max_position_embeddings``, ``max_seq_len``... on ``model.config`` or the
model), else 1024. The profile's ``seq_len`` is the batch's token count for token models, and the
explicitly known value (argument, OPTPLAN or model maximum) or None for other models.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode

from optplan.estimators.profile import (
    FROZEN_16BIT,
    SMALL_PARAM_LIMIT,
    WEIGHTS_16BIT,
    ActivationFit,
    ActivationPrecision,
    CheckpointMode,
    ModelProfile,
)
from optplan.probes.adapters import LORA_MARK, LoraRequest, adapter_profile, apply_lora, resolve_targets
from optplan.probes.blocks import (  # noqa: F401 - re-exported: tests and benchmarks import them from here
    MIN_BLOCKS_FOR_REDUCTION,
    BlockInfo,
    _cut,
    find_repeated_block,
    truncated_copy,
)
from optplan.probes.contract import (
    BATCH_FIX,
    DEFAULT_TOKEN_SEQ_LEN,
    ModelContract,
    apply_keeping_ties,
    call_model,
    check_batch_type,
    default_loss,
    exc_text,
    first_param_module,
    first_tensor,
)
from optplan.probes.dropout import gpu_dropout
from optplan.probes.envelope import PHASES, StepEnvelope, Timeline, activation_fit
from optplan.probes.loader import ModelFileError
from optplan.probes.memtrack import MemTracker
from optplan.probes.model_shape import (  # noqa: F401 - re-exported
    GATE_NAMES,
    HIDDEN_NAMES,
    config_sources,
    max_positions,
    read_transformer_shape,
)
from optplan.probes.moe_layers import find_moe_layers
from optplan.probes.moe_profile import balanced_note, moe_shape, with_balanced_moe
from optplan.probes.quant_inputs import bnb_keeps_4bit_inputs_here, quant_input_elements
from optplan.probes.tensor_plan import read_tensor_plan
from optplan.probes.traffic import TrafficCounter, block_attribution
from optplan.probes.trainloop import CudaAutocastLoss, checkpointed_call, selective_context

try:  # torch >= 2.3
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def _math_sdpa() -> contextlib.AbstractContextManager[Any]:
        return sdpa_kernel(SDPBackend.MATH)
except ImportError:  # pragma: no cover - older torch
    def _math_sdpa() -> contextlib.AbstractContextManager[Any]:
        return torch.backends.cuda.sdp_kernel(enable_flash=False, enable_mem_efficient=False, enable_math=True)

try:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
        UnsupportedOperatorException,
    )

    _FAKE_LIMITS: tuple[type[BaseException], ...] = (
        DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
except ImportError:  # pragma: no cover
    from torch._subclasses.fake_tensor import FakeTensorMode

    _FAKE_LIMITS = ()

PRECISIONS: tuple[ActivationPrecision, ...] = ("fp32", "bf16")
"""The precisions measured on the model as built (fp32 weights), with and without autocast."""
PRECISION_ORDER: tuple[ActivationPrecision, ...] = (*PRECISIONS, WEIGHTS_16BIT, FROZEN_16BIT)
"""Every measured precision, in the profile's order; ``bf16-weights`` is measured on the model cast to
bf16 (:func:`measure_16bit_weights`), ``bf16-frozen`` (LoRA profiles) on its frozen weights cast to bf16
(:func:`measure_frozen_16bit`)."""
REAL_RUN_MAX_BYTES = 1 << 28
"""Largest model (parameter and buffer bytes: 256 MiB, ~64 M fp32 parameters) profiled by a real CPU run
when fake tensors cannot run its forward: the run takes about ten real steps on the host (a minute at
this size on two cores) and also holds gradients and activations."""



# ---------------------------------------------------------------------------------------------------
# structure (full model, meta device)
# ---------------------------------------------------------------------------------------------------
def count_params(model: nn.Module) -> tuple[int, int, dict[str, int], str]:
    """(unique params, trainable params, params per top-level child, dominant param dtype)."""
    total = trainable = 0
    by_module: dict[str, int] = OrderedDict((name, 0) for name, _ in model.named_children())
    by_dtype: dict[torch.dtype, int] = {}
    for name, p in model.named_parameters():  # unique: a tied weight once, under its first owner
        n = p.numel()
        total += n
        if p.requires_grad:
            trainable += n
        top = name.split(".", 1)[0]
        by_module[top] = by_module.get(top, 0) + n
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + n
    dtype = max(by_dtype, key=by_dtype.__getitem__) if by_dtype else torch.float32
    return total, trainable, dict(by_module), str(dtype).removeprefix("torch.")


def factored_state_elements(model: nn.Module) -> int:
    """Adafactor second-moment elements of the trainable parameters (Shazeer & Stern 2018, arXiv 1804.04235).

    As ``torch.optim.Adafactor`` allocates them: a parameter with >= 2 dims gets a row factor over its
    last dim and a column factor over its second-to-last, leading dims kept, i.e.
    ``prod(shape[:-2]) * (shape[-2] + shape[-1])`` elements; a 0-D or 1-D parameter gets a full second
    moment (``numel``). Unique parameters (a tied weight once), ``requires_grad`` only. Meta tensors do.
    """
    total = 0
    for p in model.parameters():  # unique: a tied weight once
        if not p.requires_grad:
            continue
        if p.dim() >= 2:
            lead = 1
            for d in p.shape[:-2]:
                lead *= int(d)
            total += lead * (int(p.shape[-2]) + int(p.shape[-1]))
        else:
            total += p.numel()
    return total


def trainable_numels(model: nn.Module) -> tuple[int, ...]:
    """Elements of each trainable parameter tensor in ``model.parameters()`` order (a tied weight once):
    the order in which ``torch.optim`` steps them. Meta tensors do."""
    return tuple(p.numel() for p in model.parameters() if p.requires_grad)


def small_param_counts(model: nn.Module, limit: int = SMALL_PARAM_LIMIT) -> dict[int, int]:
    """Unique parameter tensors of at most ``limit`` elements, as ``numel -> count`` (a tied weight once)."""
    counts: dict[int, int] = {}
    for p in model.parameters():
        n = p.numel()
        if n <= limit:
            counts[n] = counts.get(n, 0) + 1
    return dict(sorted(counts.items()))


def buffer_bytes(model: nn.Module) -> int:
    """Bytes of the model's (unique) buffers."""
    return sum(b.numel() * b.element_size() for b in model.buffers())


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


# ---------------------------------------------------------------------------------------------------
# running steps (real or fake tensors)
# ---------------------------------------------------------------------------------------------------
@dataclass
class BatchSpec:
    """How to make a batch of ``b`` samples, and how to describe it in messages."""

    make: Callable[[int], Any]
    describe: Callable[[int], str]
    inferred: bool
    fix: str


def batch_spec(contract: ModelContract, model: nn.Module, seq_len: int) -> tuple[BatchSpec, str | None]:
    """The batch maker for ``contract`` (``example_batch`` or an inferred token batch) and a note."""
    fn = contract.example_batch
    if fn is not None:
        return BatchSpec(make=lambda b: fn(b, seq_len), describe=lambda b: f"example_batch({b}, {seq_len})",
                         inferred=False, fix=BATCH_FIX), None
    first = first_param_module(model)
    if isinstance(first, nn.Embedding):
        vocab = first.num_embeddings

        def make(b: int) -> torch.Tensor:
            return torch.randint(0, vocab, (b, seq_len), dtype=torch.long)

        note = (f"inferred token-id batch [B, S] from the embedding (S = {seq_len}, ids below "
                f"num_embeddings = {vocab}); add example_batch(batch_size, seq_len) to choose the inputs")
        return BatchSpec(make=make, describe=lambda b: f"the inferred token batch [{b}, {seq_len}]",
                         inferred=True,
                         fix="add example_batch(batch_size, seq_len) returning what forward takes"), note
    kind = type(first).__name__ if first is not None else "no parameterised module"
    raise ModelFileError(contract.display,
                         f"no example_batch and the inputs cannot be inferred (the first layer is {kind}, "
                         "not an nn.Embedding)",
                         "add example_batch(batch_size, seq_len) returning the inputs forward takes")


@contextlib.contextmanager
def checkpointed(blocks: list[nn.Module], mode: bool | str = True) -> Iterator[None]:
    """Wrap each block's forward in ``torch.utils.checkpoint`` (non-reentrant) while active: ``True`` or
    ``"full"`` recomputes the whole block, ``"selective"`` runs it under the op-level policy the training loop
    applies (probes/trainloop.py ``selective_context``: attention outputs and every other matmul's output saved,
    the rest recomputed), ``False`` or ``"none"`` leaves the blocks alone; the call is the training loop's own
    (``checkpointed_call``)."""
    if mode in (False, "none"):
        yield
        return
    context_fn = selective_context() if mode == "selective" else None
    saved = [(blk, blk.__dict__.get("forward")) for blk in blocks]
    for blk in blocks:
        blk.forward = partial(checkpointed_call, blk.forward, context_fn)  # instance attribute shadows the method
    try:
        yield
    finally:
        for blk, previous in saved:
            if previous is None:
                blk.__dict__.pop("forward", None)
            else:
                blk.forward = previous


@contextlib.contextmanager
def _autocast(precision: ActivationPrecision) -> Iterator[None]:
    """bf16 autocast as it runs on a GPU: the CPU's, with the loss's cross entropy as CUDA autocast runs it
    (trainloop.CudaAutocastLoss: the profile predicts GPU memory)."""
    if precision not in ("bf16", FROZEN_16BIT):
        yield
        return
    with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocastLoss():
        yield


class FakeTensorLimit(ModelFileError):
    """Forward needs tensor values (``.item()``, a branch on a tensor, a data-dependent shape), which fake
    tensors do not have: a small model is then profiled by a real CPU run (:func:`measure_real`)."""


@dataclass
class BatchInfo:
    input_kind: str
    tokens_per_sample: int | None


@dataclass
class StepRunner:
    """Runs forward + loss + backward steps of one model, on real tensors or (inside an active
    FakeTensorMode) fake ones, turning user-code failures into ModelFileError."""

    model: nn.Module
    spec: BatchSpec
    loss_fn: Callable[[Any, Any], Any] | None
    display: str
    blocks: list[nn.Module] = field(default_factory=list)
    loss_note: str | None = None
    batch_info: BatchInfo | None = None
    input_dtype: torch.dtype | None = None
    """Floating tensors of the batch are cast to it (the model held in 16 bits); None keeps them."""

    # -- pieces of a step -------------------------------------------------------------------------
    def make_batch(self, b: int) -> Any:
        try:
            batch = self.spec.make(b)
        except Exception as exc:
            raise ModelFileError(self.display, f"{self.spec.describe(b)} raised {exc_text(exc)}",
                                 self.spec.fix) from None
        check_batch_type(batch, self.display, self.spec.describe(b))
        if self.batch_info is None:
            t = first_tensor(batch)
            assert t is not None
            integer = not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
            if integer and t.dim() == 2 and t.shape[0] == b:
                self.batch_info = BatchInfo("tokens", int(t.shape[1]))
            else:
                self.batch_info = BatchInfo("other", None)
        if self.input_dtype is not None:
            dtype = self.input_dtype
            batch = tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                             batch)
        return batch

    def forward(self, batch: Any, b: int) -> Any:
        try:
            return call_model(self.model, batch)
        except ModelFileError:
            raise
        except _FAKE_LIMITS as exc:
            raise FakeTensorLimit(
                self.display, f"forward needs real tensor values, which the meta/fake-tensor profile cannot "
                f"provide ({exc_text(exc)})",
                "avoid .item(), .tolist(), data-dependent shapes and Python branches on tensor values in "
                "forward") from None
        except Exception as exc:
            if _is_grouped_gemm_dtype_error(exc):
                raise ModelFileError(
                    self.display, f"a grouped-GEMM expert kernel (torch._grouped_mm, a Mixture-of-Experts layer) "
                    f"ran, which takes 16-bit inputs only and routes tokens by their values ({exc_text(exc)}): optplan "
                    "did not recognise its experts (a module list named ...experts... of MLPs, or 3-D expert "
                    "weights, beside an [experts, hidden] router weight) to profile them with a balanced dispatch",
                    "write the MoE layer as router + experts (probes/moe_layers.py says what is read), or plan it from "
                    "its shape with --hf CONFIG or --arch ...,experts=E,topk=K,moe_ffn=F") from None
            raise ModelFileError(self.display, f"the model rejected {self.spec.describe(b)}: forward raised "
                                 f"{exc_text(exc)}", self.spec.fix) from None

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            try:
                loss = self.loss_fn(output, batch)
            except Exception as exc:
                raise ModelFileError(self.display, f"loss_fn(output, batch) raised {exc_text(exc)}",
                                     "make loss_fn(output, batch) return a scalar tensor for the model's "
                                     "output and the example batch") from None
            where = "loss_fn(output, batch)"
        else:
            try:
                loss, rule = default_loss(output)
            except TypeError as exc:
                raise ModelFileError(self.display, f"no loss: {exc}",
                                     "define loss_fn(output, batch) returning a scalar tensor") from None
            self.loss_note = f"no loss_fn: the loss is {rule}"
            where = "the default loss"
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ModelFileError(self.display, f"{where} returned {shape}, not a scalar tensor",
                                 "make loss_fn(output, batch) return a scalar tensor (e.g. .mean())")
        if not loss.requires_grad:
            raise ModelFileError(self.display, f"{where} does not depend on any trainable parameter",
                                 "make sure parameters have requires_grad=True and the loss uses the output")
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        try:
            loss.backward()
        except Exception as exc:
            raise ModelFileError(self.display, f"backward raised {exc_text(exc)}",
                                 "make forward + loss differentiable (no in-place changes of saved tensors, "
                                 "no detached outputs)") from None

    def step(self, b: int, precision: ActivationPrecision = "fp32") -> None:
        """One forward + loss + backward at micro-batch ``b``; the batch is created inside."""
        batch = self.make_batch(b)
        with _autocast(precision):
            out = self.forward(batch, b)
            loss = self.loss(out, batch)
        del out
        self.backward(loss)

    # -- measurements -----------------------------------------------------------------------------
    def warm_up(self, b: int, precision: ActivationPrecision = "fp32") -> bool | None:
        """One step (allocates the gradients), then zero them in place. Returns whether the first
        repeated block's tensor inputs require grad (None without blocks)."""
        self.model.train()
        seen: list[bool] = []

        def pre_hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not seen:
                tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
                seen.append(any(t.requires_grad for t in tensors))

        handle = self.blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True) if self.blocks else None
        try:
            self.step(b, precision)
        finally:
            if handle is not None:
                handle.remove()
        self.model.zero_grad(set_to_none=False)
        return seen[0] if seen else None

    def flops(self, b: int, checkpointing: CheckpointMode = "none") -> tuple[int, int]:
        """(forward + loss, backward) FLOPs at micro-batch ``b``, attention counted (math SDPA); under
        ``checkpointing`` the backward's count includes what it recomputes."""
        batch = self.make_batch(b)
        with _math_sdpa(), checkpointed(self.blocks, checkpointing):
            with FlopCounterMode(display=False) as fwd_counter:
                out = self.forward(batch, b)
                loss = self.loss(out, batch)
            del out
            with FlopCounterMode(display=False) as bwd_counter:
                self.backward(loss)
        self.model.zero_grad(set_to_none=False)
        return int(fwd_counter.get_total_flops()), int(bwd_counter.get_total_flops())

    def _tracker(self) -> MemTracker:
        """A recording tracker with the resident parameters, gradients and buffers registered."""
        params = list(self.model.parameters())
        tracker = MemTracker(record=True)
        tracker.track(params, category="param")
        tracker.track([p.grad for p in params], category="grad")
        tracker.track(list(self.model.buffers()), category="buffer")
        return tracker

    def activation_timeline(self, b: int, precision: ActivationPrecision = "fp32",
                            checkpointing: CheckpointMode = "none", traffic: TrafficCounter | None = None) -> Timeline:
        """Live tensor bytes above the resident parameters, gradients and buffers after every allocation
        of one forward + loss + backward at micro-batch ``b``, split into :data:`PHASES` (bytes). With
        ``traffic``, the same step's memory-bound kernels are counted too (probes/traffic.py)."""
        tracker = self._tracker()
        tracker.phase = "stem" if self.blocks else "forward"
        with _phase_hooks(self.blocks, tracker), _grad_hooks(self.model, tracker), \
                checkpointed(self.blocks, checkpointing), tracker, contextlib.ExitStack() as counting:
            if traffic is not None:
                counting.enter_context(block_attribution(self.blocks, traffic))
                counting.enter_context(traffic)
            batch = self.make_batch(b)
            with _autocast(precision):
                out = self.forward(batch, b)
                _advance(tracker, "loss")
                waits = _on_output_grad(out, tracker)
                loss = self.loss(out, batch)
            del out, batch
            # the points of the loss's backward grow with depth unlike those of its forward (autocast's cached
            # weight copies are gone): a phase of its own, which ends at the model output's gradient
            _advance(tracker, "loss_backward" if waits else "backward")
            if traffic is not None:
                traffic.backward = True
            self.backward(loss)
            del loss
        self.model.zero_grad(set_to_none=False)
        return tracker.timeline()

    def activation_bytes(self, b: int, precision: ActivationPrecision = "fp32",
                         checkpointing: CheckpointMode = "none") -> int:
        """Peak live tensor bytes of one step above the resident parameters, gradients and buffers."""
        timeline = self.activation_timeline(b, precision, checkpointing)
        return max((live for events in timeline.values() for live, _ in events), default=0)


def _advance(tracker: MemTracker, phase: str) -> None:
    """Move ``tracker.phase`` on to ``phase`` (never back: hooks can fire out of order)."""
    if PHASES.index(phase) > PHASES.index(tracker.phase):
        tracker.phase = phase


def _on_output_grad(out: Any, tracker: MemTracker) -> bool:
    """Hook the model's differentiable outputs so the ``backward`` phase starts when the first of their
    gradients exists; returns whether any output was hooked."""
    hooked = False
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(lambda g: _advance(tracker, "backward"))
            hooked = True
    return hooked


@contextlib.contextmanager
def _grad_hooks(model: nn.Module, tracker: MemTracker) -> Iterator[None]:
    """Start the ``backward_grads`` phase when the first parameter gradient has been accumulated."""
    handles = [p.register_post_accumulate_grad_hook(lambda _p: _advance(tracker, "backward_grads"))
               for p in model.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _phase_hooks(blocks: list[nn.Module], tracker: MemTracker) -> Iterator[None]:
    """Switch ``tracker.phase`` to ``forward`` when the first repeated block starts its forward and to
    ``stem_backward`` when the gradient of its (first grad-requiring tensor) input has been computed."""
    if not blocks:
        yield
        return

    def on_input_grad(grad: torch.Tensor) -> None:
        _advance(tracker, "stem_backward")

    def pre_hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if tracker.phase != "stem":
            return
        tracker.phase = "forward"
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(on_input_grad)
                break

    handle = blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@dataclass
class Measurement:
    """Raw numbers of one model instance (one depth)."""

    fwd_flops: int
    bwd_flops: int
    envelopes: dict[tuple[ActivationPrecision, CheckpointMode], StepEnvelope]
    batch_info: BatchInfo
    loss_note: str | None
    first_block_input_grad: bool | None = None
    weights_16bit_note: str | None = None
    selective_recompute_flops: int | None = None
    eager_block_bytes: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Memory-bound bytes of one repeated block per sample by eager precision class: (forward, backward)."""


def checkpoint_modes(has_blocks: bool) -> tuple[CheckpointMode, ...]:
    """No checkpointing, and when the model has repeated blocks every block checkpointed in full and under the
    training loop's selective policy (the latter where torch has ``create_selective_checkpoint_contexts``)."""
    if not has_blocks:
        return ("none",)
    return ("none", "selective", "full") if selective_context() is not None else ("none", "full")


def modes_for(has_blocks: bool) -> list[tuple[ActivationPrecision, CheckpointMode]]:
    return [(p, c) for p in PRECISIONS for c in checkpoint_modes(has_blocks)]


def measure(runner: StepRunner, batch_sizes: tuple[int, int], *, flops: bool = True) -> Measurement:
    """Warm up, count FLOPs at ``batch_sizes[0]`` and fit the activation envelope of every mode from
    the step's timelines at the two ``batch_sizes``."""
    input_grad = runner.warm_up(batch_sizes[0])
    fwd, bwd = runner.flops(batch_sizes[0]) if flops else (0, 0)
    recompute = None
    if flops and "selective" in checkpoint_modes(bool(runner.blocks)):  # what the selective policy re-runs
        recompute = max(0, runner.flops(batch_sizes[0], "selective")[1] - bwd)
    envelopes = {}
    eager: dict[str, tuple[float, float]] = {}
    for precision, ckpt in modes_for(bool(runner.blocks)):
        t0, t1 = _timelines(runner, batch_sizes, precision, ckpt, eager)
        envelopes[(precision, ckpt)] = StepEnvelope.from_timelines(t0, t1, batch_sizes)
    sixteen, note = measure_16bit_weights(runner, batch_sizes, eager)
    envelopes.update(sixteen)
    if any(LORA_MARK in name for name, _ in runner.model.named_parameters()):
        envelopes.update(measure_frozen_16bit(runner, batch_sizes))
    assert runner.batch_info is not None
    return Measurement(fwd, bwd, envelopes, runner.batch_info, runner.loss_note, input_grad, note, recompute,
                       eager_block_bytes=eager)


EAGER_CLASS: dict[str, str] = {"fp32": "fp32", "bf16": "amp", WEIGHTS_16BIT: "bf16"}
"""The eager-traffic precision class (estimators/eager_traffic.py) of each profiled activation precision."""


def _timelines(runner: StepRunner, batch_sizes: tuple[int, int], precision: ActivationPrecision,
               ckpt: CheckpointMode, eager: dict[str, tuple[float, float]]) -> tuple[Timeline, Timeline]:
    """The two timelines of one mode; without checkpointing, the memory-bound bytes of one repeated block per
    sample (forward, backward: the slope between the two batch sizes, probes/traffic.py) go into ``eager``."""
    if ckpt != "none" or not runner.blocks or precision not in EAGER_CLASS:
        return runner.activation_timeline(batch_sizes[0], precision, ckpt), \
            runner.activation_timeline(batch_sizes[1], precision, ckpt)
    counters = (TrafficCounter(), TrafficCounter())
    t0, t1 = (runner.activation_timeline(b, precision, ckpt, traffic=c) for b, c in zip(batch_sizes, counters,
                                                                                       strict=True))
    (f0, b0), (f1, b1) = (c.traffic.per_block() for c in counters)
    n = batch_sizes[1] - batch_sizes[0]
    eager[EAGER_CLASS[precision]] = (max(0.0, (f1 - f0) / n), max(0.0, (b1 - b0) / n))
    return t0, t1


def measure_16bit_weights(runner: StepRunner, batch_sizes: tuple[int, int],
                          eager: dict[str, tuple[float, float]] | None = None
                          ) -> tuple[dict[tuple[ActivationPrecision, CheckpointMode], StepEnvelope], str | None]:
    """The ``bf16-weights`` envelopes: the model's floating parameters and buffers cast to bf16 (tied weights
    kept tied), floating inputs cast, no autocast, one warm-up step (bf16 gradients), then the same
    timelines as the other modes; the model is cast back afterwards. A model that fails to run in bf16
    (an op without a bf16 kernel, a tensor the model creates in fp32 and mixes with its weights) gets no
    such envelopes, and a note: its 16-bit recipes are then priced from the autocast fit without its
    weight copies."""
    model = runner.model
    dtypes = {name: t.dtype for name, t in (*model.named_parameters(remove_duplicate=False),
                                             *model.named_buffers(remove_duplicate=False))}
    envelopes: dict[tuple[ActivationPrecision, CheckpointMode], StepEnvelope] = {}
    note = None
    try:
        cast_floating(model, lambda _name: torch.bfloat16)
        runner.input_dtype = torch.bfloat16
        runner.warm_up(batch_sizes[0])
        for ckpt in checkpoint_modes(bool(runner.blocks)):
            t0, t1 = _timelines(runner, batch_sizes, WEIGHTS_16BIT, ckpt, eager if eager is not None else {})
            envelopes[(WEIGHTS_16BIT, ckpt)] = StepEnvelope.from_timelines(t0, t1, batch_sizes)
    except ModelFileError as exc:
        envelopes = {}
        note = (f"the model does not train with bf16 weights ({exc.problem}): its 16-bit-weight recipes are "
                "priced from the autocast profile without autocast's weight copies")
    finally:
        runner.input_dtype = None
        cast_floating(model, lambda name: dtypes.get(name))
    return envelopes, note


def measure_frozen_16bit(runner: StepRunner, batch_sizes: tuple[int, int]
                         ) -> dict[tuple[ActivationPrecision, CheckpointMode], StepEnvelope]:
    """The ``bf16-frozen`` envelopes of a LoRA model: its frozen parameters cast to bf16, the trainable adapters
    kept in fp32, steps under bf16 autocast (peft's default on a base loaded in bf16, with a Hugging Face
    ``Trainer(bf16=True)``): one warm-up step, then the timelines of the other modes; the model is cast back
    afterwards. A model that fails so gets none (its AMP recipes then use the autocast fit)."""
    model = runner.model
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    dtypes = {name: p.dtype for name, p in model.named_parameters(remove_duplicate=False)}
    envelopes: dict[tuple[ActivationPrecision, CheckpointMode], StepEnvelope] = {}
    try:
        cast_floating(model, lambda name: torch.bfloat16 if name in frozen else None)
        runner.warm_up(batch_sizes[0], FROZEN_16BIT)
        for ckpt in checkpoint_modes(bool(runner.blocks)):
            t0, t1 = (runner.activation_timeline(b, FROZEN_16BIT, ckpt) for b in batch_sizes)
            envelopes[(FROZEN_16BIT, ckpt)] = StepEnvelope.from_timelines(t0, t1, batch_sizes)
    except ModelFileError:
        envelopes = {}
    finally:
        cast_floating(model, lambda name: dtypes.get(name))
    return envelopes


def cast_floating(model: nn.Module, dtype_of: Callable[[str], torch.dtype | None]) -> None:
    """Replace each floating parameter and buffer of ``model`` by a copy in ``dtype_of(its dotted name)``
    (None or its own dtype: left as it is), keeping tied ones tied. New Parameters, not ``Module.to``:
    fake tensors cannot be swapped in place across dtypes."""
    def cast(root: nn.Module) -> None:
        with torch.no_grad():
            for prefix, mod in root.named_modules(remove_duplicate=False):
                for store in ("_parameters", "_buffers"):
                    table = getattr(mod, store)
                    for name, t in list(table.items()):
                        want = dtype_of(f"{prefix}.{name}" if prefix else name)
                        if t is None or not t.is_floating_point() or want is None or t.dtype == want:
                            continue
                        table[name] = (nn.Parameter(t.detach().to(want), requires_grad=t.requires_grad)
                                       if store == "_parameters" else t.to(want))

    apply_keeping_ties(model, cast)


def blocks_of(model: nn.Module, cls: type | None) -> list[nn.Module]:
    """The instances of the repeated block class that sit directly in ModuleLists/Sequentials."""
    if cls is None:
        return []
    out: dict[int, nn.Module] = {}
    for mod in model.modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            for child in mod.children():
                if type(child) is cls:
                    out.setdefault(id(child), child)
    return list(out.values())


def measure_fake(meta_model: nn.Module, spec: BatchSpec, contract: ModelContract, block_cls: type | None,
                 batch_sizes: tuple[int, int]) -> Measurement:
    """Materialise a meta model on fake CPU tensors and :func:`measure` it."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = materialize_fake(meta_model)
        runner = StepRunner(model=model, spec=spec, loss_fn=contract.loss_fn, display=contract.display,
                            blocks=blocks_of(model, block_cls))
        return measure(runner, batch_sizes)


def extrapolate(one: float, two: float, layers: int, base: int = 1) -> float:
    """Value at ``layers`` blocks from values at ``base`` and ``base + 1`` blocks (linear in depth)."""
    return one + (two - one) * (layers - base)


def fit_activations(envelopes: Mapping[tuple[ActivationPrecision, CheckpointMode], StepEnvelope]
                    ) -> tuple[ActivationFit, ...]:
    """One :class:`ActivationFit` per (precision, checkpointing), fp32 first, no checkpointing first."""
    modes = sorted(envelopes, key=lambda m: (PRECISION_ORDER.index(m[0]), m[1] != "none"))
    return tuple(activation_fit(precision, ckpt, envelopes[(precision, ckpt)]) for precision, ckpt in modes)


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


def _measure_reduced(contract: ModelContract, meta: nn.Module, block: BlockInfo, spec: BatchSpec,
                     notes: list[str]) -> tuple[Measurement, tuple[int, int], int | None]:
    """Measure with the block container cut to 1 and 2 blocks and extrapolate to its length.

    When the first block's input does not require grad (the blocks come first, no embedding or stem
    before them), the first block skips its input gradient, so depth 1 is not on the line: then 2 and 3
    blocks are measured instead. Returns (measurement, batch sizes, blocks profiled or None for full).
    """
    layers = len(block.blocks)
    path = block.path
    assert path is not None
    cls = block.cls
    head = block.head  # leading blocks of another size (dense layers before the MoE ones) are kept in both cuts
    m1, sizes = _measure_with_fallback(contract, lambda: _fresh(contract, meta, path, head + 1), spec, cls, notes)
    m2 = measure_fake(_fresh(contract, meta, path, head + 2), spec, contract, cls, sizes)
    lo, hi, base = m1, m2, head + 1
    if m1.first_block_input_grad is False and head == 0:
        m3 = measure_fake(_fresh(contract, meta, path, 3), spec, contract, cls, sizes)
        if layers == 3:
            return m3, sizes, None
        lo, hi, base = m2, m3, 2
    extra = layers - (base + 1)
    envelopes = {k: hi.envelopes[k].deeper(lo.envelopes[k], extra) for k in hi.envelopes if k in lo.envelopes}
    measurement = Measurement(
        fwd_flops=round(extrapolate(lo.fwd_flops, hi.fwd_flops, layers, base)),
        bwd_flops=round(extrapolate(lo.bwd_flops, hi.bwd_flops, layers, base)),
        envelopes=envelopes, batch_info=m1.batch_info, loss_note=m1.loss_note,
        weights_16bit_note=lo.weights_16bit_note or hi.weights_16bit_note,
        selective_recompute_flops=(None if lo.selective_recompute_flops is None or hi.selective_recompute_flops is None
                                   else round(extrapolate(lo.selective_recompute_flops, hi.selective_recompute_flops,
                                                          layers, base))),
        eager_block_bytes=hi.eager_block_bytes)  # a mean over the blocks that ran: depth does not change it
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


def _is_grouped_gemm_dtype_error(exc: BaseException) -> bool:
    """torch._grouped_mm's refusal of fp32 inputs (transformers 5's default experts implementation)."""
    text = str(exc)
    return "Expected inputs of BF16 type" in text or "grouped_mm" in text


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
        if contract.example_batch is not None and explicit_seq is None:
            notes.append(f"example_batch was called with seq_len={used_seq} (no sequence length known)")
    b0 = sizes[0]
    return ModelProfile(
        name=contract.name,
        path=str(contract.path),
        model_class=type(meta).__name__,
        params=params,
        trainable_params=trainable,
        params_by_module=by_module,
        factored_state_elements=factored_state_elements(meta),
        small_param_counts=small_param_counts(meta),
        buffer_bytes=buffer_bytes(meta),
        param_dtype=dtype,
        repeated_block=block.summary() if block else None,
        input_kind=info.input_kind,  # type: ignore[arg-type]
        seq_len=profile_seq,
        tokens_per_sample=info.tokens_per_sample,
        fwd_flops_per_sample=measurement.fwd_flops / b0,
        bwd_flops_per_sample=measurement.bwd_flops / b0,
        selective_recompute_flops_per_sample=(None if measurement.selective_recompute_flops is None
                                              else measurement.selective_recompute_flops / b0),
        eager_layer_bytes_per_token=(
            {k: (f / info.tokens_per_sample, b / info.tokens_per_sample)
             for k, (f, b) in measurement.eager_block_bytes.items()}
            if info.input_kind == "tokens" and info.tokens_per_sample and measurement.eager_block_bytes else None),
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
