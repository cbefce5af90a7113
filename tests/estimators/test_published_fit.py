"""The committed time constants against the given measured sets (benchmarks/published_sets.py): each GPU's
held-out MAPE within issue 15's targets, the multi-node and long-sequence rows no longer systematically off,
and the committed measured domain (estimators/data/time_domain.yaml) what the benchmark writes today."""

from __future__ import annotations

import importlib.util
import itertools
import statistics
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):  # noqa: ANN202 - a benchmark module
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sets():  # noqa: ANN201
    return _load("published_sets")


@pytest.fixture(scope="module")
def foundry(sets):  # noqa: ANN001, ANN201
    rows = sets.llmfoundry_rows()
    assert len(rows) == 191
    return rows


def _mape(rows) -> float:  # noqa: ANN001
    return statistics.fmean(abs(r.ratio() - 1) for r in rows)


@pytest.mark.parametrize("gpu", ["H100-SXM", "A100-80GB", "A100-40GB"])
def test_held_out_mape_per_gpu_is_single_digit(sets, foundry, gpu) -> None:  # noqa: ANN001
    _, held = sets.split(foundry)
    rows = [r for r in held if r.gpu == gpu]
    assert len(rows) >= 25
    assert _mape(rows) <= 0.10


def test_multi_node_fsdp_and_long_sequences_are_not_systematically_off(foundry) -> None:  # noqa: ANN001
    # before: 13B on 16-64 H100 at mbs 2 predicted 5x too slow; 32K-64K tokens about 2x too fast
    multi = [r.ratio() for r in foundry if r.strategy.world_size > 8]
    long = [r.ratio() for r in foundry if (r.profile.tokens_per_sample or 0) >= 32768]
    assert len(multi) >= 20 and len(long) >= 10
    assert 0.9 <= statistics.median(multi) <= 1.1 and max(multi) < 1.35
    assert 0.85 <= statistics.median(long) <= 1.15 and min(long) > 0.7


def test_vtrain_held_out_within_target(sets) -> None:  # noqa: ANN001
    rows = sets.vtrain_rows()
    _, held = sets.split(rows)
    assert _mape(held) <= 0.06


@pytest.mark.parametrize(("name", "runs", "limit"), [("narayanan-table1", 10, 0.06),
                                                     ("korthikanti-table5", 8, 0.05)])
def test_megatron_paper_tables_never_fitted_on_stay_close(sets, name, runs, limit) -> None:  # noqa: ANN001
    # Narayanan et al. 2021 Table 1 (1.7B-1T on 32-3,072 A100s) and Korthikanti et al. 2022 Table 5 (full vs
    # selective recompute with sequence parallelism): out of sample for every fit. Issue 15's target for
    # Table 1 is 5 % (a benchmark figure: 5.2 % today, micro-batch 1 assumed); the test keeps it from drifting.
    rows = [r for r in sets.paper_rows() if r.set == name]
    assert len(rows) == runs
    assert _mape(rows) <= limit
    assert all(0.85 < r.ratio() < 1.15 for r in rows)
    if name == "korthikanti-table5":  # the ~24 % saving of selective recompute + SP is priced, not just the level
        full = {r.label.split(" full")[0]: r for r in rows if "full recompute" in r.label}
        for r in rows:
            if "selective" in r.label:
                f = full[r.label.split(" sequence")[0]]
                saved, measured_saved = 1 - r.time().step_s / f.time().step_s, 1 - r.measured_s / f.measured_s
                assert saved == pytest.approx(measured_saved, abs=0.06), r.label


def test_the_committed_domain_is_what_the_benchmark_writes(sets) -> None:  # noqa: ANN001
    bench = _load("fidelity_published")
    rows = sets.all_rows() + _load("fidelity_torchtitan").domain_rows()
    committed = yaml.safe_load((ROOT / "estimators" / "data" / "time_domain.yaml").read_text())["sets"]
    # the GPU campaign's sets (benchmarks/results) need torch to re-profile: tests/benchmarks/test_gpu_results.py
    campaign = {(s["gpu"], s["engine"]) for s in committed if "benchmarks/results" in s["source"]}
    def domain(s: dict) -> str:  # fidelity_published groups torchtitan's benchmark runs (and its cp runs) apart
        return ("torchtitan-cp" if "context parallel" in s["name"] else
                "torchtitan" if "fidelity_torchtitan.py" in s["source"] else "")

    by_key = {(s["gpu"], s["engine"], domain(s)): s for s in committed
              if ("published_sets.py" in s["source"] or "fidelity_torchtitan.py" in s["source"])
              and ((s["gpu"], s["engine"]) not in campaign or domain(s)) and s.get("kind", "transformer") == "transformer"}
    _, held = sets.split(rows)
    held_ids = {id(r) for r in held}
    groups: dict[tuple[str, str, str], list] = {}
    for r in rows:
        if not sets.in_time_domain(r):
            continue
        if (r.gpu, r.strategy.engine) not in campaign or r.domain:
            groups.setdefault((r.gpu, r.strategy.engine, r.domain), []).append(r)
    assert set(groups) == set(by_key)
    # torchtitan's context-parallel runs are a set of their own (their ring attention runs slower than priced)
    assert by_key[("H100-SXM", "torch", "torchtitan-cp")]["ratio_low"] > 1.0
    for key, rs in groups.items():
        judged = [r for r in rs if r.set not in bench.FITTED_SETS or id(r) in held_ids]
        fresh = bench._domain_entry("x", rs, judged)
        mine = by_key[key]
        assert mine["runs"] == fresh["runs"]
        assert mine["ratio_low"] == pytest.approx(fresh["ratio_low"], abs=2e-3), key
        assert mine["ratio_high"] == pytest.approx(fresh["ratio_high"], abs=2e-3), key
        assert mine["max_mfu"] == pytest.approx(fresh["max_mfu"], abs=2e-3), key


def test_nemo_on_h100_bf16_and_fp8_never_fitted_on_stay_close(sets) -> None:  # noqa: ANN001
    # NVIDIA's DGX Cloud recipes (benchmarks/data/dgxc_nemo_published.json): 70 NeMo/Megatron-Core runs of six dense
    # models on 8-2,304 H100s in bf16 and fp8, never fitted on. Before the interleaved schedule's chunk-by-chunk
    # data-parallel overlap and the measured fp8 GEMM fraction: 5.4 % (bf16) and 12.0 % (fp8) MAPE, every fp8 run
    # of the 175-405B models 18-26 % too slow
    rows = [r for r in sets.paper_rows() if r.set == "dgxc-nemo"]
    assert len(rows) == 70
    for precision in ("bf16", "fp8"):
        mine = [r for r in rows if r.strategy.precision == precision]
        assert len(mine) == 35
        assert _mape(mine) <= 0.07, precision
        assert all(0.8 < r.ratio() < 1.2 for r in mine), precision
    # what fp8 buys over bf16 at the same model and GPU count: priced within 15 % for every pair
    pairs: dict[tuple[str, int], dict[str, object]] = {}
    for r in rows:
        key = (r.label.split(f" {r.strategy.precision} ")[0], r.strategy.world_size)  # Nemotron-4 340B's cp differs
        pairs.setdefault(key, {})[r.strategy.precision] = r
    assert len(pairs) == 35
    for key, pair in pairs.items():
        bf16, fp8 = pair["bf16"], pair["fp8"]
        measured = bf16.measured_s / fp8.measured_s  # type: ignore[attr-defined]
        predicted = bf16.time().step_s / fp8.time().step_s  # type: ignore[attr-defined]
        assert measured > 1.3 and predicted == pytest.approx(measured, rel=0.15), key


def test_nemo_release_25_05_on_gb200_racks_and_h100_never_fitted_on(sets) -> None:  # noqa: ANN001
    # the DGX Cloud recipes' release v25.05.05 (benchmarks/data/dgxc_nemo_v25_05_published.json): 24 runs, NeMo 2 on
    # GB200 NVL72 racks (Llama 3.1 405B, Nemotron-4 340B weak and strong scaling) and on DGX H100, bf16 and fp8
    from optplan.estimators.efficiency import efficiency_for
    from optplan.estimators.hardware import find_gpu

    rows = [r for r in sets.paper_rows() if r.set == "dgxc-nemo-25.05"]
    assert len(rows) == 24
    h100 = [r for r in rows if r.gpu == "H100-SXM"]
    gb200 = [r for r in rows if r.gpu == "GB200"]
    assert len(h100) == 6 and len(gb200) == 18
    assert all(r.cluster.gpus_per_node == 72 for r in gb200)  # one NVLink domain per rack
    assert _mape(h100) <= 0.06 and all(0.9 < r.ratio() < 1.1 for r in h100)
    # GB200: priced with the published matmul ceiling (gemm_published.py) the runs sit closer than at the H100's
    # share of the GB200 datasheet peak, which prices every one of them fast
    plain = efficiency_for(find_gpu("GB200")).model_copy(
        update={"gemm_peak_fraction": efficiency_for(find_gpu("H100-SXM")).gemm_peak_fraction})
    before = [r.ratio(eff=plain) for r in gb200]
    after = [r.ratio() for r in gb200]
    assert all(x < 0.95 for x in before)
    assert statistics.fmean(abs(x - 1) for x in after) < statistics.fmean(abs(x - 1) for x in before) - 0.03
    assert all(0.75 < x < 1.1 for x in after)
    # strong scaling (global batch 512 on 128-512 GPUs): the step shrinks as the GPUs grow, as measured
    strong = sorted((r for r in gb200 if r.strategy.global_batch == 512 and r.strategy.precision == "bf16"),
                    key=lambda r: r.strategy.world_size)
    assert [r.strategy.world_size for r in strong] == [128, 256, 512]
    for small, big in itertools.pairwise(strong):
        assert small.time().step_s / big.time().step_s == pytest.approx(small.measured_s / big.measured_s, rel=0.05)


def test_megatron_bridge_on_gb300_racks_never_fitted_on(sets) -> None:  # noqa: ANN001
    # Megatron-Bridge's DGX-GB300 dense rows (Blackwell Ultra, NVL72 racks with an 800 Gb/s NIC per GPU), transcribed
    # with the catalogue's GB300 before any prediction: Llama 3 8B (fp8 current scaling and MXFP8, 25.11), 70B
    # (26.04.01) and 3.1 405B (26.06) at the published global batches
    rows = [r for r in sets.paper_rows() if r.set == "megatron-bridge" and r.gpu == "GB300"]
    assert len(rows) == 6
    assert all(r.cluster.gpus_per_node == 72 and r.cluster.inter_node_bandwidth_bytes_per_s == 100e9 for r in rows)
    assert sorted(r.strategy.global_batch for r in rows) == [128, 128, 256, 256, 1536, 1536]
    assert all(r.strategy.world_size == r.cluster.gpus for r in rows)
    # the GB300's GEMMs at the H100's share of its datasheet (no published ceiling): the 8B runs within 5 %, the set
    # within 15 % MAPE; the 405B runs are priced slow (1.24-1.30x), as the GB200's newest 405B runs are (1.11-1.20x)
    small = [r for r in rows if "8B" in r.label]
    assert len(small) == 2 and all(0.95 < r.ratio() < 1.05 for r in small)
    assert _mape(rows) <= 0.15 and all(0.95 < r.ratio() < 1.35 for r in rows)
    # the same Llama 3 70B Megatron-FSDP plan on 64 GPUs, one container: the GB300 is priced faster than the GB200
    same = {r.gpu: r for r in sets.paper_rows() if r.set == "megatron-bridge"
            and r.label.startswith("Llama 3 70B fp8 64 ") and "Megatron-FSDP" in r.label and r.gpu in ("GB200", "GB300")}
    measured = same["GB200"].measured_s / same["GB300"].measured_s
    predicted = same["GB200"].time().step_s / same["GB300"].time().step_s
    assert measured > predicted > 1.05


def test_bloom_on_384_a100_behind_slow_links_never_fitted_on(sets) -> None:  # noqa: ANN001
    # BigScience's BLOOM-176B layout search (benchmarks/data/bigscience_bloom_published.json): Megatron-DeepSpeed,
    # 176-203B GPT shapes, tp 4-8 x pp 6-12 on 384 A100s with 6.25 GB/s of Omni-Path per GPU, bf16, full recomputation
    rows = [r for r in sets.paper_rows() if r.set == "bigscience-bloom"]
    assert len(rows) == 18
    assert all(r.cluster.inter_node_bandwidth_bytes_per_s == 6.25e9 for r in rows)
    assert _mape(rows) <= 0.07
    assert all(0.75 < r.ratio() < 1.1 for r in rows)
    # the data-parallel gradient reduction crosses the slow links: at 8x their bandwidth the step would be shorter
    row = next(r for r in rows if r.label.startswith("BLOOM shape 70L h14336 a112 tp4 pp12 mbs2"))
    fast = sets.Row(set=row.set, label=row.label, profile=row.profile, strategy=row.strategy,
                    measured_s=row.measured_s,
                    cluster=row.cluster.model_copy(update={"inter_node_bandwidth_bytes_per_s": 50e9}))
    assert fast.time().step_s < row.time().step_s
