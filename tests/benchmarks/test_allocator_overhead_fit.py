"""The allocator margin and the context optplan predicts are the ones the committed GPU runs measured:
``estimators/data/allocator_overhead.yaml`` is what ``benchmarks/fit_allocator_overhead.py`` computes from
``benchmarks/results/`` (so neither can drift from the other), and the fit itself picks, groups and summarises
runs as its docstring says."""

from __future__ import annotations

import yaml

from benchmarks import fit_allocator_overhead as fitter
from optplan.estimators.allocator_overhead import allocator_overhead

GIB = 2**30


def test_the_packaged_table_is_the_fit_of_the_committed_runs() -> None:
    runs = fitter.runs_from([fitter.RESULTS])
    assert len(runs) >= 28 and len({r.key for r in runs}) == len(runs)  # each distinct run once
    packaged = yaml.safe_load(fitter.DATA.read_text(encoding="utf-8"))
    fitted = fitter.fit(runs, source=fitter.source_of(runs, [fitter.RESULTS]))
    assert fitted == packaged, "rerun: python benchmarks/fit_allocator_overhead.py --write"
    table = allocator_overhead()
    assert set(table.margin) == {"recompute", "none"} and set(table.context_bytes) == {"one_process", "process_group"}


def _run(key: str, margin_class: str, allocated_gib: float, margin: float, context_gib: float | None,
         context_class: str = "one_process") -> fitter.Run:
    return fitter.Run(key=key, margin_class=margin_class, context_class=context_class,
                      allocated_bytes=allocated_gib * GIB, reserved_bytes=allocated_gib * GIB * (1 + margin),
                      non_torch_bytes=None if context_gib is None else context_gib * GIB)


def test_the_fit_takes_medians_per_class_and_leaves_tiny_runs_out_of_the_margin() -> None:
    runs = [_run("a", "none", 10, 0.02, 0.75), _run("b", "none", 12, 0.10, 0.75),
            _run("c", "none", 8, 0.30, 1.25, "process_group"),
            _run("d", "recompute", 20, 0.15, None),
            _run("tiny", "none", 0.1, 0.90, 0.73)]  # under 1 GiB: its margin is the allocator's granularity
    doc = fitter.fit(runs, source="test")
    assert doc["margin"]["none"]["median"] == 0.10 and doc["margin"]["none"]["runs"] == 3
    assert doc["margin"]["none"]["low"] < 0.10 < doc["margin"]["none"]["high"] <= 0.30
    assert doc["margin"]["recompute"] == {"median": 0.15, "low": 0.15, "high": 0.15, "runs": 1}
    assert doc["context_bytes"]["one_process"]["runs"] == 3  # the tiny run's context counts
    assert doc["context_bytes"]["one_process"]["median"] == int(0.75 * GIB)
    assert doc["context_bytes"]["process_group"]["median"] == int(1.25 * GIB)


def test_the_script_prints_its_summary_line(capsys) -> None:  # type: ignore[no-untyped-def]
    assert fitter.main([]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("allocator overhead: margin ") and "(recompute, " in last and "process group" in last
