"""The probe stage: calibration fit, cache, budget, pruning, Optuna recording and re-ranking.

These tests drive the stage with a fake probe runner (what a GPU would measure is made up from the
estimate, with known ratios), so the planner logic is checked exactly; tests/probes runs real probes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest
from conftest import make_gpu, make_profile

from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.strategy import Strategy
from optplan.planner.calibrate import (
    ProbeComparison,
    fit_calibration,
    load_calibration,
    profile_hash,
    save_calibration,
    torch_version,
)
from optplan.planner.probe_stage import (
    LocalDevices,
    ProbeOptions,
    cached_calibration,
    measured_cluster,
    probe_strategy,
    run_probe_stage,
)
from optplan.planner.recommend import recommend
from optplan.probes.runtime import ProbeResult, ProbeSpec

GPU = make_gpu()
PROFILE = make_profile()
CLUSTER = Cluster(gpu=GPU, gpus=8, gpus_per_node=8)
CUDA = LocalDevices(device="cuda", name="Test GPU 80GB", count=8, catalogue_name="TestGPU")
TIME_RATIO = 1.3
MEMORY_RATIO = 1.04


def _predicted(spec: ProbeSpec) -> Any:
    n = spec.strategy.world_size
    return estimate(PROFILE, CLUSTER.model_copy(update={"gpus": n, "gpus_per_node": min(8, n)}), spec.strategy)


class FakeRunner:
    """Measures TIME_RATIO x the predicted step and MEMORY_RATIO x the predicted allocated bytes; strategies
    whose label is in ``fail`` get that status."""

    def __init__(self, fail: dict[str, str] | None = None) -> None:
        self.fail = fail or {}
        self.specs: list[ProbeSpec] = []

    def __call__(self, spec: ProbeSpec, *, timeout_s: float = 300.0) -> ProbeResult:
        self.specs.append(spec)
        label = spec.strategy.label()
        est = _predicted(spec)
        samples = spec.strategy.mbs * spec.strategy.grad_accum * spec.nproc
        if label in self.fail:
            return ProbeResult(spec=spec, status=self.fail[label], reason=f"fake {self.fail[label]}",  # type: ignore[arg-type]
                               world_size=spec.nproc, samples_per_step=samples)
        step = est.time.step_s * TIME_RATIO
        allocated = est.memory.total_bytes - est.memory.overhead_bytes
        return ProbeResult(spec=spec, status="ok", world_size=spec.nproc, step_times_s=(step,) * 3, step_s=step,
                           step_spread_s=0.0, peak_allocated_bytes=round(allocated * MEMORY_RATIO),
                           peak_reserved_bytes=round(allocated * MEMORY_RATIO * 1.03), non_torch_bytes=500 * 2**20,
                           losses=(2.0, 1.9, 1.8), samples_per_step=samples, device_name="Test GPU 80GB")


def _comparison(step_pred: float, on_device: float, comm: float, measured: float, mem_pred: int = 10**9,
                mem_meas: int | None = 11 * 10**8, status: str = "ok", comparable: bool = True) -> ProbeComparison:
    s = Strategy(engine="torch", dp=2, mbs=2)
    spec = ProbeSpec(model_path="m.py", strategy=s, device="cuda", nproc=2)
    result = ProbeResult(spec=spec, status=status, world_size=2, step_s=measured if status == "ok" else None,  # type: ignore[arg-type]
                         step_times_s=(measured,) if status == "ok" else (), peak_allocated_bytes=mem_meas,
                         peak_reserved_bytes=None if mem_meas is None else round(mem_meas * 1.1),
                         non_torch_bytes=600 * 2**20, samples_per_step=8)
    return ProbeComparison(candidate=s, probed=s, predicted_step_s=step_pred, predicted_on_device_s=on_device,
                           predicted_exposed_comm_s=comm, predicted_allocated_bytes=mem_pred,
                           predicted_total_bytes=mem_pred, time_comparable=comparable, result=result)


# --- the fit ---------------------------------------------------------------------------------------------

def test_fit_separates_compute_from_communication() -> None:
    quiet = [_comparison(1.0, 1.0, 0.0, 1.2), _comparison(2.0, 2.0, 0.0, 2.4), _comparison(1.0, 1.0, 0.0, 1.25)]
    loud = [_comparison(1.5, 1.0, 0.5, 1.2 + 0.5 * 3.0)]  # comm measured 3x the prediction
    cal = fit_calibration(quiet + loud, gpu="TestGPU", model_hash="h", torch_version="2.x")
    assert cal is not None
    assert cal.compute_scale == pytest.approx(1.2)  # the median of 1.2, 1.2, 1.25
    assert cal.comm_scale == pytest.approx(3.0)
    assert cal.allocated_scale == pytest.approx(1.1)
    assert cal.fragmentation_fraction == pytest.approx(0.1, abs=1e-6)
    assert cal.context_bytes == 600 * 2**20
    assert (cal.time_probes, cal.memory_probes) == (4, 4)


def test_fit_ignores_failed_probes_and_off_target_times() -> None:
    cpu = [_comparison(1.0, 1.0, 0.0, 9.0, comparable=False)]
    failed = [_comparison(1.0, 1.0, 0.0, 5.0, status="oom", mem_meas=None)]
    cal = fit_calibration(cpu + failed, gpu="cpu", model_hash="h")
    assert cal is not None and not cal.calibrates_time and cal.compute_scale == 1.0
    assert cal.memory_probes == 1
    assert fit_calibration(failed, gpu="cpu", model_hash="h") is None


def test_implausible_runs_are_left_out_of_the_fit_and_said_so() -> None:
    """A run 10^6 x faster than predicted (an edited file, another device) once became "compute x 0.000" and a plan
    at 16,487 % MFU; runs outside TIME_RATIO_BOUNDS / MEMORY_RATIO_BOUNDS are now left out, and the source says so."""
    good = _comparison(1.0, 1.0, 0.0, 1.3)
    tiny = _comparison(1.0, 1.0, 0.0, 1e-6)
    huge = _comparison(1.0, 1.0, 0.0, 1e6, mem_meas=50 * 10**9)  # 50x the predicted memory too
    cal = fit_calibration([good, tiny, huge], gpu="TestGPU", model_hash="h")
    assert cal is not None and cal.compute_scale == pytest.approx(1.3) and cal.time_probes == 1
    assert cal.allocated_scale == pytest.approx(1.1) and cal.memory_probes == 2
    assert "2 run(s) left out of time: measured/predicted 1e-06-1e+06, outside 0.1-10" in cal.source, cal.source
    assert "1 run(s) left out of memory: measured/predicted 50-50, outside 0.5-2" in cal.source
    only_bad = fit_calibration([tiny], gpu="TestGPU", model_hash="h")
    assert only_bad is not None and not only_bad.calibrates_time and only_bad.compute_scale == 1.0
    # a reserved peak below the allocated one cannot be: no fragmentation margin from it
    odd = _comparison(1.0, 1.0, 0.0, 1.3)
    odd = odd.model_copy(update={"result": odd.result.model_copy(update={"peak_reserved_bytes": 100})})
    assert fit_calibration([odd], gpu="TestGPU", model_hash="h").fragmentation_fraction is None  # type: ignore[union-attr]


def test_cache_round_trip_keeps_other_entries_and_rejects_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "calibration.json"
    a = fit_calibration([_comparison(1.0, 1.0, 0.0, 1.5)], gpu="A", model_hash="m", torch_version="t")
    b = fit_calibration([_comparison(1.0, 1.0, 0.0, 0.5)], gpu="B", model_hash="m", torch_version="t")
    assert a is not None and b is not None
    save_calibration(a, path=path)
    save_calibration(b, path=path)
    assert load_calibration("A", "m", "t", path=path) == a
    assert load_calibration("B", "m", "t", path=path) == b
    assert load_calibration("A", "m", "other torch", path=path) is None
    assert not list(path.parent.glob(".calibration-*"))  # no temp file left
    path.write_text("[1, 2]")
    with pytest.raises(OptplanError, match="not an optplan calibration file.*delete it"):
        load_calibration("A", "m", "t", path=path)


def test_a_calibration_follows_the_model_when_its_file_moves(tmp_path: Path) -> None:
    """The key leaves out the file's path and name (a results file measured on another machine, a moved file, an
    --hf model generated in another cache folder); entries stored under the older path-bound key are still found."""
    profile = make_profile()
    moved = profile.model_copy(update={"path": "/elsewhere/renamed.py", "name": "renamed"})
    changed = profile.model_copy(update={"params": profile.params + 1})
    assert profile_hash(moved) == profile_hash(profile) != profile_hash(changed)
    assert profile_hash(moved, with_identity=True) != profile_hash(profile, with_identity=True)
    cluster = Cluster(gpu=make_gpu(), gpus=1, gpus_per_node=1)
    path = tmp_path / "calibration.json"
    cal = fit_calibration([_comparison(1.0, 1.0, 0.0, 1.5)], gpu=cluster.gpu.name, model_hash=profile_hash(profile),
                          torch_version=torch_version())
    assert cal is not None
    save_calibration(cal, path=path)
    assert cached_calibration(moved, cluster, path=path) == cal
    assert cached_calibration(changed, cluster, path=path) is None
    legacy = cal.model_copy(update={"model_hash": profile_hash(moved, with_identity=True)})
    path.unlink()
    save_calibration(legacy, path=path)
    assert cached_calibration(moved, cluster, path=path) == legacy
    assert cached_calibration(profile, cluster, path=path) is None  # the old key was bound to the other path


# --- the stage -------------------------------------------------------------------------------------------

def _ranked() -> list[Any]:
    from optplan.planner.goal import Goal
    from optplan.planner.search import search
    from optplan.planner.space import build_space

    space = build_space(PROFILE, CLUSTER, global_batch=64, engines=("deepspeed", "torch"), offload=False)
    return list(search(PROFILE, CLUSTER, space, goal=Goal()).ranked)


def test_probe_strategy_scales_to_local_devices() -> None:
    s = Strategy(engine="torch", fsdp="hybrid", dp=16, mbs=8, grad_accum=16)
    probed, why = probe_strategy(s, LocalDevices(device="cuda", name="x", count=8))
    assert why == "" and probed is not None
    assert (probed.dp, probed.mbs, probed.grad_accum) == (8, 8, 4)
    cpu, _ = probe_strategy(s, LocalDevices(device="cpu", name="cpu", count=1))
    assert cpu is not None and (cpu.dp, cpu.mbs, cpu.grad_accum, cpu.fsdp) == (1, 1, 1, "full")
    none, why = probe_strategy(Strategy(engine="megatron", tp=2, dp=4), CUDA)
    assert none is None and "Megatron" in why


def test_stage_calibrates_prunes_records_and_resumes(tmp_path: Path) -> None:
    ranked = _ranked()
    feasible = [e for e in ranked if e.fits]
    runner = FakeRunner(fail={feasible[1].strategy.label(): "oom"})
    storage = tmp_path / "study.log"
    options = ProbeOptions(top_k=3, cache_path=tmp_path / "cal.json")
    report = run_probe_stage(PROFILE, CLUSTER, ranked, options=options, local=CUDA, storage=storage,
                             study_name="s", runner=runner)
    assert report.time_comparable and len(report.probed) == 3 and len(runner.specs) == 3
    assert [c.result.status for c in report.probed] == ["ok", "oom", "ok"]
    assert runner.specs[0].stop_if_step_slower_than_s is None  # nothing measured yet
    assert runner.specs[2].stop_if_step_slower_than_s is not None  # pruning threshold from the best so far
    cal = report.calibration
    assert cal is not None and cal.compute_scale == pytest.approx(TIME_RATIO, rel=0.02)
    assert cal.allocated_scale == pytest.approx(MEMORY_RATIO, rel=1e-3)
    assert load_calibration(cal.gpu, cal.model_hash, cal.torch_version, path=tmp_path / "cal.json") == cal
    study = optuna.load_study(study_name="s-probes", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(storage))))
    assert study.user_attrs["calibration"] == cal.model_dump(mode="json")
    states = sorted(t.state.name for t in study.trials)
    assert states == ["COMPLETE", "COMPLETE", "FAIL"]
    again = FakeRunner()
    report2 = run_probe_stage(PROFILE, CLUSTER, ranked, options=options, local=CUDA, storage=storage,
                              study_name="s", runner=again)
    assert again.specs == [] and report2.reused == 3  # nothing probed twice


def test_stage_respects_the_budget(tmp_path: Path) -> None:
    ranked = _ranked()
    options = ProbeOptions(top_k=3, budget_s=1.0, use_cache=False)  # below the minimum for one probe
    runner = FakeRunner()
    report = run_probe_stage(PROFILE, CLUSTER, ranked, options=options, local=CUDA, runner=runner)
    assert runner.specs == [] and report.probed == ()
    assert len(report.skipped) == 3 and all("budget" in s for s in report.skipped)


def test_cpu_probes_report_but_do_not_rerank(tmp_path: Path) -> None:
    cpu = LocalDevices(device="cpu", name="cpu", count=1)
    runner = FakeRunner()
    rec0 = recommend(PROFILE, CLUSTER, global_batch=64, offload=False)
    rec = recommend(PROFILE, CLUSTER, global_batch=64, offload=False, probe=ProbeOptions(top_k=2, use_cache=False),
                    probe_local=cpu, probe_runner=runner)
    assert rec.probes is not None and not rec.probes.time_comparable
    assert all(s.device == "cpu" and s.strategy.mbs == 1 for s in runner.specs)
    assert rec.plan == rec0.plan and rec.estimate == rec0.estimate
    assert any(line.startswith("probes: 2 candidate(s)") and "ranking stays analytic" in line for line in rec.rationale)


def test_recommend_picks_by_measured_figures_and_drops_failures(tmp_path: Path) -> None:
    rec0 = recommend(PROFILE, CLUSTER, global_batch=64, offload=False)
    first = rec0.plan
    assert first is not None
    runner = FakeRunner(fail={first.label(): "oom"})
    calls: list[dict[str, Any]] = []

    def bench(**kw: Any) -> Any:
        from optplan.probes.microbench import MicrobenchResult
        calls.append(kw)
        return MicrobenchResult(device="cuda", device_name="Test GPU", torch_version="t",
                                matmul_flops_per_s={"bf16": 500e12}, copy_bytes_per_s=1.5e12)

    rec = recommend(PROFILE, CLUSTER, global_batch=64, offload=False,
                    probe=ProbeOptions(top_k=3, cache_path=tmp_path / "c.json"), probe_local=CUDA,
                    probe_runner=runner, probe_bench=bench)
    assert calls and calls[0]["device"] == "cuda"
    assert any(n.startswith("measured: bf16 matmul") for n in rec.notes)
    assert rec.plan is not None and rec.plan != first  # the measured OOM is not picked
    assert rec.probes is not None and rec.calibration is not None
    assert any(line.startswith("dropped ") and "oom" in line for line in rec.rationale)
    assert any("calibrated on TestGPU" in n for n in rec.estimate.notes)  # type: ignore[union-attr]
    json.dumps(rec.model_dump(mode="json"))  # the --json document


def test_measured_cluster_only_for_the_planned_gpu() -> None:
    def bench(**_kw: Any) -> Any:
        raise AssertionError("must not run off the planned GPU")

    other = LocalDevices(device="cuda", name="A100", count=8, catalogue_name="A100-80GB")
    assert measured_cluster(CLUSTER, other, bench=bench) == (CLUSTER, [])
    assert measured_cluster(CLUSTER, LocalDevices(device="cpu", name="c", count=1), bench=bench) == (CLUSTER, [])


def test_fields_added_later_leave_the_calibration_key_of_profiles_without_them_as_it_was() -> None:
    """A model that checkpoints itself hashes apart; every other profile keeps the key it had before the field existed
    (the train.py goldens pin one such key), so calibrations already measured still apply."""
    import hashlib
    import json

    from optplan.planner.calibrate import IDENTITY_FIELDS, NUMERICS_FIELDS, RUN_FIELDS

    profile = make_profile()
    skip: dict[str, object] = {name: True for name in (*RUN_FIELDS, *IDENTITY_FIELDS, "adapter", "tensor_plan",
                                                       "sparse_grad_params", "self_recompute_flops_per_sample",
                                                       "attention_key_heads")}
    skip["transformer"] = {"head_dim", "moe", "mla", *NUMERICS_FIELDS}
    before = hashlib.sha256(json.dumps(profile.model_dump(mode="json", exclude=skip), sort_keys=True,
                                       default=str).encode()).hexdigest()[:16]
    assert profile_hash(profile) == before
    own = profile.model_copy(update={"self_recompute_flops_per_sample": 1e9})
    assert profile_hash(own) != profile_hash(profile)
    # the heads the attention call receives (a profile of a model file records them) never change the key
    assert profile_hash(profile.model_copy(update={"attention_key_heads": 12})) == before
