"""The balanced pipeline layout: layer counts per virtual stage and rank, and the uneven-split caveat."""

from __future__ import annotations

import pytest

from optplan.estimators.parallel import layers_per_stage
from optplan.estimators.pipeline_layout import is_even, rank_layers, stage_layers, uneven_split_note


@pytest.mark.parametrize("layers, pp, vpp", [(80, 4, 5), (61, 8, 4), (94, 8, 4), (94, 32, 3), (61, 16, 1),
                                             (7, 3, 2), (12, 8, 1), (13, 4, 3)])
def test_every_layer_placed_and_busiest_rank_is_the_priced_ceiling(layers, pp, vpp):
    stages = stage_layers(layers, pp, vpp)
    assert len(stages) == pp * vpp and sum(stages) == layers
    assert max(stages) - min(stages[1:-1] or stages) <= 1  # interior stages balanced to one layer
    ranks = rank_layers(layers, pp, vpp)
    assert sum(ranks) == layers
    assert max(ranks) == layers_per_stage(layers, pp)  # what timing and memory price
    assert max(ranks) - min(ranks) <= 1 + (1 if layers < pp * vpp else 0)


def test_ends_keep_the_base_count_and_may_hold_only_embedding_and_loss():
    # DeepSeek-V3-like: 61 layers over 32 virtual stages: the embedding's and the loss's stages are the light ones
    stages = stage_layers(61, 8, 4)
    assert stages[0] == 1 and stages[-1] == 1 and stages[1:30] == (2,) * 29 and stages[30] == 1
    # Qwen3-235B on pp 32 x vpp 3 (96 stages for 94 layers): E-only and L-only stages, as Megatron's model zoo runs
    assert stage_layers(94, 32, 3) == (0,) + (1,) * 94 + (0,)
    with pytest.raises(ValueError, match="cannot fill"):
        stage_layers(61, 16, 4)


def test_note_only_for_uneven_splits():
    assert uneven_split_note(80, 4, 5) is None and is_even(80, 4, 5)
    assert uneven_split_note(80, 1) is None
    note = uneven_split_note(61, 8, 4)
    assert note is not None and "7-8 layers" in note and "--pipeline-model-parallel-layout" in note
    torch = uneven_split_note(126, 8, 2, engine="torch")
    assert torch is not None and "15-16 layers" in torch and "torch.distributed.pipelining" in torch


def test_uneven_interleaving_is_priced_with_its_smaller_bubble():
    """61 layers on pp 8: the interleaved (custom-layout) plan's bubble is the 1F1B one ÷ vpp, the busiest rank's
    work the same ceil(61/8) = 8 layers."""
    from optplan.estimators.arch import parse_arch, profile_from_arch
    from optplan.estimators.hardware import Cluster, find_gpu
    from optplan.estimators.strategy import Strategy
    from optplan.estimators.timing import step_time
    from optplan.estimators.validity import check_strategy

    profile = profile_from_arch(parse_arch("layers=61,hidden=2048,heads=16,seq=4096"))
    cluster = Cluster(gpu=find_gpu("H100"), gpus=16, gpus_per_node=8)
    plain = Strategy(engine="megatron", pp=8, dp=2, grad_accum=16)
    inter = plain.model_copy(update={"vpp": 4})
    check_strategy(profile, cluster, inter)  # legal on Megatron: the layout places it
    t1, t4 = step_time(profile, plain, cluster), step_time(profile, inter, cluster)
    assert t4.bubble_s == pytest.approx(t1.bubble_s / 4, rel=0.05)
    assert t4.compute_s == pytest.approx(t1.compute_s)
