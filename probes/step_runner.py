"""Running forward + loss + backward steps of a user's model for the static profile: on real tensors or (inside an
active ``FakeTensorMode``) fake ones, turning user-code failures into one-line ``ModelFileError``s.

:class:`StepRunner` makes the batch (``example_batch`` or an inferred token batch, :func:`batch_spec`), runs the
step under bf16 autocast as a GPU runs it (:func:`step_autocast`) and with its repeated blocks checkpointed as the
training loop checkpoints them (:func:`checkpointed`), counts the step's FLOPs (``FlopCounterMode``, the math SDPA
kernel; grouped convolutions' backward by probes/flop_formulas.py) and records the live tensor bytes after every
allocation, split into the step's phases (probes/envelope.py ``PHASES``: hooks on the first block, the model's
outputs and the parameters' gradients) and,
when asked, the memory-bound kernels' traffic (probes/traffic.py). :func:`cast_floating` holds a model in another
dtype (tied weights kept tied). What is measured and how it is fitted: probes/activation_measure.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode

from optplan.estimators.profile import FROZEN_16BIT, ActivationPrecision, CheckpointMode
from optplan.probes.attention_heads import attention_calls
from optplan.probes.contract import (
    BATCH_FIX,
    ModelContract,
    apply_keeping_ties,
    call_model,
    check_batch_type,
    default_loss,
    exc_text,
    first_param_module,
    first_tensor,
    forward_arity,
)
from optplan.probes.envelope import PHASES, Timeline
from optplan.probes.flop_formulas import FLOP_FIXES
from optplan.probes.loader import ModelFileError
from optplan.probes.memtrack import MemTracker
from optplan.probes.self_recompute import module_reruns
from optplan.probes.traffic import TrafficCounter, block_attribution
from optplan.probes.trainloop import (
    CudaAutocastLoss,
    checkpointed_call,
    selective_context,
)

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
        UnsupportedOperatorException,
    )

    _FAKE_LIMITS: tuple[type[BaseException], ...] = (
        DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
except ImportError:  # pragma: no cover
    _FAKE_LIMITS = ()


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


def ignores_seq_len(contract: ModelContract, seq_len: int) -> bool:
    """True when ``example_batch(1, seq_len)`` and ``example_batch(1, 2 * seq_len)`` return tensors of the same
    shapes (images, fixed-size features: a sequence length changes nothing); False when they differ, when the file
    has no ``example_batch`` or when the second call fails (nothing is claimed then)."""
    fn = contract.example_batch
    if fn is None:
        return False

    def shapes(s: int) -> list[tuple[int, ...]]:
        with torch.no_grad():
            return [tuple(t.shape) for t in tree_leaves(fn(1, s)) if isinstance(t, torch.Tensor)]

    try:
        return shapes(seq_len) == shapes(2 * seq_len)
    except Exception:  # the user's function: its failure here is not this check's business
        return False


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
def step_autocast(precision: ActivationPrecision) -> Iterator[None]:
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


def raised_in_file(exc: BaseException, path: str) -> int | None:
    """The line of ``path`` (the model file) that raised ``exc``: its innermost frame there, when no ``nn.Module``
    layer was called below it (torch's own operators and the fake-tensor dispatch that runs them may be: a ``.view``
    of the wrong shape raises inside torch/_subclasses); None when the exception came from a layer refusing the batch's
    shape or dtype (a frame in torch/nn/modules below the file's) or never passed through the file."""
    tb = exc.__traceback__
    line: int | None = None
    layer_below = False
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        try:
            mine = os.path.samefile(filename, path)
        except OSError:
            mine = False
        if mine:
            line, layer_below = tb.tb_lineno, False
        elif line is not None and f"{os.sep}torch{os.sep}nn{os.sep}modules{os.sep}" in filename:
            layer_below = True
        tb = tb.tb_next
    return None if layer_below else line


def unused_params_note(model: nn.Module, has_loss_fn: bool) -> str | None:
    """A note naming the trainable parameters one step's backward left without a gradient, or None when every one
    got one. A plan still counts their gradients and optimizer states (a trainer allocates them), but the step's
    backward FLOPs and activations are those of the loss as it ran: without ``loss_fn`` the default loss may have
    taken an output that skips part of the model."""
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]  # tied: once
    if not missing:
        return None
    trainable = [p for p in model.parameters() if p.requires_grad]
    names = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    skipped = set(missing)
    share = sum(p.numel() for n, p in model.named_parameters() if n in skipped) / max(
        1, sum(p.numel() for p in trainable))
    fix = ("define loss_fn(output, batch) computing the loss you train with" if not has_loss_fn else
           "if training uses them, make loss_fn(output, batch) depend on them")
    return (f"{len(missing)} trainable parameter tensor(s) ({share:.0%} of the trainable parameters: {names}) got no "
            f"gradient from the profiled loss, so its backward skips them; {fix}")


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
    unused_note: str | None = None
    batch_note: str | None = None
    """Set by :meth:`forward`: the batch's items beyond what forward takes go to the loss only (trainloop.call_model)."""
    """Set by :meth:`warm_up`: the trainable parameters the loss left without a gradient (``unused_params_note``)."""
    batch_info: BatchInfo | None = None
    attention_key_heads: int | None = None
    """Set by :meth:`flops`: the key heads the model's attention call received (probes/attention_heads.py)."""
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
        arity = forward_arity(self.model) if isinstance(batch, (list, tuple)) else None
        if arity and len(batch) > arity and self.batch_note is None:
            self.batch_note = (f"{self.spec.describe(b)} returns {len(batch)} items and forward takes {arity}: "
                               f"forward gets the first {arity}, the loss the whole batch")
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
            if is_grouped_gemm_dtype_error(exc):
                raise ModelFileError(
                    self.display, f"a grouped-GEMM expert kernel (torch._grouped_mm, a Mixture-of-Experts layer) "
                    f"ran, which takes 16-bit inputs only and routes tokens by their values ({exc_text(exc)}): optplan "
                    "did not recognise its experts (a module list named ...experts... of MLPs, or 3-D expert "
                    "weights, beside an [experts, hidden] router weight) to profile them with a balanced dispatch",
                    "write the MoE layer as router + experts (probes/moe_layers.py says what is read), or plan it from "
                    "its shape with --hf CONFIG or --arch ...,experts=E,topk=K,moe_ffn=F") from None
            line = raised_in_file(exc, self.display)
            if line is not None:  # the model's own code raised, not a layer refusing the batch
                raise ModelFileError(self.display, f"forward raised {exc_text(exc)} at line {line} of the model "
                                     f"file, on {self.spec.describe(b)}",
                                     "fix forward at that line, or make example_batch(batch_size, seq_len) return "
                                     "what it expects (optplan --debug shows the traceback)") from None
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
        with step_autocast(precision):
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
        self.unused_note = unused_params_note(self.model, self.loss_fn is not None)
        self.model.zero_grad(set_to_none=False)
        return seen[0] if seen else None

    def flops(self, b: int, checkpointing: CheckpointMode = "none") -> tuple[int, int, int]:
        """(forward + loss, backward, re-run) FLOPs at micro-batch ``b``, attention counted (math SDPA); under
        ``checkpointing`` the backward's count includes what it recomputes. The third figure is the part of the
        backward's that module forwards re-ran during it (probes/self_recompute.py): the model's own checkpointing,
        and under ``checkpointing`` the training loop's too."""
        batch = self.make_batch(b)
        with _math_sdpa(), checkpointed(self.blocks, checkpointing):
            with FlopCounterMode(display=False, custom_mapping=FLOP_FIXES) as fwd_counter, attention_calls() as calls:
                out = self.forward(batch, b)
                loss = self.loss(out, batch)
            del out
            with FlopCounterMode(display=False, custom_mapping=FLOP_FIXES) as bwd_counter, \
                    module_reruns(bwd_counter) as reruns:
                self.backward(loss)
        self.model.zero_grad(set_to_none=False)
        if calls.key_heads:  # the heads the model's attention call received (probes/attention_heads.py)
            self.attention_key_heads = calls.key_heads
        return int(fwd_counter.get_total_flops()), int(bwd_counter.get_total_flops()), int(reruns.flops)

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
            with step_autocast(precision):
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



def is_grouped_gemm_dtype_error(exc: BaseException) -> bool:
    """torch._grouped_mm's refusal of fp32 inputs (transformers 5's default experts implementation)."""
    text = str(exc)
    return "Expected inputs of BF16 type" in text or "grouped_mm" in text


__all__ = ["BatchInfo", "BatchSpec", "FakeTensorLimit", "StepRunner", "batch_spec", "cast_floating", "checkpointed",
           "is_grouped_gemm_dtype_error", "step_autocast"]
