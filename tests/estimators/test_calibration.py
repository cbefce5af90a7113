"""Calibration applied to estimates: memory and time corrections, derived figures follow."""

from __future__ import annotations

import pytest

from optplan.estimators.calibration import CALIBRATION_DETAIL, Calibration, calibrate_memory, calibrate_time
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy

S = Strategy(precision="bf16", zero=2, mbs=4, dp=8, engine="deepspeed")


def _cal(**kw: object) -> Calibration:
    return Calibration(gpu="TestGPU", model_hash="h", **kw)  # type: ignore[arg-type]


def test_no_calibration_and_empty_calibration_change_nothing(profile: ModelProfile, cluster8: Cluster) -> None:
    raw = estimate(profile, cluster8, S)
    assert estimate(profile, cluster8, S, calibration=None) == raw
    assert estimate(profile, cluster8, S, calibration=_cal(compute_scale=2.0)) == raw  # no probes behind it


def test_time_calibration_scales_parts_and_throughput(profile: ModelProfile, cluster8: Cluster) -> None:
    raw = estimate(profile, cluster8, S)
    cal = _cal(compute_scale=1.25, comm_scale=2.0, time_probes=1)
    got = estimate(profile, cluster8, S, calibration=cal)
    t0, t1 = raw.time, got.time
    assert t1.compute_s == pytest.approx(1.25 * t0.compute_s)
    assert t1.exposed_comm_s == pytest.approx(2.0 * t0.exposed_comm_s)
    on_device = t0.step_s - t0.exposed_comm_s
    assert t1.step_s == pytest.approx(1.25 * on_device + 2.0 * t0.exposed_comm_s)
    ratio = t0.step_s / t1.step_s
    assert got.samples_per_s == pytest.approx(raw.samples_per_s * ratio)
    assert got.mfu == pytest.approx(raw.mfu * ratio)
    assert got.tokens_per_s == pytest.approx(raw.tokens_per_s * ratio)
    assert got.memory == raw.memory  # time-only calibration
    assert any("calibrated on TestGPU" in n for n in got.notes)


def test_a_time_scale_past_the_gpus_peak_is_not_applied(profile: ModelProfile, cluster8: Cluster) -> None:
    """A compute scale that would run the plan faster than the GPU's peak FLOP/s (a cache entry from an edited or
    foreign file once gave 16,487 % MFU) leaves the time as predicted, and the note says why."""
    raw = estimate(profile, cluster8, S)
    scale = 0.5 * raw.time.hfu  # the calibrated HFU would be ~2x 100 %
    got = estimate(profile, cluster8, S, calibration=_cal(compute_scale=scale, time_probes=1))
    assert got.time == raw.time and got.mfu == raw.mfu and got.mfu <= 1.0
    note = next(n for n in got.notes if n.startswith("calibrated on TestGPU"))
    assert "not the time: compute × " in note and "of the GPU's peak FLOP/s" in note, note


def test_memory_calibration_replaces_overhead_and_can_flip_fit(profile: ModelProfile, cluster8: Cluster) -> None:
    raw = estimate(profile, cluster8, S)
    m0 = raw.memory
    allocated = m0.total_bytes - m0.overhead_bytes
    cal = _cal(allocated_scale=1.1, fragmentation_fraction=0.02, context_bytes=600 * 2**20, memory_probes=2)
    m1 = calibrate_memory(m0, cal)
    assert m1.detail_bytes[CALIBRATION_DETAIL] == round(0.1 * allocated)
    assert m1.detail_bytes["cuda_context"] == 600 * 2**20 != m0.detail_bytes["cuda_context"]
    assert m1.total_bytes == pytest.approx(allocated * 1.1 * 1.02 + 600 * 2**20, abs=2)
    assert (m1.params_bytes, m1.activations_bytes) == (m0.params_bytes, m0.activations_bytes)
    # a big enough correction makes a fitting plan not fit, and the reason says so
    huge = _cal(allocated_scale=(m0.capacity_bytes / allocated) * 1.5, memory_probes=1)
    got = estimate(profile, cluster8, S, calibration=huge)
    assert raw.fits and not got.fits and got.reason.startswith("does not fit")


def test_calibrate_time_is_identity_at_unit_scales(profile: ModelProfile, cluster8: Cluster) -> None:
    t0 = estimate(profile, cluster8, S).time
    t1 = calibrate_time(t0, _cal(time_probes=3))
    assert t1.step_s == pytest.approx(t0.step_s)
    assert t1.samples_per_s == pytest.approx(t0.samples_per_s)


def test_calibration_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        _cal(compute_scale=0)
    with pytest.raises(ValueError):
        _cal(fragmentation_fraction=-0.1)
