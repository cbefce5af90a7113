"""LoRA/QLoRA model states: the quantised-weight formulas against bitsandbytes' own tensors, hand-worked model
states of a LoRA profile, and the strategy checks of a quantised base."""

from __future__ import annotations

import pytest

from optplan.estimators.errors import OptplanError
from optplan.estimators.finetune import (
    AdapterProfile,
    dequantized_weight_bytes,
    frozen_weight_bytes,
    int8_checkpoint_kept_bytes,
    quantized_weight_bytes,
)
from optplan.estimators.hardware import Cluster
from optplan.estimators.memory import buffer_items, model_states
from optplan.estimators.strategy import Strategy
from optplan.estimators.validity import check_strategy
from tests.factories import make_gpu, make_profile

ADAPTER = AdapterProfile(rank=8, alpha=16, targets=("q", "v"), adapted_modules=4, adapter_params=1_000,
                         quantizable_params=640_000, quantizable_rows=2_000, quantizable_tensors=4,
                         largest_quantizable_params=250_000)


def test_quantised_bytes_by_hand() -> None:
    # int8: 1 byte per weight + one fp32 scale per row (LLM.int8)
    assert quantized_weight_bytes("int8", 640_000, 2_000) == 640_000 + 4 * 2_000
    # NF4: half a byte + one fp32 absmax per 64 (QLoRA §3: 0.5 bits/param of constants)
    assert quantized_weight_bytes("nf4", 640_000, 2_000) == 320_000 + 4 * 10_000
    # double quantisation: 8-bit absmax per 64 + fp32 per 256 of them (0.127 bits/param)
    assert quantized_weight_bytes("nf4-dq", 640_000, 2_000) == pytest.approx(320_000 + 10_000 + 4 * 10_000 / 256)
    assert quantized_weight_bytes("none", 640_000, 2_000) == 2 * 640_000


@pytest.mark.parametrize("quant", ["nf4", "nf4-dq", "int8"])
def test_quantised_bytes_match_bitsandbytes(quant: str) -> None:
    """The packed weight and its quant state, as bitsandbytes 0.45+ makes them on the CPU, for two odd shapes."""
    bnb = pytest.importorskip("bitsandbytes")
    torch = pytest.importorskip("torch")
    shapes = ((1000, 300), (77, 130))
    real = 0
    for d_in, d_out in shapes:
        if quant == "int8":
            layer = bnb.nn.Linear8bitLt(d_in, d_out, bias=False, has_fp16_weights=False).to("cpu")
            w = layer.weight
            real += w.numel() * w.element_size() + w.SCB.numel() * w.SCB.element_size()
        else:
            layer = bnb.nn.Linear4bit(d_in, d_out, bias=False, quant_type="nf4", compute_dtype=torch.bfloat16,
                                      compress_statistics=quant == "nf4-dq").to("cpu")
            w, qs = layer.weight, layer.weight.quant_state
            real += w.numel() * w.element_size() + qs.absmax.numel() * qs.absmax.element_size()
            if qs.nested:
                real += qs.state2.absmax.numel() * qs.state2.absmax.element_size()
    elements = sum(a * b for a, b in shapes)
    rows = sum(b for _, b in shapes)
    assert quantized_weight_bytes(quant, elements, rows, len(shapes)) == pytest.approx(real, abs=8)


def test_frozen_base_bytes() -> None:
    frozen = 900_000  # 640k quantisable Linear weights + 260k embeddings, norms, head
    assert frozen_weight_bytes(ADAPTER, frozen, "none") == 2 * frozen
    assert frozen_weight_bytes(ADAPTER, frozen, "none", fp32_base=True) == 4 * frozen
    nf4 = quantized_weight_bytes("nf4", 640_000, 2_000, 4)
    assert frozen_weight_bytes(ADAPTER, frozen, "nf4") == pytest.approx(nf4 + 2 * 260_000)
    assert frozen_weight_bytes(ADAPTER, frozen, "nf4", fp32_base=True) == pytest.approx(nf4 + 2 * 260_000)
    assert dequantized_weight_bytes(ADAPTER, "nf4") == 500_000
    assert dequantized_weight_bytes(ADAPTER, "none") == 0 == dequantized_weight_bytes(None, "nf4")


def _lora_profile():  # type: ignore[no-untyped-def]
    base = make_profile(params=1_001_000, trainable=1_000, layers=4, hidden=64, seq=128)
    return base.model_copy(update={"adapter": ADAPTER})


@pytest.mark.parametrize("precision,quant,weights,grads,optim", [
    # fp32 adapters (4 B) + 16-bit base; fp32 grads; AdamW moments 8 B
    ("amp-bf16", "none", 1_000 * 4 + 1_000_000 * 2, 1_000 * 4, 1_000 * 8),
    # bf16 adapters, bf16 moments (TRL's QLoRA adapters) on an NF4-DQ base
    ("bf16-pure", "nf4-dq", 1_000 * 2 + quantized_weight_bytes("nf4-dq", 640_000, 2_000, 4) + 360_000 * 2,
     1_000 * 2, 1_000 * 4),
    # fp32 throughout: the base too
    ("fp32", "none", 1_001_000 * 4, 1_000 * 4, 1_000 * 8),
])
def test_lora_model_states_by_hand(precision: str, quant: str, weights: float, grads: int, optim: int) -> None:
    s = Strategy(precision=precision, engine="torch", quant=quant)  # type: ignore[arg-type]
    states = model_states(_lora_profile(), s)
    assert states.params_bytes == round(weights)
    assert (states.grads_bytes, states.optimizer_bytes) == (grads, optim)


def test_full_training_is_unchanged_by_the_finetune_fields() -> None:
    p = make_profile(params=1_001_000, layers=4, hidden=64, seq=128)
    s = Strategy(precision="bf16", engine="torch")
    assert model_states(p, s).params_bytes == 2 * 1_001_000


def test_quantised_buffers() -> None:
    p = _lora_profile()
    items = buffer_items(p, Strategy(precision="bf16-pure", engine="torch", quant="nf4-dq"))
    assert items["bnb_dequantized_weight"] == 500_000
    ckpt = buffer_items(p, Strategy(precision="bf16-pure", engine="torch", quant="int8", checkpointing="full", mbs=2))
    assert ckpt["bnb_int8_checkpoint_inputs"] == int8_checkpoint_kept_bytes(64, 256, 4, 128, 2) == 2 * 448 * 128 * 2 * 4
    assert "bnb_int8_checkpoint_inputs" not in buffer_items(p, Strategy(precision="bf16-pure", engine="torch",
                                                                        quant="int8"))


def test_quantised_strategy_checks() -> None:
    cluster = Cluster(gpu=make_gpu(24), gpus=1, gpus_per_node=1)
    with pytest.raises(OptplanError, match="add --finetune qlora"):
        check_strategy(make_profile(), cluster, Strategy(precision="bf16", engine="torch", quant="nf4"))
    with pytest.raises(OptplanError, match="not Megatron"):
        check_strategy(_lora_profile(), cluster, Strategy(precision="bf16", engine="megatron"))
    with pytest.raises(ValueError, match="torch or deepspeed engine"):
        Strategy(precision="bf16", engine="megatron", quant="nf4")
    with pytest.raises(ValueError, match="offload"):
        Strategy(precision="bf16", zero=2, offload_optimizer="cpu", quant="nf4")
    assert "base-nf4-dq" in Strategy(precision="bf16-pure", engine="torch", quant="nf4-dq").label()


def test_fsdp_gathers_a_quantised_base_as_held_and_reduces_adapter_gradients_only() -> None:
    """FSDP flattens the NF4 weights as they are (transformers' FSDP-QLoRA guide): a gathered unit is priced at the
    frozen base's mean bytes per parameter, not the recipe's 2, and the reduce-scatter at the adapters' share."""
    p = _lora_profile()
    s = Strategy(precision="bf16-pure", engine="torch", fsdp="full", dp=2, quant="nf4-dq")
    items = buffer_items(p, s)
    mean = (quantized_weight_bytes("nf4-dq", 640_000, 2_000, 4) + 360_000 * 2 + 1_000 * 2) / 1_001_000
    unit = p.repeated_block.params_per_block  # type: ignore[union-attr]
    assert items["fsdp_unsharded_units"] == items["fsdp_prefetched_unit"] == round(unit * mean)
    assert mean < 0.6 * 2  # 64 % of the weights 4-bit: well under the 16-bit recipe's 2 bytes
    # bf16-pure: no MixedPrecisionPolicy, so FSDP2 reduce-scatters in the gradients' bf16 (fsdp_grad_sync.py)
    assert items["fsdp_reduce_scatter_unit"] == round(unit * 1_000 / 1_001_000 * 2)
    full = buffer_items(p.model_copy(update={"adapter": None, "trainable_params": p.params}),
                        s.model_copy(update={"quant": "none"}))
    assert full["fsdp_unsharded_units"] == round(unit * 2)  # full training keeps the recipe's bytes
