"""Expert parallelism on 2 gloo ranks (issue 19): benchmarks/fidelity_ep_cpu.py runs examples/moe.py reduced with its
experts split over two ranks and Megatron-Core's all-to-all dispatch written with torch's primitives (variable-split
``all_to_all_single`` with autograd works on gloo), routing for real; the rows it prints are asserted here."""

from __future__ import annotations

from pathlib import Path

import pytest
from factories import load_benchmark


def test_expert_parallel_ranks_hold_and_keep_what_optplan_predicts(tmp_path: Path) -> None:
    bench = load_benchmark("fidelity_ep_cpu.py")
    rows = bench.run(tmp_path)
    assert len(rows) == bench.EP * len(bench.MICRO_BATCHES)
    for r in rows:
        where = (r.rank, r.mbs)
        # each rank holds the shared weights and half the experts: expert_params_not_held, to the parameter
        assert r.params_real == r.params_pred, where
        # the routing was real (not the profile's balanced split), yet the token copies a rank computes stay near
        # the balanced tokens x topk, and its activation peak near the single-rank profile's
        assert r.received != r.balanced or r.mbs == bench.MICRO_BATCHES[0]
        assert r.act_pred == pytest.approx(r.act_real, rel=0.05), where
        assert r.act_profile == pytest.approx(r.act_real, rel=0.02), where
    assert {r.received for r in rows} != {rows[0].balanced}
