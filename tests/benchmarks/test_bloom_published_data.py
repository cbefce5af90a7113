"""benchmarks/data/bigscience_bloom_published.json: every run is cited at the commit and line it was read from, its
layout fills the 384 GPUs, and the loader prices it as the run was launched."""

from __future__ import annotations

import json

from benchmarks import published_sets as sets

DOC = json.loads(sets.BLOOM.read_text())


def test_every_run_is_complete_and_cited() -> None:
    commit = DOC["release"]["commit"]
    assert len(commit) == 40 and len(DOC["runs"]) == 18
    for run in DOC["runs"]:
        assert run["dp"] * run["tp"] * run["pp"] == 384
        assert f"bigscience-workshop/bigscience/blob/{commit}/train/tr11-176B-ml/" in run["source"]
        assert "#L" in run["source"] and run["step_s"] > 90
        assert run["hidden"] % run["heads"] == 0
    # the production run: BLOOM-176B as trained (70 layers, 14,336 hidden, 112 heads, tp 4, pp 12, mbs 2)
    prod = DOC["runs"][-1]
    assert (prod["layers"], prod["hidden"], prod["heads"], prod["step_s"]) == (70, 14336, 112, 105.22)


def test_rows_keep_the_launch_layout() -> None:
    rows = sets.bloom_rows()
    assert len(rows) == 18
    s = rows[-1].strategy
    assert (s.tp, s.pp, s.dp, s.mbs, s.grad_accum, s.zero) == (4, 12, 8, 2, 128, 1)
    assert s.checkpointing == "full" and not s.flash and not s.sp and not s.comm_overlap and s.vpp == 1
    assert rows[-1].arch.endswith("vocab=250880,ffn=57344,gated=0,tied=1")
    assert all(r.gpus_per_node == 8 and r.nic_bytes_per_s == 6.25e9 for r in rows)
