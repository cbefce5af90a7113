"""PyTorch FSDP runs across nodes: IBM's fms-fsdp table (benchmarks/data/fms_fsdp_published.json: Llama 2 7B-70B on 128
A100 and 96 H100 behind 400 / 800 Gb/s per node) and torchtitan's 64-A100 FSDP2 rows (published_sets.TORCHTITAN_ROWS).
Each run is cited and priced as it ran (sharding, checkpointing, the per-GPU share of the node's NICs); the time model
prices both within 15 % without a constant fitted on them, which the overlap interference scaled by the collectives'
GPU-side work makes possible (estimators/dp_comm.py gpu_side_share: timed interference put the 13B-70B fms-fsdp rows
1.3-1.5x slow); and the torchtitan page's out-of-memory layouts are refused where its batch-1 run fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import published_sets as sets
from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy

DOC = json.loads(sets.FMS_FSDP.read_text())


def test_every_fms_fsdp_run_is_complete_and_cited() -> None:
    src = DOC["source"]
    assert "2ad10059d3021d0f902f1204db98e5c930532be8" in src["file"] and "a8e98a5" in src["settings"]
    assert DOC["assumptions"] and set(DOC["clusters"]) == {"A100-80GB", "H100-SXM"}
    for gpu, cluster in DOC["clusters"].items():
        find_gpu(gpu)  # raises for a GPU the catalogue does not hold
        assert cluster["gpus"] % cluster["gpus_per_node"] == 0 and cluster["source"]
    for run in DOC["runs"]:
        arch = parse_arch(DOC["models"][run["model"]])
        assert run["sharding"] in ("full", "hybrid") and run["local_batch"] == 2
        assert set(run["tokens_per_s_per_gpu"]) == set(DOC["clusters"])
        if run["ac"] == "every":
            assert arch.layers % run["checkpoint_every"] == 0
        else:
            assert run["ac"] == "none" and run["checkpoint_every"] is None


def test_fms_fsdp_rows_keep_each_runs_settings() -> None:
    rows = {p.label: p for p in sets.fms_fsdp_rows()}
    assert len(rows) == 8
    seven = rows["Llama 2 7B HSDP 128 A100-80GB s4096 no AC"]
    assert seven.strategy.fsdp == "hybrid" and seven.strategy.checkpointing == "none"
    assert seven.nic_bytes_per_s == pytest.approx(400e9 / 8 / 8)  # 400 Gb/s per 8-GPU node
    assert seven.measured_s() == pytest.approx(2 * 4096 / 3700)  # batch 2 x 4,096 tokens at 3,700 tokens/s
    thirteen = rows["Llama 2 13B FSDP 96 H100 s4096 AC every 2"]
    assert (thirteen.strategy.checkpointing, thirteen.strategy.checkpoint_layers) == ("full", 20)
    assert thirteen.nic_bytes_per_s == pytest.approx(800e9 / 8 / 8) and thirteen.gpus == 96
    seventy = rows["Llama 2 70B FSDP 128 A100-80GB s4096 full AC"]
    assert (seventy.strategy.fsdp, seventy.strategy.checkpointing, seventy.strategy.checkpoint_layers) == (
        "full", "full", None)
    # fms-fsdp's bfSixteen policy reduces in bf16 (MixedPrecision(reduce_dtype=torch.bfloat16))
    assert {p.strategy.fsdp_reduce_dtype for p in rows.values()} == {"bf16"}


def test_llmfoundry_rows_reduce_as_composer_did() -> None:
    """Composer's PURE reduces in the precision's dtype, its DEFAULT (0.16.4 on, which the amp_bf16 rows ran) in fp32:
    every MP Mode of the table maps, and the bf16 reduction halves what those rows' reduce-scatters move."""
    rows = sets.llmfoundry_rows()
    modes = {r.label.rsplit("/", 1)[1]: r.strategy.fsdp_reduce_dtype for r in rows}
    assert modes == {"PURE": "bf16", "DEFAULT": "fp32"}
    assert sum(r.strategy.fsdp_reduce_dtype == "bf16" for r in rows) == 80
    pure = next(r for r in rows if r.strategy.fsdp_reduce_dtype == "bf16" and r.strategy.dp >= 64)
    as_fp32 = pure.strategy.model_copy(update={"fsdp_reduce_dtype": "fp32"})
    t16 = estimate(pure.profile, pure.cluster, pure.strategy).time
    t32 = estimate(pure.profile, pure.cluster, as_fp32).time
    assert t16.dp_comm_s < t32.dp_comm_s and t16.step_s < t32.step_s


def test_a_checkpoint_interval_that_does_not_divide_the_layers_is_refused(tmp_path: Path) -> None:
    doc = json.loads(json.dumps(DOC))
    doc["runs"][1]["checkpoint_every"] = 3  # 40 layers
    bad = tmp_path / "fms.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="checkpoint_every must divide the layers"):
        sets.fms_fsdp_rows(bad)


def test_fsdp_across_nodes_is_priced_within_15_percent() -> None:
    """Every fms-fsdp A100 and 64-A100 torchtitan run, predicted ÷ measured step time in 0.85-1.15, the fms-fsdp H100
    runs in 0.80-1.15 (priced 5-17 % fast since their bf16 reduction is priced as it ran: the 7B HSDP run, whose
    collectives are an eighth of its step, at 0.83 too: what the H100 rows miss is on the compute side); the big
    fms-fsdp models, whose all-gathers and reduce-scatters over 6.25-12.5 GB/s per GPU take 5-11 s, are not priced as
    if the collectives' whole time slowed the compute (the time-proportional interference put them at 1.3-1.5)."""
    a100 = tuple(p for p in sets.TORCHTITAN_ROWS if p.gpu == "A100-80GB")
    assert len(a100) == 8
    rows = sets.paper_rows(sets.fms_fsdp_rows() + a100)
    ratios = {r.label: r.ratio() for r in rows}
    assert all(0.85 <= v <= 1.15 for k, v in ratios.items() if "H100" not in k), ratios
    assert all(0.80 <= v <= 1.15 for v in ratios.values()), ratios
    big = [r for r in rows if r.set == "fms-fsdp" and "7B" not in r.label]
    for r in big:
        t = r.time()
        assert t.dp_comm_s > 0.4 * (t.step_s - t.exposed_dp_comm_s), r.label  # the collectives are long
        assert t.exposed_dp_comm_s < 0.5 * t.dp_comm_s, r.label  # and mostly hidden


@pytest.mark.parametrize(("mbs", "checkpointing", "layers", "fits"), [
    (2, "selective", None, False),  # 'selective op', local batch 2: OOM on the page at 395a52627
    (2, "full", 40, False),  # 'selective layer' (every 2nd block), local batch 2: OOM
    (1, "selective", None, True),  # 'selective op', local batch 1: 355 tokens/s
    (2, "full", None, True),  # 'full', local batch 2: 353 tokens/s
])
def test_torchtitan_llama2_70b_out_of_memory_layouts(mbs: int, checkpointing: str, layers: int | None,
                                                     fits: bool) -> None:
    prof = profile_from_arch(parse_arch(sets.LLAMA2_70B, seq_len=4096))
    cluster = Cluster(gpu=find_gpu("A100-80GB"), gpus=64, gpus_per_node=8)
    strategy = Strategy(precision="bf16", engine="torch", fsdp="full", dp=64, mbs=mbs, checkpointing=checkpointing,
                        checkpoint_layers=layers)
    assert estimate(prof, cluster, strategy).fits is fits
