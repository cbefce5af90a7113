"""Padding an unaligned vocabulary (estimators/vocab_padding.py): GPT-2's 50,257-word head ran 120 of its 228 ms on an
H200 at micro-batch 64 (cuBLAS's unaligned fallback); the estimate says what padding to 50,304 would save, where it
matters, and not where the engine pads (Megatron), the vocabulary is aligned, or fp32 GEMMs take no alignment."""

from __future__ import annotations

import pytest

from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.profile import TransformerShape
from optplan.estimators.strategy import Strategy
from optplan.estimators.vocab_padding import padded_vocab, padding_saving_s, vocab_padding_notes
from tests.factories import make_profile


def _gpt2(vocab: int):
    prof = make_profile()
    return prof.model_copy(update={"transformer": TransformerShape(hidden=768, layers=12, heads=12, vocab=vocab)})


def _note(est) -> str | None:
    return next((n for n in est.notes if "vocabulary" in n), None)


def test_padding_gpt2s_vocabulary_is_priced_and_said_on_hopper() -> None:
    assert padded_vocab(50257) == 50304 and padded_vocab(50304) == 50304
    h100 = Cluster(gpu=find_gpu("H100-SXM"), gpus=1, gpus_per_node=1)
    s = Strategy(precision="bf16", engine="torch", mbs=64, grad_accum=2)
    saved = padding_saving_s(_gpt2(50257), s, h100)
    # about 0.1 s per micro-batch of 64 x 1,024 (the H200 traced 120 ms of head GEMMs, ~22 ms once aligned)
    assert 0.06 < saved / s.grad_accum < 0.15
    est = estimate(_gpt2(50257), h100, s)
    note = _note(est)
    assert note is not None and "50,304" in note and "5.4x" in note and f"{saved * 1e3:,.1f} ms" in note
    # the padded model is faster by about what the note says (its head GEMMs are the only change)
    padded = estimate(_gpt2(50304), h100, s)
    assert est.time.step_s - padded.time.step_s == pytest.approx(saved, rel=0.15)
    assert _note(padded) is None


def test_no_note_where_nothing_would_be_saved() -> None:
    h100 = Cluster(gpu=find_gpu("H100-SXM"), gpus=1, gpus_per_node=1)
    assert padding_saving_s(_gpt2(50257), Strategy(precision="fp32", engine="torch", mbs=16), h100) == 0.0
    assert padding_saving_s(_gpt2(50257), Strategy(precision="bf16", engine="megatron", mbs=16), h100) == 0.0
    assert padding_saving_s(_gpt2(32000), Strategy(precision="bf16", engine="torch", mbs=16), h100) == 0.0
    # a saving under the note's share of the step says nothing
    assert vocab_padding_notes(_gpt2(50257), Strategy(precision="bf16", engine="torch", mbs=16), h100, 1e6) == ()
