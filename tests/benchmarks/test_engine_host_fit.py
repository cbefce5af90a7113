"""benchmarks/fit_engine_host.py's ``--write``: it edits estimators/data/efficiency.yaml in place, so a slip would
corrupt the time model's table. Written to a copy: the multiplier and its source land in the DeepSpeed block alone,
and the table still validates."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks import fit_engine_host as fitter
from optplan.estimators.efficiency import EfficiencyTable


def test_write_sets_deepspeed_s_multiplier_and_keeps_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "efficiency.yaml"
    table.write_text(fitter.TABLE.read_text(encoding="utf-8"), encoding="utf-8")
    before = yaml.safe_load(table.read_text())
    monkeypatch.setattr(fitter, "TABLE", table)
    fitter.write(3.1, 7, 40.0, 12.5)
    fitter.write(3.2, 8, 41.0, 12.0)  # twice: the earlier line is replaced, not repeated
    text = table.read_text()
    after = yaml.safe_load(text)
    EfficiencyTable(**after)  # still the table efficiency.py reads
    ds = after["engines"]["deepspeed"]
    assert ds["host_multiplier"] == 3.2 and text.count("host_multiplier:") == 1
    assert "fit_engine_host.py on 8 DeepSpeed runs" in ds["source"] and "41.0% -> 12.0%" in ds["source"]
    for key in ("elementwise_multiplier", "eager", "compile_multiplier", "overlap_interference"):
        assert ds[key] == before["engines"]["deepspeed"][key]
    assert after["engines"]["torch"] == before["engines"]["torch"]
    assert after["engines"]["megatron"] == before["engines"]["megatron"]
    assert after["gpus"] == before["gpus"] and after.get("stacks") == before.get("stacks")
