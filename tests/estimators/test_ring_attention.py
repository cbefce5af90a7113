"""torch's ring attention beyond its kernels (estimators/ring_attention.py): what its transfers leave exposed. The
memory-bound bytes are checked against torch's own ring on gloo ranks in tests/probes/test_attention_heads.py."""

from __future__ import annotations

import pytest

from optplan.estimators.comm import Link, p2p_s, ring_all_gather_s
from optplan.estimators.ring_attention import ring_attention_time

SHAPE = dict(tokens_local=8192, query_heads=16, value_head_dim=128, key_heads=16, key_head_dim=128, elem_bytes=2)
SLOW = Link(bandwidth_bytes_per_s=10e9, alpha_s=15e-6, inter_node=True)
FAST = Link(bandwidth_bytes_per_s=1e15, alpha_s=0.0)


def test_no_ring_without_context_parallelism() -> None:
    one = ring_attention_time(**SHAPE, cp=1, link=SLOW, core_fwd_s=1.0, core_bwd_s=2.0)
    assert one.fwd_comm_s == one.bwd_comm_s == one.fwd_memory_bytes == one.bwd_memory_bytes == 0.0


def test_the_gather_hides_behind_one_sub_attention_only() -> None:
    cp = 4
    kv_bytes = 2 * 8192 * 16 * 128 * 2
    gather = ring_all_gather_s(cp * kv_bytes, cp, SLOW.bandwidth_bytes_per_s, SLOW.alpha_s)
    core_fwd = 2.0 * gather  # the whole attention would hide it twice over; one of its cp steps does not
    r = ring_attention_time(**SHAPE, cp=cp, link=SLOW, core_fwd_s=core_fwd, core_bwd_s=100.0)
    assert r.fwd_comm_s == pytest.approx(gather)
    assert r.fwd_exposed_s == pytest.approx(gather - core_fwd / cp)
    # a long backward hides the gather and every dK/dV step but the last, which is awaited after the loop
    dkv = p2p_s(2 * 8192 * 16 * 128 * 4, SLOW)
    assert r.bwd_exposed_s == pytest.approx(dkv)
    assert r.bwd_comm_s == pytest.approx(gather + cp * dkv)


def test_a_fast_link_leaves_only_the_bytes() -> None:
    r = ring_attention_time(**SHAPE, cp=8, link=FAST, core_fwd_s=1e-3, core_bwd_s=2e-3)
    assert r.fwd_exposed_s == pytest.approx(0.0, abs=1e-6) and r.bwd_exposed_s == pytest.approx(0.0, abs=1e-6)
    assert r.fwd_memory_bytes > 0 and r.bwd_memory_bytes > 0


def test_more_ring_steps_move_more_bytes_per_token() -> None:
    """Each later step merges the whole fp32 output again (forward) and concatenates fp32 dK/dV (backward): at the
    same tokens per rank, the bytes grow with cp."""
    by_cp = [ring_attention_time(**SHAPE, cp=c, link=FAST, core_fwd_s=0.0, core_bwd_s=0.0) for c in (2, 4, 8)]
    assert [r.fwd_memory_bytes for r in by_cp] == sorted(r.fwd_memory_bytes for r in by_cp)
    assert by_cp[0].fwd_memory_bytes < by_cp[1].fwd_memory_bytes < by_cp[2].fwd_memory_bytes
    assert by_cp[0].bwd_memory_bytes < by_cp[1].bwd_memory_bytes < by_cp[2].bwd_memory_bytes
