"""benchmarks/data/dgxc_nemo*_published.json (NVIDIA's DGX Cloud benchmarking recipes): every table is complete and
cited at its release's commit, every run's layout divides its GPUs and batch, and a bad layout is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import published_sets as sets
from optplan.estimators.arch import parse_arch
from optplan.estimators.hardware import find_gpu

FILES = (sets.DGXC_NEMO, sets.DGXC_NEMO_2505)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_table_is_complete_and_cited_at_its_commit(path: Path) -> None:
    doc = json.loads(path.read_text())
    release = doc["release"]
    assert len(release["commit"]) == 40 and release["tag"].startswith("v")
    for table in doc["tables"]:
        assert table["precision"] in ("bf16", "fp8")
        assert find_gpu(table.get("gpu", "H100-SXM")) is not None
        assert parse_arch(table["arch"], seq_len=table["seq"]).layers > 0
        for key in ("table", "config"):
            assert f"NVIDIA/dgxc-benchmarking/blob/{release['commit']}/" in table["source"][key], table["model"]
        assert table["runs"] and all(run["step_s"] > 0 and run["global_batch"] > 0 for run in table["runs"])


def test_release_25_05_reads_as_the_readme_tables() -> None:
    rows = sets.dgxc_nemo_rows(sets.DGXC_NEMO_2505, "dgxc-nemo-25.05")
    assert len(rows) == 24
    gb200 = [r for r in rows if r.gpu == "GB200"]
    assert len(gb200) == 18 and all(r.gpus_per_node == 72 for r in gb200)
    # Nemotron-4 340B on 128 GB200s, strong scaling: tp 8 x pp 4 gives dp 4, global batch 512 = 128 micro-batches
    strong = next(r for r in gb200 if r.label == "Nemotron-4 340B bf16 128 GB200 tp8 pp4 vpp12 gbs512")
    s = strong.strategy
    assert (s.tp, s.pp, s.vpp, s.dp, s.mbs, s.grad_accum) == (8, 4, 12, 4, 1, 128)
    assert strong.measured_s() == 32.66 and strong.seq == 4096
    # the H100 runs keep the first release's labels (no batch suffix) and its node of 8
    h100 = [r for r in rows if r.gpu == "H100-SXM"]
    assert len(h100) == 6 and all(r.gpus_per_node == 8 and "gbs" not in r.label for r in h100)


def test_a_layout_that_does_not_divide_the_gpus_is_refused(tmp_path: Path) -> None:
    doc = json.loads(sets.DGXC_NEMO_2505.read_text())
    doc["tables"] = [dict(doc["tables"][0], runs=[{"gpus": 100, "global_batch": 50, "step_s": 1.0}])]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="100 GPUs: layout does not divide"):
        sets.dgxc_nemo_rows(bad)
