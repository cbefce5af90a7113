"""Partial activation checkpointing (estimators/partial_checkpointing.py): the first N blocks of a stage recomputed,
the rest keeping their activations; memory and time move linearly between no checkpointing and full."""

from __future__ import annotations

import pytest
from factories import make_gpu, make_profile
from pydantic import ValidationError

from optplan.estimators.activations import activation_bytes
from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.partial_checkpointing import blend_bytes, recompute_fraction
from optplan.estimators.strategy import Strategy

LLAMA = profile_from_arch(parse_arch("layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,"
                                     "tied=0", seq_len=4096))
H100 = Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8)


def _plan(n: int | None, **kw: object) -> Strategy:
    base: dict[str, object] = dict(precision="bf16", engine="torch", fsdp="full", dp=8, mbs=2,
                                   checkpointing="full" if n != 0 else "none", checkpoint_layers=n or None)
    base.update(kw)
    return Strategy(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("extra", [{}, {"engine": "megatron", "fsdp": "none", "tp": 2, "dp": 4}],
                         ids=["torch-fsdp", "megatron-tp2"])
def test_memory_falls_and_time_rises_linearly_with_the_checkpointed_blocks(extra: dict[str, object]) -> None:
    ests = {n: estimate(LLAMA, H100, _plan(n, **extra)) for n in (0, 8, 16, 24)}
    acts = [ests[n].memory.activations_bytes for n in (0, 8, 16, 24)]
    recompute = [ests[n].time.recompute_s for n in (0, 8, 16, 24)]
    assert acts[0] > acts[1] > acts[2] > acts[3]
    assert 0 == recompute[0] < recompute[1] < recompute[2] < recompute[3]
    # each 8 blocks checkpointed save the same bytes and add the same recomputation (equal blocks)
    assert acts[0] - acts[1] == pytest.approx(acts[1] - acts[2], rel=1e-6)
    assert acts[1] - acts[2] == pytest.approx(acts[2] - acts[3], rel=1e-6)
    every = estimate(LLAMA, H100, _plan(None, **extra))
    assert recompute[2] == pytest.approx(every.time.recompute_s / 2, rel=1e-9)  # 16 of 32 blocks: half
    assert every.time.step_s > ests[24].time.step_s > ests[8].time.step_s > ests[0].time.step_s


def test_the_formula_keeps_the_inputs_of_the_checkpointed_layers_and_everything_of_the_others() -> None:
    """Under tensor parallelism (Korthikanti Table 2 per layer): N·input + (L−N)·layer + the ends, so the step from
    16 checkpointed layers to all 32 saves what the step from none to 16 saved, less at most one layer's working set
    (what plain full checkpointing holds instead of the ends when it is larger)."""
    tp = dict(engine="megatron", fsdp="none", tp=2, dp=4)
    none, one, half, every = (activation_bytes(LLAMA, _plan(n, **tp)) for n in (0, 1, 16, None))
    per_layer = none - one  # a layer's saved bytes less its input
    assert none - half == pytest.approx(16 * per_layer, rel=1e-6)
    assert none - half - per_layer <= half - every <= none - half
    layer_input = 2 * 4096 * 4096 * 2 / 2  # 2·s·h bytes (bf16) x mbs 2, split by sequence parallelism over tp 2
    assert per_layer > 10 * layer_input  # Table 2 keeps 34·s·h/t per layer against the 2·s·h/t of its input


def test_fits_without_per_moment_figures_are_interpolated() -> None:
    """Hand-made fits (no phase lines): none − f·(none − full) (real profiles: tests/probes/test_cpu_accounting.py)."""
    profile = make_profile(layers=12)
    plans = [Strategy(precision="bf16", mbs=4, checkpointing=c, checkpoint_layers=n)
             for c, n in (("none", None), ("full", 3), ("full", 6), ("full", None))]
    none, three, six, every = (activation_bytes(profile, s) for s in plans)
    assert three == blend_bytes(none, every, 3 / 12)
    assert six == blend_bytes(none, every, 0.5)
    assert none > three > six > every


def test_recompute_fraction_counts_the_blocks_of_the_busiest_stage() -> None:
    assert recompute_fraction(Strategy(checkpointing="none"), 32) == 0.0
    assert recompute_fraction(Strategy(checkpointing="selective"), 32) == 0.0
    assert recompute_fraction(Strategy(checkpointing="full"), 32) == 1.0
    assert recompute_fraction(Strategy(checkpointing="full", checkpoint_layers=8), 32) == 0.25
    # Megatron's block method counts per pipeline stage: 4 of each stage's 8 blocks
    assert recompute_fraction(Strategy(checkpointing="full", checkpoint_layers=4, pp=4, engine="megatron"), 32) == 0.5
    assert recompute_fraction(Strategy(checkpointing="full", checkpoint_layers=8), None) == 1.0


def test_the_label_names_the_count() -> None:
    assert Strategy(checkpointing="full", checkpoint_layers=6).label().split()[-1] == "ckpt6"
    assert "ckpt" in Strategy(checkpointing="full").label().split()


@pytest.mark.parametrize(("kw", "needle"), [
    ({"checkpointing": "selective", "checkpoint_layers": 4}, "add --checkpointing full"),
    ({"checkpointing": "full", "checkpoint_layers": 4, "pp": 2, "vpp": 2, "grad_accum": 4, "engine": "megatron"},
     "use --vpp 1"),
    ({"checkpointing": "full", "checkpoint_layers": 0}, "greater than or equal to 1"),
])
def test_bad_counts_are_refused_with_the_fix(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        Strategy(**kw)  # type: ignore[arg-type]


def test_a_count_of_every_block_or_more_is_refused_against_the_model() -> None:
    cluster = Cluster(gpu=make_gpu(), gpus=1, gpus_per_node=1)
    with pytest.raises(OptplanError, match="use 1-11, or drop it"):
        estimate(make_profile(layers=12), cluster, Strategy(checkpointing="full", checkpoint_layers=12))
    pp = Strategy(checkpointing="full", checkpoint_layers=6, pp=2, engine="megatron", grad_accum=2)
    with pytest.raises(OptplanError, match="not fewer than the 6 blocks"):
        estimate(make_profile(layers=12), Cluster(gpu=make_gpu(), gpus=2, gpus_per_node=2), pp)


def test_the_band_needs_both_ends_measured() -> None:
    """Partial checkpointing lies between no and full checkpointing: a measured set with both (H100 torch) gives it
    the band of full checkpointing; one without runs that never checkpointed (A100 Megatron: full and selective)
    widens it and says why."""
    band = {}
    for gpu, extra in (("H100-SXM", {}), ("A100-80GB", {"engine": "megatron", "fsdp": "none", "tp": 2, "dp": 4})):
        cluster = Cluster(gpu=find_gpu(gpu), gpus=8, gpus_per_node=8)
        for n in (None, 16):
            est = estimate(LLAMA, cluster, _plan(n, **extra))
            band[gpu, n] = (est.time.step_s_high / est.time.step_s, " ".join(est.notes))
    assert band["H100-SXM", 16][0] == pytest.approx(band["H100-SXM", None][0])
    assert band["A100-80GB", 16][0] > band["A100-80GB", None][0]
    assert "partial checkpointing lies between none and full" in band["A100-80GB", 16][1]
    assert "partial checkpointing" not in band["H100-SXM", 16][1]
