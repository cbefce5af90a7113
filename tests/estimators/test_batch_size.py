"""A global batch above the largest published ones gets a note (estimators/batch_size.py), in every estimate."""

from __future__ import annotations

from optplan.estimators.arch import ArchSpec, profile_from_arch
from optplan.estimators.batch_size import LARGEST_SAMPLE_BATCH, LARGEST_TOKEN_BATCH, large_batch_note
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy


def test_the_note_fires_above_the_largest_published_batch_only() -> None:
    assert large_batch_note(15360, 4096) is None  # DeepSeek-V3's own batch
    assert large_batch_note(LARGEST_TOKEN_BATCH // 4096, 4096) is None
    note = large_batch_note(LARGEST_TOKEN_BATCH // 4096 + 1, 4096)
    assert note is not None and "(16,385 x 4,096)" in note and "critical batch size" in note
    assert large_batch_note(LARGEST_SAMPLE_BATCH, None) is None  # images: 64k on ImageNet
    note = large_batch_note(LARGEST_SAMPLE_BATCH + 1, None)
    assert note is not None and "65,537 samples per step" in note


def test_an_estimate_of_an_absurd_batch_says_so() -> None:
    prof = profile_from_arch(ArchSpec(layers=4, hidden=256, heads=4, vocab=32000, seq=4096))
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8)
    usual = estimate(prof, cluster, Strategy(dp=8, mbs=4, grad_accum=32))  # 4M tokens
    absurd = estimate(prof, cluster, Strategy(dp=8, mbs=4, grad_accum=4096))  # 537M tokens
    assert not any("global batch of" in n for n in usual.notes)
    assert any(n.startswith("global batch of 537M tokens per step") for n in absurd.notes), absurd.notes
