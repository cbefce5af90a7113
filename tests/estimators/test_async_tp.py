"""torch's async tensor parallelism (estimators/async_tp.py): each forward pass's collectives, and the forward that
full recomputation re-runs, hide a measured share behind their matmuls; backward's stay exposed."""

from __future__ import annotations

import pytest

from optplan.estimators.async_tp import ASYNC_TP_HIDDEN_SHARE, async_tp_hidden_s
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from tests.factories import make_profile

H100 = find_gpu("H100-SXM")
NODE = Cluster(gpu=H100, gpus=8, gpus_per_node=8)


def _plan(**kw: object) -> Strategy:
    data: dict[str, object] = {"precision": "bf16", "engine": "torch", "fsdp": "full", "mbs": 4, "tp": 4, "dp": 2,
                               "sp": True, "compile": True, **kw}
    return Strategy.model_validate(data)


def test_the_hidden_part_is_the_measured_share_of_what_the_gemms_cover() -> None:
    assert async_tp_hidden_s(1.0, 5.0) == pytest.approx(ASYNC_TP_HIDDEN_SHARE)
    assert async_tp_hidden_s(1.0, 0.5) == pytest.approx(ASYNC_TP_HIDDEN_SHARE * 0.5)  # no GEMM left to hide behind
    assert async_tp_hidden_s(0.0, 5.0) == 0.0 and async_tp_hidden_s(1.0, 0.0) == 0.0


def test_forward_passes_hide_part_of_their_collectives_and_backward_none() -> None:
    profile = make_profile()

    def tp_comm_s(**kw: object) -> float:
        return estimate(profile, NODE, _plan(**kw)).time.tp_comm_s

    # no checkpointing: one forward pass hides; full recomputation re-runs the forward, whose collectives hide too
    saved_plain = tp_comm_s(checkpointing="none") - tp_comm_s(checkpointing="none", async_tp=True)
    saved_full = tp_comm_s(checkpointing="full") - tp_comm_s(checkpointing="full", async_tp=True)
    assert saved_plain > 0 and saved_full == pytest.approx(2 * saved_plain, rel=1e-9)
    # the all-gathers per-op selective AC issues again in backward are not fused: the same saving as none
    saved_sel = tp_comm_s(checkpointing="selective") - tp_comm_s(checkpointing="selective", async_tp=True)
    assert saved_sel == pytest.approx(saved_plain, rel=1e-9)
    # what it saves is at most the share of one forward's collectives: half the no-checkpointing total (fwd + bwd)
    total = tp_comm_s(checkpointing="none")
    assert saved_plain <= ASYNC_TP_HIDDEN_SHARE * total / 2 + 1e-12
    fused = estimate(profile, NODE, _plan(async_tp=True))
    assert fused.strategy.label().count("async-tp") == 1
    assert any("async TP" in o for o in fused.time.outside_measured)  # says how sure its saving is
    assert not any("async TP" in o for o in estimate(profile, NODE, _plan()).time.outside_measured)
    assert fused.memory == estimate(profile, NODE, _plan()).memory


@pytest.mark.parametrize(("kw", "words"), [
    ({"engine": "megatron", "fsdp": "none", "compile": False}, "--async-tp is torch's"),
    ({"tp": 1, "dp": 8, "sp": False}, "--async-tp is torch's"),
    ({"sp": False}, "add --sp and --compile"),
    ({"compile": False}, "add --sp and --compile"),
])
def test_it_needs_torch_tensor_parallelism_sequence_parallel_and_compiled(kw: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        _plan(async_tp=True, **kw)


def test_it_runs_inside_one_nvlink_node() -> None:
    two_nodes = Cluster(gpu=H100, gpus=8, gpus_per_node=2)
    with pytest.raises(OptplanError, match="inside one node"):
        estimate(make_profile(), two_nodes, _plan(async_tp=True))
