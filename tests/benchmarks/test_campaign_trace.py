"""benchmarks/campaign_trace.py's runs are cases of the fidelity suite, so that the fidelity section's probes trace
them (the GPU's runs are checked here without a GPU: they must name cases that exist, or a visit's trace section
would fail)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import campaign_trace  # noqa: E402
import fidelity  # noqa: E402
import fidelity_suite  # noqa: E402


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_traced_run_is_a_suite_case_and_quick_ones_are_quick(device: str, tmp_path: Path) -> None:
    defs = fidelity_suite.models(device, tmp_path)
    for quick in (False, True):
        runs = campaign_trace.traced(device, quick)
        assert runs and len(set(runs)) == len(runs)
        quick_cases = {(c.model, fidelity_suite.label_of(c, fidelity_suite.strategy_of(c, defs[c.model])))
                       for c in fidelity.select_cases(device, True, None)}
        for key, label in runs:
            case = campaign_trace._case(device, defs, key, label)
            assert fidelity_suite.label_of(case, fidelity_suite.strategy_of(case, defs[key])) == label
            assert case.nproc == 1  # one GPU
            if quick:
                assert (key, label) in quick_cases  # the quick fidelity suite traces it: nothing runs twice
    with pytest.raises(KeyError, match="not a case"):
        campaign_trace._case(device, defs, "mlp", "fp32 torch mbs3")


def test_the_fidelity_section_asks_for_traced_steps_on_those_runs_only(tmp_path: Path) -> None:
    from campaign_core import Campaign

    camp = Campaign(device="cuda", out=tmp_path, env={}, deadline=0.0, quick=False, gpu=None)
    steps = campaign_trace.trace_steps_for(camp)
    defs = fidelity_suite.models("cuda", tmp_path)
    asked = {(c.model, fidelity_suite.label_of(c, fidelity_suite.strategy_of(c, defs[c.model])))
             for c in fidelity.select_cases("cuda", False, None) if steps(c, defs[c.model])}
    assert asked == set(campaign_trace.TRACED["cuda"])
    assert all(steps(c, defs[c.model]) in (0, campaign_trace.TRACE_STEPS["cuda"])
               for c in fidelity.select_cases("cuda", False, None))
