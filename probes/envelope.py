"""Activation envelopes: the live bytes of a profiled step as lines over the micro-batch, per phase.

Pure functions and frozen data (no torch): ``optplan.probes.static`` records a step's timelines with the
live-tensor tracker and fits them here into the ``ActivationFit`` the estimators read (the definitions are in
``static``'s module docstring: phases, lines through two micro-batches, upper envelopes, depth extrapolation).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from optplan.estimators.profile import WEIGHTS_16BIT, ActivationFit, ActivationPrecision, CheckpointMode

Line = tuple[float, float]
"""``(intercept, slope)``: bytes ``intercept + slope * b`` at micro-batch ``b`` (bytes, bytes per sample)."""

PHASES = ("stem", "forward", "loss", "loss_backward", "backward", "backward_grads", "stem_backward")
"""The phases of a step's timeline, in order: ``stem`` before the first repeated block's forward
(batch creation, embedding or stem), ``forward`` the blocks and the rest of the model's forward,
``loss`` the loss function's forward, ``loss_backward`` from the start of backward to the gradient of
the model's output (the loss function's backward), ``backward`` the model's backward until the first parameter gradient is accumulated,
``backward_grads`` the rest of it until the gradient of the first block's input exists,
``stem_backward`` the rest (the stem's or embedding's backward, e.g. vocabulary-sized buffers that do
not grow with depth). A model without repeated blocks has no ``stem`` and ``stem_backward``."""

GROWTH_GROUP = {"stem": "stem", "forward": "forward", "loss": "forward", "loss_backward": "backward",
                "backward": "backward", "backward_grads": "backward", "stem_backward": "stem_backward"}
"""Phases that grow alike with depth (:meth:`StepEnvelope.deeper`): before the first block, the model's and
the loss's forward, the loss's and the model's backward to the first block's input gradient, the rest.
Finer phases only say when engine buffers are alive; one growth per group keeps the extrapolation from
following a single phase's peak as it moves between points that grow differently."""

STEP_PHASE_OF = {"stem": "forward", "forward": "forward", "loss": "loss", "loss_backward": "loss",
                 "backward": "backward",
                 "backward_grads": "grads", "stem_backward": "stem_grads"}
"""The moment of the step (``optplan.estimators.profile.STEP_PHASES``) each timeline phase belongs to."""

PhaseLines = dict[str, tuple[Line, ...]]
"""Per phase, an :func:`upper_envelope`."""

Timeline = dict[str, list[tuple[int, int]]]
"""Per phase, ``(live bytes, live bytes without parameter copies)`` above the resident states after
every allocation (:meth:`MemTracker.timeline`)."""


def line_through(y0: float, y1: float, b0: int, b1: int) -> Line:
    """The line through ``(b0, y0)`` and ``(b1, y1)``."""
    slope = (y1 - y0) / (b1 - b0)
    return y0 - slope * b0, slope


def value_at(lines: tuple[Line, ...] | list[Line], b: float) -> float:
    """The upper envelope of ``lines`` at ``b`` (0 for no lines)."""
    return max((a + c * b for a, c in lines), default=0.0)


def upper_envelope(lines: Iterable[Line], b_min: float = 1.0) -> tuple[Line, ...]:
    """The lines that are the maximum somewhere on ``b >= b_min``, by increasing slope.

    The classic convex-hull sweep: sort by slope (for equal slopes keep the highest intercept); a
    steeper line removes the last kept one when it is already at least as high at ``b_min``, or when it
    overtakes the one before the last kept line no later than the last kept line does.
    """
    best: dict[float, float] = {}
    for a, c in lines:
        if c not in best or a > best[c]:
            best[c] = a
    kept: list[Line] = []
    for c, a in sorted(best.items()):
        while kept:
            a_last, c_last = kept[-1]
            if a + c * b_min >= a_last + c_last * b_min:
                kept.pop()
                continue
            if len(kept) >= 2:
                a_prev, c_prev = kept[-2]
                if (a_prev - a) / (c - c_prev) <= (a_prev - a_last) / (c_last - c_prev):
                    kept.pop()
                    continue
            break
        kept.append((a, c))
    return tuple(kept)


def _phase_lines(events0: list[tuple[int, int]], events1: list[tuple[int, int]], b0: int, b1: int,
                 column: int) -> tuple[Line, ...]:
    """The envelope of one phase from its timelines at micro-batches ``b0`` and ``b1``.

    The same program runs at both sizes, so the ``i``-th allocation of the phase is the same operator
    in both timelines and its live bytes are the line through its two values (tensor sizes are linear
    in the batch size). When the timelines do not line up (the model branches on the batch size), the
    phase falls back to one line through its two peaks.
    """
    if len(events0) == len(events1):
        lines = [line_through(e0[column], e1[column], b0, b1) for e0, e1 in zip(events0, events1, strict=True)]
    else:
        lines = [line_through(max(e[column] for e in events0), max(e[column] for e in events1), b0, b1)]
    return upper_envelope(lines)


@dataclass(frozen=True)
class StepEnvelope:
    """Activation bytes of one step (one precision and checkpointing mode) as a function of the
    micro-batch ``b``: per phase (:data:`PHASES`), the upper envelope of the lines ``a + c * b`` that the
    live bytes above the resident parameters, gradients and buffers follow after each allocation;
    ``total`` counts every tensor, ``bare`` leaves out autocast's parameter copies. The step's
    activation peak at ``b`` is the largest value of any line at ``b`` (bytes). ``misaligned`` names
    the phases whose timelines did not line up (fitted through their peaks only); ``later`` those refitted
    through the next pair of micro-batches because the first one ran other operators (:meth:`refitted`)."""

    batch_sizes: tuple[int, int]
    total: PhaseLines
    bare: PhaseLines
    misaligned: tuple[str, ...] = ()
    later: tuple[str, ...] = ()

    @classmethod
    def from_timelines(cls, t0: Timeline, t1: Timeline, batch_sizes: tuple[int, int]) -> StepEnvelope:
        """Fit the timelines of one step at the two ``batch_sizes`` (see :func:`_phase_lines`)."""
        b0, b1 = batch_sizes
        phases = [p for p in PHASES if t0.get(p) and t1.get(p)]
        return cls(batch_sizes,
                   {p: _phase_lines(t0[p], t1[p], b0, b1, 0) for p in phases},
                   {p: _phase_lines(t0[p], t1[p], b0, b1, 1) for p in phases},
                   tuple(p for p in phases if len(t0[p]) != len(t1[p])))

    def refitted(self, later: StepEnvelope) -> StepEnvelope:
        """This envelope with each phase that did not line up here but does in ``later`` (the same step's timelines
        at the next pair of micro-batches, e.g. 2 and 3 after 1 and 2) taken from ``later``.

        One sample is often a step of its own: a tensor with a dimension of size 1 is contiguous whatever that
        dimension's stride, so ``x.transpose(0, 1).contiguous()`` (``nn.MultiheadAttention`` with
        ``batch_first``) or ``logits[:, :-1].reshape(-1, V)`` (a shifted loss) is a view at micro-batch 1 and a
        copy from 2 on. A line through the two peaks of 1 and 2 then counts the copy twice over per sample. The
        later pair's lines are exact from micro-batch 2 on; at 1 they count the copies that did not happen, and the
        phase's own peak at the first size is kept as a floor (a flat line), so that micro-batch 1 is never
        under-counted.
        """
        swap = tuple(p for p in self.misaligned if p in later.total and p not in later.misaligned)
        if not swap:
            return self

        def take(mine: PhaseLines, theirs: PhaseLines) -> PhaseLines:
            b0 = self.batch_sizes[0]
            return {p: upper_envelope((*theirs[p], (value_at(lines, b0), 0.0))) if p in swap else lines
                    for p, lines in mine.items()}

        return StepEnvelope(self.batch_sizes, take(self.total, later.total), take(self.bare, later.bare),
                            tuple(p for p in self.misaligned if p not in swap), tuple(p for p in PHASES if p in swap))

    def lines(self, bare: bool = False) -> tuple[Line, ...]:
        """The upper envelope over all phases."""
        phases = self.bare if bare else self.total
        return upper_envelope(line for lines in phases.values() for line in lines)

    def step_phase_lines(self, bare: bool = False) -> dict[str, tuple[Line, ...]]:
        """The upper envelope of each moment of the step (:data:`STEP_PHASE_OF`), by increasing slope."""
        phases = self.bare if bare else self.total
        grouped: dict[str, list[Line]] = {}
        for phase, lines in phases.items():
            grouped.setdefault(STEP_PHASE_OF[phase], []).extend(lines)
        return {k: upper_envelope(v) for k, v in grouped.items()}

    def at(self, b: float, bare: bool = False) -> float:
        """The activation peak at micro-batch ``b`` (bytes)."""
        return value_at(self.lines(bare), b)

    def deeper(self, shallower: StepEnvelope, extra_blocks: int) -> StepEnvelope:
        """Extrapolate this envelope (``d + 1`` blocks) by ``extra_blocks`` more blocks, given the one
        of ``shallower`` (``d`` blocks).

        Per group of phases (:data:`GROWTH_GROUP`), one more block adds the difference of the group's two
        peaks, itself a line over the micro-batch (through its values at the two profiled sizes); that is
        added ``extra_blocks`` times to every line of the group's phases. Within a phase the points that can be the peak grow alike with depth
        (all saved activations of the blocks so far), which is why the step is split where it is: the
        embedding's backward, for one, does not grow at all while the start of backward does.
        """
        b0, b1 = self.batch_sizes

        def grow(mine: PhaseLines, theirs: PhaseLines) -> PhaseLines:
            def group_lines(phases: PhaseLines, group: str) -> list[Line]:
                return [ln for phase, lines in phases.items() if GROWTH_GROUP[phase] == group for ln in lines]

            growth = {}
            for group in set(GROWTH_GROUP.values()):
                ours, other = group_lines(mine, group), group_lines(theirs, group)
                growth[group] = line_through(value_at(ours, b0) - value_at(other, b0),
                                             value_at(ours, b1) - value_at(other, b1), b0, b1) if other else (0.0, 0.0)
            out = {}
            for phase, lines in mine.items():
                a, c = growth[GROWTH_GROUP[phase]]
                out[phase] = tuple((la + extra_blocks * a, lc + extra_blocks * c) for la, lc in lines)
            return out

        misaligned = tuple(p for p in PHASES if p in self.misaligned or p in shallower.misaligned)
        later = tuple(p for p in PHASES if p in self.later or p in shallower.later)
        return StepEnvelope(self.batch_sizes, grow(self.total, shallower.total), grow(self.bare, shallower.bare),
                            misaligned, later)


def activation_fit(precision: ActivationPrecision, checkpointing: CheckpointMode,
                   envelope: StepEnvelope) -> ActivationFit:
    """The :class:`ActivationFit` of one mode: the envelope's lines, rounded to whole bytes.

    ``fixed_bytes`` and ``per_sample_bytes`` are its steepest line (the one that is the peak at large
    micro-batches); ``lines_without_copies`` is the envelope without autocast's parameter copies and
    ``param_copy_bytes`` the difference of the two at micro-batch 1 (the copies' share of the peak
    depends on the micro-batch: under checkpointing, for one, the forward peak holds every cached
    weight copy but the backward peak, which takes over at large micro-batches, only a block's).
    """
    weights16 = precision == WEIGHTS_16BIT  # its casts of weights are the model's own (e.g. a norm in fp32)
    total, bare = envelope.lines(), envelope.lines(bare=not weights16)
    rounded = tuple((round(a), round(c)) for a, c in total)
    by_step_total, by_step_bare = envelope.step_phase_lines(), envelope.step_phase_lines(bare=not weights16)
    fixed, per_sample = rounded[-1] if rounded else (0, 0)
    copies = value_at(total, 1) - value_at(bare, 1)
    return ActivationFit(precision=precision, checkpointing=checkpointing, fixed_bytes=fixed,
                         per_sample_bytes=max(0, per_sample), param_copy_bytes=max(0, round(copies)),
                         lines=rounded, lines_without_copies=tuple((round(a), round(c)) for a, c in bare),
                         phase_lines={k: _rounded(v) for k, v in by_step_total.items()},
                         phase_lines_without_copies={k: _rounded(v) for k, v in by_step_bare.items()})


def _rounded(lines: tuple[Line, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((round(a), round(c)) for a, c in lines)
