"""LoRA's time (estimators/adapter_time.py): the frozen base's GEMMs have no weight gradients, the rank-r adapters
are priced as thin GEMMs (not as extra MLP width), and neither the base's gradient accumulation nor its autocast
casts are paid (a 7B LoRA step was priced slower than the full fine-tune's matmuls)."""

from __future__ import annotations

import pytest

from optplan.estimators.compute import efficiency_for, layer_time, transformer_dims
from optplan.estimators.estimate import estimate
from optplan.estimators.finetune import AdapterProfile
from optplan.estimators.gemm import gemm_time_s, gemm_train_time_s
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from tests.factories import make_profile

H100 = find_gpu("H100-SXM")
CLUSTER = Cluster(gpu=H100, gpus=1, gpus_per_node=1)
LAYERS, HIDDEN, RANK = 24, 2048, 16


def _full() -> ModelProfile:
    return make_profile(params=1_300_000_000, layers=LAYERS, hidden=HIDDEN, seq=512)


def _lora(full: ModelProfile) -> ModelProfile:
    """``full`` with rank-16 adapters on its four projections per layer (q/k/v as one h -> 3h, o, fc1 h -> 4h, fc2):
    Σ(d_in + d_out) = 14 h per layer; the backward runs the base's data gradients only (half its FLOPs)."""
    width = 14 * HIDDEN
    adapter_params = LAYERS * RANK * width
    adapter = AdapterProfile(rank=RANK, alpha=32.0, targets=("qkv", "o", "fc1", "fc2"), adapted_modules=4 * LAYERS,
                             adapter_params=adapter_params, quantizable_params=0, quantizable_rows=0,
                             largest_quantizable_params=0)
    block = full.repeated_block.model_copy(  # type: ignore[union-attr]
        update={"params_per_block": full.repeated_block.params_per_block + adapter_params // LAYERS})  # type: ignore[union-attr]
    return full.model_copy(update={"adapter": adapter, "trainable_params": adapter_params, "repeated_block": block,
                                   "params": full.params + adapter_params,
                                   "bwd_flops_per_sample": full.fwd_flops_per_sample})


def test_a_frozen_weight_has_no_weight_gradient_gemm() -> None:
    eff = efficiency_for(H100)
    kw = {"peak_flops": H100.peak_flops_for("bf16"), "bandwidth_bytes_per_s": H100.memory_bandwidth_bytes_per_s,
          "eff": eff}
    fwd, bwd = gemm_train_time_s(2048, 4096, 4096, **kw)
    f2, b2 = gemm_train_time_s(2048, 4096, 4096, weight_grad=False, **kw)
    assert f2 == fwd and b2 == pytest.approx(gemm_time_s(2048, 4096, 4096, **kw))  # the data gradient (m×k×n)
    assert b2 < bwd


def test_lora_prices_the_frozen_base_without_weight_gradients_and_its_adapters_as_thin_gemms() -> None:
    full, lora = _full(), _lora(_full())
    s = Strategy(precision="amp-bf16", engine="torch", mbs=4)
    d_full, d_lora = transformer_dims(full), transformer_dims(lora)
    assert d_full is not None and d_lora is not None
    assert d_lora.mlp_params == d_full.mlp_params  # the adapters are no MLP width
    assert d_lora.frozen_base and d_lora.adapter_rank == RANK and d_lora.adapter_width == 14 * HIDDEN
    eff = efficiency_for(H100)
    lt_full, lt_lora = layer_time(d_full, s, H100, eff), layer_time(d_lora, s, H100, eff)
    assert lt_lora.fwd_gemm_s > lt_full.fwd_gemm_s  # the adapters' forward...
    assert lt_lora.fwd_gemm_s < 1.15 * lt_full.fwd_gemm_s  # ...is thin
    # the backward loses the base's weight gradients: about half, plus the adapters' (data and weight gradients)
    assert 0.45 * lt_full.bwd_gemm_s < lt_lora.bwd_gemm_s < 0.7 * lt_full.bwd_gemm_s
    assert lt_lora.fwd_flops == pytest.approx(lt_full.fwd_flops + 2 * 4 * 512 * RANK * 14 * HIDDEN)
    a, b = estimate(full, CLUSTER, s).time, estimate(lora, CLUSTER, s).time
    assert 0.7 < b.compute_s / a.compute_s < 0.85  # forward + data gradient + adapters, of forward + 2 gradients
    # no gradient accumulation over the frozen base, no autocast casts of a base held in 16 bits
    assert b.memory_bound_s < a.memory_bound_s
    assert b.step_s < a.step_s


def test_gradient_accumulation_bytes_count_trainable_parameters_only() -> None:
    full = _full()
    half = full.model_copy(update={"trainable_params": full.params // 2})
    s = Strategy(precision="bf16", engine="torch", mbs=4, grad_accum=4)
    assert estimate(half, CLUSTER, s).time.memory_bound_s < estimate(full, CLUSTER, s).time.memory_bound_s
