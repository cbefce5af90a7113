"""benchmarks/data/convnets_published.json: every row is complete, cited and self-consistent, and the benchmark's
prediction path (a timm model file, NCHW or channels-last -> profile -> estimate) runs on a small model."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import fidelity_convnets as bench

SOURCES, ROWS = bench.load()


def test_every_row_is_complete_cited_and_consistent() -> None:
    assert len(ROWS) == 46 and len({r["id"] for r in ROWS}) == len(ROWS)
    for r in ROWS:
        src = SOURCES[r["source"]]
        assert src["repo"] and src["path"] and len(src["commit"]) == 40 and src["license"]
        assert r["precision"] in ("amp-fp16", "fp32") and r["memory_format"] in ("nchw", "nhwc")
        assert r["batch_per_gpu"] > 0 and r["gpus"] in (1, 8) and r["image_size"] >= 64
        # the step time and the throughput are one measurement
        assert r["step_s"] == pytest.approx(r["batch_per_gpu"] * r["gpus"] / r["samples_per_s"], rel=0.01)
    timm = [r for r in ROWS if r["source"].startswith("timm-")]
    pairs = {(r["model"], r["memory_format"]) for r in timm}
    assert all((m, "nchw") in pairs and (m, "nhwc") in pairs for m, _ in pairs)  # every architecture both ways


def test_rows_build_their_plans() -> None:
    for r in ROWS:
        s = bench.plan(r)
        assert s.engine == "torch" and s.mbs == r["batch_per_gpu"] and s.dp == r["gpus"]
        assert bench.cluster_for(r).gpu.name == r["gpu"]


def test_a_channels_last_model_file_profiles_without_channels_first_convolutions(tmp_path: Path) -> None:
    """The model file a run's layout gets: NCHW counts its convolutions' activation bytes as channels-first, the
    channels-last twin (model and input in torch.channels_last) almost none; both price through estimate."""
    pytest.importorskip("timm")
    from optplan.probes.loader import profile_model_file

    steps = {}
    for layout in ("nchw", "nhwc"):
        path = bench.model_file(tmp_path, ("resnet18", 32, layout))
        assert f"CHANNELS_LAST = {layout == 'nhwc'}" in path.read_text(encoding="utf-8")
        prof = profile_model_file(path, seq_len=None)
        steps[layout] = (prof.eager_step or {})["amp"]
        row = {**ROWS[0], "model": "resnet18", "image_size": 32, "memory_format": layout, "batch_per_gpu": 64}
        result = bench.predict(row, prof)
        assert result.est.time.step_s > 0 and result.est.time.memory_bound_s > 0
    nchw, nhwc = steps["nchw"], steps["nhwc"]
    assert nchw.conv_flops_per_sample == pytest.approx(nhwc.conv_flops_per_sample, rel=1e-6)
    assert nchw.nchw_conv_bytes_per_sample > 0
    assert nhwc.nchw_conv_bytes_per_sample < 0.25 * nchw.nchw_conv_bytes_per_sample
