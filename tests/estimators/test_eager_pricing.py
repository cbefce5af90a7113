"""estimators/eager_traffic.py and its use: eager engines price the measured per-operator bytes, compiled plans
Inductor's measured bytes, Megatron the fused count."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.compute import layer_time, transformer_dims
from optplan.estimators.eager_traffic import eager_traffic_data, layer_bytes_per_token, precision_class
from optplan.estimators.efficiency import efficiency_for, engine_efficiency
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy

LLAMA_8B = "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,gated=1,tied=0,seq=8192"
GPT_LIKE = "layers=32,hidden=4096,heads=32,vocab=50368,seq=2048"


def test_precision_classes_follow_the_recipe() -> None:
    assert precision_class(4, 4) == "fp32"
    assert precision_class(4, 2) == "amp"  # fp32 weights under 16-bit autocast: its casts are kernels
    assert precision_class(2, 2) == "bf16"


def test_tensor_parallel_split_and_grouped_query_repeat() -> None:
    kw = {"kind": "gated", "precision": "bf16", "hidden": 4096.0, "ffn": 14336.0, "kv": 1024.0, "head_dim": 128.0}
    one = layer_bytes_per_token(**kw, grouped_query=True)
    mha = layer_bytes_per_token(**kw, grouped_query=False)
    assert one[0] > mha[0] and one[1] > mha[1]  # the repeated k/v copies
    sp = layer_bytes_per_token(**kw, grouped_query=True, tp=4, sp=True)
    no_sp = layer_bytes_per_token(**kw, grouped_query=True, tp=4, sp=False)
    assert sp[0] == pytest.approx(one[0] / 4, rel=0.01)  # every width term splits under SP
    assert one[0] / 4 < no_sp[0] < one[0]  # norms and residual adds run on every rank without it
    coef = eager_traffic_data().blocks["gated"]["bf16"]["fwd"]
    assert one[0] == pytest.approx(coef.h * 4096 + coef.ffn * 14336 + coef.kv * 1024 + coef.head_dim * 128
                                   + coef.gqa * 4096)


def test_eager_gated_layers_cost_more_than_plain_ones_and_compile_fuses_them() -> None:
    gpu = find_gpu("H100")
    eff = efficiency_for(gpu)
    llama = transformer_dims(profile_from_arch(parse_arch(LLAMA_8B)))
    gpt = transformer_dims(profile_from_arch(parse_arch(GPT_LIKE)))
    assert llama is not None and gpt is not None and llama.gated and not gpt.gated
    torch_ = Strategy(engine="torch", fsdp="full", precision="bf16", mbs=1)
    eager_llama = layer_time(llama, torch_, gpu, eff)
    compiled = layer_time(llama, torch_.model_copy(update={"compile": True}), gpu, eff)
    assert compiled.fwd_gemm_s == eager_llama.fwd_gemm_s  # compile changes the elementwise kernels only
    assert compiled.fwd_elementwise_s < eager_llama.fwd_elementwise_s / 2
    # per token, a Llama layer's eager kernels move ~3x a plain layer's of the same hidden width (the benchmark's
    # figure); the plain GPT layer here is 4h wide in its MLP, the Llama one 3.5h (gated)
    tok_llama = eager_llama.fwd_elementwise_s / 8192
    tok_gpt = layer_time(gpt, torch_, gpu, eff).fwd_elementwise_s / 2048
    assert tok_llama > 2 * tok_gpt
    # Megatron keeps its fused count whatever the model: the engine is not eager
    assert not engine_efficiency("megatron").eager and engine_efficiency("torch").eager


def test_compiled_layers_pay_inductors_measured_bytes_split_as_their_eager_operators() -> None:
    gpu = find_gpu("H100")
    eff = efficiency_for(gpu)
    llama = transformer_dims(profile_from_arch(parse_arch(LLAMA_8B)))
    assert llama is not None
    s = Strategy(engine="torch", fsdp="full", precision="bf16", mbs=1, compile=True)
    lt = layer_time(llama, s, gpu, eff)
    kw = {"kind": "gated", "precision": "bf16", "hidden": 4096.0, "ffn": 14336.0, "kv": 1024.0, "head_dim": 128.0,
          "grouped_query": True}
    both = layer_bytes_per_token(**kw, compiled=True)[0]  # type: ignore[arg-type]
    e_fwd, e_bwd = layer_bytes_per_token(**kw)  # type: ignore[arg-type]
    hbm = gpu.memory_bandwidth_bytes_per_s * eff.hbm_fraction / eff.elementwise_factor
    multiplier = engine_efficiency("torch").compile_multiplier
    assert lt.fwd_elementwise_s == pytest.approx(8192 * both * e_fwd / (e_fwd + e_bwd) * multiplier / hbm, rel=1e-3)
    assert lt.bwd_elementwise_s == pytest.approx(8192 * both * e_bwd / (e_fwd + e_bwd) * multiplier / hbm, rel=1e-3)
    # Inductor's count for a Llama layer sits between Megatron's hand-fused count and the eager operators'
    mega = layer_time(llama, s.model_copy(update={"engine": "megatron", "compile": False, "fsdp": "none"}), gpu, eff)
    assert mega.fwd_elementwise_s + mega.bwd_elementwise_s < lt.fwd_elementwise_s + lt.bwd_elementwise_s
    assert both < 0.5 * (e_fwd + e_bwd)


def test_compile_is_a_torch_and_deepspeed_choice_and_says_it_is_unmeasured() -> None:
    with pytest.raises(ValueError, match="--compile"):
        Strategy(engine="megatron", compile=True)
    s = Strategy(engine="torch", fsdp="full", precision="bf16", mbs=1, dp=8, compile=True)
    assert "compile" in s.label()
    prof = profile_from_arch(parse_arch(LLAMA_8B))
    cluster = Cluster(gpu=find_gpu("H100"), gpus=8, gpus_per_node=8)
    compiled = estimate(prof, cluster, s)
    eager = estimate(prof, cluster, s.model_copy(update={"compile": False}))
    assert compiled.time.step_s < eager.time.step_s
    assert any("torch.compile" in why for why in compiled.time.outside_measured)
    assert not any("torch.compile" in why for why in eager.time.outside_measured)


def test_a_profiles_own_count_replaces_the_reference_and_splits_like_it() -> None:
    gpu = find_gpu("H100")
    eff = efficiency_for(gpu)
    prof = profile_from_arch(parse_arch(LLAMA_8B))
    dims = transformer_dims(prof)
    assert dims is not None and dims.eager_bytes_per_token is None  # a shape: the reference block
    ref = layer_bytes_per_token(kind="gated", precision="bf16", hidden=4096.0, ffn=14336.0, kv=1024.0,
                                head_dim=128.0, grouped_query=True)
    own = prof.model_copy(update={"eager_layer_bytes_per_token": {"bf16": (2 * ref[0], 2 * ref[1])}})
    mine = transformer_dims(own)
    assert mine is not None and mine.eager_bytes_per_token is not None
    for tp, sp in ((1, False), (4, True), (4, False)):
        s = Strategy(engine="torch", precision="bf16", mbs=1, tp=tp, dp=1, sp=sp)
        base, doubled = layer_time(dims, s, gpu, eff), layer_time(mine, s, gpu, eff)
        assert doubled.fwd_elementwise_s == pytest.approx(2 * base.fwd_elementwise_s, rel=1e-3)
        assert doubled.bwd_elementwise_s == pytest.approx(2 * base.bwd_elementwise_s, rel=1e-3)
    # a class the profile did not measure falls back to the reference
    amp = Strategy(engine="torch", precision="amp-bf16", mbs=1)
    assert layer_time(mine, amp, gpu, eff).fwd_elementwise_s == layer_time(dims, amp, gpu, eff).fwd_elementwise_s
