"""Every step time carries a band: the measured sets' residuals, widened outside what was measured."""

from __future__ import annotations

import math

import pytest

from optplan.estimators.arch import ArchSpec, profile_from_arch
from optplan.estimators.calibration import Calibration
from optplan.estimators.estimate import calibrate_estimate, estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from optplan.estimators.uncertainty import (
    UNMEASURED_GPU_BAND,
    WIDEN_PER_OCTAVE,
    WIDEN_UNMEASURED,
    mfu_envelope,
    time_band,
    time_domain,
)

MPT_7B = ArchSpec(layers=32, hidden=4096, heads=32, vocab=50368, seq=2048)
FSDP8 = Strategy(precision="bf16", engine="torch", fsdp="full", dp=8, mbs=2, grad_accum=2, checkpointing="none")


def _cluster(gpu: str = "H100-SXM", gpus: int = 8) -> Cluster:
    return Cluster(gpu=find_gpu(gpu), gpus=gpus, gpus_per_node=8)


def _h100_torch():
    return next(s for s in time_domain().sets if s.gpu == "H100-SXM" and s.engine == "torch")


def test_a_measured_configuration_gets_the_sets_residual_band_and_no_note() -> None:
    e = estimate(profile_from_arch(MPT_7B), _cluster(), FSDP8)
    t, ms = e.time, _h100_torch()
    assert t.outside_measured == ()
    assert not any(n.startswith("time: outside the measured domain") for n in e.notes)
    assert t.step_s_low == pytest.approx(t.step_s * min(1.0, ms.ratio_low))
    assert t.step_s_high == pytest.approx(t.step_s * max(1.0, ms.ratio_high))
    assert t.step_s_low <= t.step_s <= t.step_s_high
    assert "runs" in t.band_basis and "MAPE" in t.band_basis


def _basis(band) -> object:  # noqa: ANN001 - the measured set a band rests on
    return next(s for s in time_domain().sets if band.basis.startswith(s.name + ":"))


def test_outside_the_measured_sizes_widens_the_band_and_says_what() -> None:
    inside = estimate(profile_from_arch(MPT_7B), _cluster(), FSDP8).time
    big = profile_from_arch(ArchSpec(layers=128, hidden=25600, heads=160, vocab=50368, seq=2048))  # ~1T
    s = FSDP8.model_copy(update={"dp": 2048, "mbs": 1, "checkpointing": "full"})
    out = estimate(big, _cluster(gpus=2048), s)
    band = time_band(big, s, _cluster(gpus=2048), mfu=0.0)
    ms = _basis(band)
    octaves = (math.log2(big.params / ms.params[1]) + math.log2(2048 / ms.gpus[1])
               + max(0.0, math.log2(ms.seq[0] / 2048))
               + max(0.0, math.log2(ms.tokens_per_microbatch[0] / 2048)))  # 1 x 2,048 tokens per micro-batch
    assert band.high == pytest.approx(max(1.0, ms.ratio_high) * math.exp(WIDEN_PER_OCTAVE * octaves))
    assert out.time.step_s_high / out.time.step_s > inside.step_s_high / inside.step_s
    reasons = " ".join(out.time.outside_measured)
    assert "parameters" in reasons and f"GPUs 2048 outside the measured {ms.gpus[0]}-{ms.gpus[1]}" in reasons
    assert any(n.startswith("time: outside the measured domain (parameters") for n in out.notes)


def test_torchtitan_runs_cover_tensor_parallel_float8_plans_and_context_parallel_carries_its_measured_slowness(
) -> None:
    """benchmarks/fidelity_torchtitan.py's runs are H100 torch sets of their own: a tp 8 fp8 plan at 256 GPUs rests
    on them unwidened, a plain FSDP plan stays on llm-foundry's tighter band, and a context-parallel plan gets the
    band of torchtitan's cp runs, measured 1.1-1.7x slower than priced (ring attention)."""
    llama70 = profile_from_arch(ArchSpec(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
                                         seq=8192, gated=True, tied=False))
    tp8 = Strategy(precision="fp8", engine="torch", fsdp="full", dp=32, tp=8, sp=True, mbs=2,
                   checkpointing="full")
    band = time_band(llama70, tp8, _cluster(gpus=256), mfu=0.0)
    assert "torchtitan-benchmarks" in band.basis and band.outside == ()
    plain = time_band(profile_from_arch(MPT_7B), FSDP8, _cluster(), mfu=0.0)
    assert "llmfoundry-H100-SXM" in plain.basis and plain.high < band.high
    llama8 = profile_from_arch(ArchSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                                        seq=131072, gated=True, tied=False))
    cp = time_band(llama8, Strategy(precision="fp8", engine="torch", fsdp="full", dp=2, cp=4, mbs=1,
                                    checkpointing="full"), _cluster(), mfu=0.0)
    ms = _basis(cp)
    assert "context parallel" in ms.name and ms.ratio_low > 1.0 and cp.high >= ms.ratio_high
    assert cp.low == pytest.approx(1.0)  # the estimate is the fast end: every measured cp run was slower


def test_unmeasured_parallelism_and_engine_widen_the_band() -> None:
    prof = profile_from_arch(MPT_7B)
    base = time_band(prof, FSDP8, _cluster(), mfu=0.0)
    zero3 = time_band(prof, Strategy(precision="bf16", engine="deepspeed", zero=3, dp=8, mbs=4, checkpointing="none"),
                      _cluster(), mfu=0.0)
    assert any("engine deepspeed was never measured on H100-SXM" in r for r in zero3.outside)
    assert math.log(zero3.high) > math.log(base.high) + WIDEN_UNMEASURED - 1e-9
    # Megatron on the H100 rests on NVIDIA's published bf16 and fp8 runs of 8-410B models (all with the
    # communication overlap): a 6.7B plan without the overlap and at tp 16 is outside them on three counts
    tp = time_band(prof, Strategy(precision="bf16", engine="megatron", tp=16, dp=1, mbs=4, checkpointing="none"),
                   _cluster(gpus=16), mfu=0.0)
    assert tp.basis.startswith("H100-SXM megatron: dgxc-nemo, dgxc-nemo-25.05, megatron-bridge")
    assert not any(r.startswith("precision") for r in tp.outside)  # bf16 and fp8 both measured
    assert any(r.startswith("parameters 6.66e+09 outside the measured 8.03e+09") for r in tp.outside)
    assert any(r.startswith("tensor parallel 16 outside") for r in tp.outside)
    assert any("without its tensor/data-parallel overlap is not in the measured set this estimate rests on "
               "(H100-SXM megatron); other sets measured it on A100" in r for r in tp.outside), tp.outside
    overlapped = time_band(prof, Strategy(precision="bf16", engine="megatron", tp=16, dp=1, mbs=4,
                                          checkpointing="none", comm_overlap=True), _cluster(gpus=16), mfu=0.0)
    assert not any("overlap" in r for r in overlapped.outside)
    megatron = _basis(tp)
    # tp 16 is one doubling beyond the measured 8, the 6.7B model a quarter below the measured 8B
    assert math.log(tp.high) > math.log(max(1.0, megatron.ratio_high)) + WIDEN_PER_OCTAVE * 1.25 - 1e-9
    offload = time_band(prof, FSDP8.model_copy(update={"offload_params": "cpu", "offload_optimizer": "cpu"}),
                        _cluster(), mfu=0.0)
    assert "offload was never measured" in offload.outside


def test_a_predicted_mfu_above_the_measured_envelope_bounds_the_slow_end() -> None:
    prof = profile_from_arch(MPT_7B)
    envelope = mfu_envelope("H100-SXM", "bf16")
    assert envelope is not None and 0.3 < envelope < 0.7
    band = time_band(prof, FSDP8, _cluster(), mfu=envelope * 1.5)
    assert band.high >= 1.5 - 1e-9
    assert any("above the best measured on H100-SXM" in r for r in band.outside)


def test_gpus_without_measurements_say_so() -> None:
    prof = profile_from_arch(MPT_7B)
    b200 = time_band(prof, FSDP8, _cluster("B200"), mfu=0.0)
    h100 = time_band(prof, FSDP8, _cluster("H100-SXM"), mfu=0.0)
    # the B200's only measured runs are published MoE ones: a dense plan borrows the H100's, widened
    assert b200.high > h100.high
    assert any(r.startswith("B200's own measured runs cover this plan less than H100-SXM's") for r in b200.outside)
    l40s = time_band(prof, FSDP8, _cluster("L40S"), mfu=0.0)
    # nobody measured the L40S: the H100's band for the same plan, widened (never narrower than a measured GPU's)
    assert l40s.high == pytest.approx(max(h100.high, 1.0) * math.exp(UNMEASURED_GPU_BAND))
    assert l40s.low == pytest.approx(min(h100.low, 1.0) * math.exp(-UNMEASURED_GPU_BAND))
    assert l40s.outside[0] == "no step time was ever measured on L40S"
    assert l40s.outside[1:] == tuple(f"and on H100-SXM, whose band stands in: {r}" for r in h100.outside)
    assert mfu_envelope("L40S", "bf16") is None
    # what the plan does that nobody measured widens an unmeasured GPU's band too (it was one flat band)
    offload = FSDP8.model_copy(update={"offload_params": "cpu"})
    assert time_band(prof, offload, _cluster("L40S"), mfu=0.0).high > l40s.high


def test_calibration_moves_the_band_with_the_step() -> None:
    e = estimate(profile_from_arch(MPT_7B), _cluster(), FSDP8)
    cal = Calibration(gpu="H100-SXM", model_hash="x", compute_scale=1.5, time_probes=1)
    c = calibrate_estimate(e, cal).time
    assert c.step_s > e.time.step_s
    assert c.step_s_low / c.step_s == pytest.approx(e.time.step_s_low / e.time.step_s)
    assert c.step_s_high / c.step_s == pytest.approx(e.time.step_s_high / e.time.step_s)
    _assert_throughput_band_matches_step_band(c, FSDP8.global_batch, MPT_7B.seq)


def _assert_throughput_band_matches_step_band(t, batch: int, seq: int) -> None:  # noqa: ANN001 - a TimeBreakdown
    assert t.samples_per_s_low == pytest.approx(batch / t.step_s_high)
    assert t.samples_per_s_high == pytest.approx(batch / t.step_s_low)
    assert t.tokens_per_s_low == pytest.approx(batch * seq / t.step_s_high)
    assert t.tokens_per_s_high == pytest.approx(batch * seq / t.step_s_low)
    assert t.tokens_per_s_low < t.tokens_per_s < t.tokens_per_s_high


def test_the_throughput_band_is_the_step_band_seen_as_samples_and_tokens_per_second() -> None:
    e = estimate(profile_from_arch(MPT_7B), _cluster("L40S"), FSDP8)  # unmeasured GPU: a wide band
    assert e.time.step_s_high > 1.2 * e.time.step_s
    _assert_throughput_band_matches_step_band(e.time, FSDP8.global_batch, MPT_7B.seq)
    dumped = e.model_dump(mode="json")["time"]
    assert {"samples_per_s_low", "samples_per_s_high", "tokens_per_s_low", "tokens_per_s_high"} <= set(dumped)


def test_precision_widens_by_class_not_by_name() -> None:
    # bf16 and fp16 run at one tensor-core rate: a bf16 plan on the fp16-measured A100 Megatron set is
    # inside the domain; fp32 (a different rate) is not
    prof = profile_from_arch(MPT_7B)
    a100 = Cluster(gpu=find_gpu("A100-80GB"), gpus=8, gpus_per_node=8)
    base = {"engine": "megatron", "tp": 2, "dp": 4, "mbs": 1, "grad_accum": 4, "checkpointing": "full"}
    bf16 = time_band(prof, Strategy(precision="bf16", **base), a100, mfu=0.0)
    fp16 = time_band(prof, Strategy(precision="fp16", **base), a100, mfu=0.0)
    fp32 = time_band(prof, Strategy(precision="fp32", **base), a100, mfu=0.0)
    assert not any("precision" in r for r in bf16.outside) and bf16.high == pytest.approx(fp16.high)
    assert any(r.startswith("precision fp32 not measured") for r in fp32.outside)
    assert fp32.high > bf16.high


def _h200_set(engine: str, kind: str = "transformer"):
    return next(s for s in time_domain().sets if s.gpu == "H200" and s.engine == engine and s.kind == kind)


def test_the_h200_band_rests_on_its_own_runs_where_they_cover_the_plan_and_on_the_h100s_where_not() -> None:
    """benchmarks/results/2026-11-26-H200: single-GPU runs of 124M-1.2B models. A plan like them gets their
    residual band (no widening); a 7B FSDP plan on 8 H200s is nearer the H100's multi-GPU runs it derives from."""
    small = profile_from_arch(ArchSpec(layers=16, hidden=2048, heads=32, vocab=128256, seq=1024))
    one = Strategy(precision="bf16", engine="torch", mbs=4)
    own = time_band(small, one, _cluster("H200", 1), mfu=0.0)
    ms = _h200_set("torch")
    assert ms.runs >= 20 and ms.gpus == (1, 1)
    assert own.basis.startswith(ms.name) and own.outside == ()
    assert own.high == pytest.approx(max(1.0, ms.ratio_high)) and own.low == pytest.approx(min(1.0, ms.ratio_low))
    big = time_band(profile_from_arch(MPT_7B), FSDP8, _cluster("H200"), mfu=0.0)
    assert big.basis.startswith(_h100_torch().name)
    assert any("own measured runs cover this plan less than H100-SXM's" in r for r in big.outside)
    # DeepSpeed at world size 1 rests on its own measured runs: their residual band (its engine's host multiplier
    # priced, fit_engine_host.py: 0.74-1.43x where it was 1.3-3.1x), wider than torch's own
    ds_set = _h200_set("deepspeed")
    ds = time_band(small, Strategy(precision="bf16", engine="deepspeed", zero=1, mbs=2), _cluster("H200", 1), mfu=0.0)
    assert ds.basis.startswith(ds_set.name) and ds.high == pytest.approx(max(1.0, ds_set.ratio_high))
    assert ds.high - ds.low > own.high - own.low


def test_models_without_a_transformer_shape_are_judged_by_such_runs() -> None:
    """The FLOPs-only path (an MLP, ResNet-50, a ViT) measured on the H200: its band is those runs' residuals there
    (host-bound small steps, priced per launched kernel since estimators/eager_host.py: at most ~2x slow where a
    fixed host constant left them 3-5x slow), on the A100 the published convolution nets, and elsewhere it is widened
    as unmeasured."""
    from tests.factories import make_profile

    prof = make_profile(params=25_000_000, tokens=False).model_copy(update={"transformer": None})
    s = Strategy(precision="bf16", engine="torch", mbs=32)
    h200 = time_band(prof, s, _cluster("H200", 1), mfu=0.0)
    flops_only = _h200_set("torch", "flops_only")
    assert h200.basis.startswith(flops_only.name) and h200.high >= flops_only.ratio_high > 1.2
    assert flops_only.ratio_high < 2.5  # the kernel-count host time holds these runs within ~2x
    # the published convolution nets (benchmarks/fidelity_convnets.py) are such runs on the A100, V100 and RTX 3090
    a100 = time_band(prof, s, _cluster("A100-80GB", 1), mfu=0.0)
    assert a100.basis.startswith("A100-80GB torch FLOPs-only models: convnets-dle")
    h100 = time_band(prof, s, _cluster("H100-SXM", 1), mfu=0.0)
    assert any("no model without a transformer shape was measured on H100-SXM" in r for r in h100.outside)
    # the MFU envelope stays the transformer runs' (the tiny models' MFU is no ceiling for a large model)
    assert mfu_envelope("H200", "bf16") == mfu_envelope("H100-SXM", "bf16")


def test_a_transformer_fed_images_is_not_judged_by_a_sequence_of_one() -> None:
    """A Hugging Face ViT has a transformer shape but no token inputs: its band once read "sequence 1 outside the
    measured 512-65536" (and widened by the octaves down to one). The sequence checks are dropped for it and the
    band says that the inputs are not token sequences."""
    tokens = profile_from_arch(MPT_7B)
    images = tokens.model_copy(update={"input_kind": "other", "tokens_per_sample": None, "seq_len": None})
    band_t = time_band(tokens, FSDP8, _cluster(), mfu=0.0)
    band_i = time_band(images, FSDP8, _cluster(), mfu=0.0)
    assert band_t.outside == ()
    assert not any(r.startswith("sequence") or r.startswith("tokens per micro-batch") for r in band_i.outside)
    assert any("the inputs are not token sequences" in r for r in band_i.outside), band_i.outside
    assert band_i.high == pytest.approx(band_t.high * math.exp(WIDEN_UNMEASURED))
