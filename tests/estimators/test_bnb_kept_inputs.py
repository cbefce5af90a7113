"""The quantised layers' inputs bitsandbytes keeps on autograd nodes: the version rule, hand-worked bytes for each
case (current step without and with checkpointing, a held earlier step, int8 against 4-bit), the memory item, and
the profile hash."""

from __future__ import annotations

import pytest

from optplan.estimators.finetune import AdapterProfile, bnb_kept_input_bytes, bnb_version_keeps_4bit_inputs
from optplan.estimators.memory import buffer_items
from optplan.estimators.strategy import Strategy
from optplan.planner.calibrate import profile_hash
from tests.factories import make_profile

BASE = AdapterProfile(rank=8, alpha=16, targets=("q", "v"), adapted_modules=4, adapter_params=1_000,
                      quantizable_params=640_000, quantizable_rows=2_000, quantizable_tensors=4,
                      largest_quantizable_params=250_000)
MEASURED = BASE.model_copy(update={"quant_input_elements": 448, "quant_input_unkept_elements": 384})
"""A block of hidden 64 and MLP width 256: 3·64 + 256 distinct inputs per token, all but one h kept by autograd."""


@pytest.mark.parametrize("version,keeps", [
    ("0.41.1", True), ("0.42.0", True), ("0.43.1", True), ("0.43.2", False), ("0.43.2.dev0", False),
    ("0.44.0", False), ("0.50.2", False), ("1.0", False), ("0.43", True), ("", False), ("main", False),
])
def test_bitsandbytes_version_rule(version: str, keeps: bool) -> None:
    # bitsandbytes PR #1270 (commit 9e753741, first in 0.43.2) stopped keeping MatMul4Bit's input
    assert bnb_version_keeps_4bit_inputs(version) is keeps


def test_kept_bytes_by_hand() -> None:
    tokens, mbs, layers = 128, 2, 4
    old = MEASURED.model_copy(update={"bnb_4bit_keeps_inputs": True})
    kw = dict(tokens=tokens, micro_batch=mbs, layers=layers)
    # current bitsandbytes keeps no 4-bit input; none without quantisation or adapters
    assert bnb_kept_input_bytes(MEASURED, "nf4", checkpointing=False, **kw) == 0
    assert bnb_kept_input_bytes(old, "none", checkpointing=False, **kw) == 0
    assert bnb_kept_input_bytes(None, "nf4", checkpointing=False, **kw) == 0
    # old 4-bit, this step only: the unkept inputs, 2 bytes each; all of them under checkpointing
    assert bnb_kept_input_bytes(old, "nf4", checkpointing=False, **kw) == 2 * 384 * tokens * mbs * layers
    assert bnb_kept_input_bytes(old, "nf4-dq", checkpointing=True, **kw) == 2 * 448 * tokens * mbs * layers
    # a loop holding the last step's graph adds all of that step's inputs
    held = old.model_copy(update={"graph_held_steps": 2})
    assert bnb_kept_input_bytes(held, "nf4", checkpointing=False, **kw) == 2 * (384 + 448) * tokens * mbs * layers
    # int8 keeps them with every bitsandbytes; tensor parallelism splits them
    assert bnb_kept_input_bytes(MEASURED, "int8", checkpointing=True, **kw) == 2 * 448 * tokens * mbs * layers
    assert bnb_kept_input_bytes(MEASURED, "int8", checkpointing=True, tp=2, **kw) == 448 * tokens * mbs * layers


def test_memory_item_uses_the_measured_inputs() -> None:
    profile = make_profile(params=1_001_000, trainable=1_000, layers=4, hidden=64, seq=128)
    old = profile.model_copy(update={"adapter": MEASURED.model_copy(update={"bnb_4bit_keeps_inputs": True})})
    items = buffer_items(old, Strategy(precision="bf16-pure", engine="torch", quant="nf4", mbs=2))
    assert items["bnb_kept_inputs"] == 2 * 384 * 128 * 2 * 4
    ckpt = buffer_items(old, Strategy(precision="bf16-pure", engine="torch", quant="int8", mbs=2, checkpointing="full"))
    assert ckpt["bnb_int8_checkpoint_inputs"] == 2 * 448 * 128 * 2 * 4
    current = profile.model_copy(update={"adapter": MEASURED})
    assert "bnb_kept_inputs" not in buffer_items(current, Strategy(precision="bf16-pure", engine="torch", quant="nf4"))


def test_profile_hash_counts_the_new_adapter_fields_when_set() -> None:
    profile = make_profile(params=1_001_000, trainable=1_000, layers=4, hidden=64, seq=128)
    old_hash = profile_hash(profile.model_copy(update={"adapter": BASE}))
    for update in ({"dropout": 0.05}, {"graph_held_steps": 2}, {"bnb_4bit_keeps_inputs": True},
                   {"quant_input_elements": 448}):
        assert profile_hash(profile.model_copy(update={"adapter": BASE.model_copy(update=update)})) != old_hash


def test_dequant_bytes_by_hand() -> None:
    from optplan.estimators.finetune import dequant_bytes_per_layer, quantized_weight_bytes

    nf4 = quantized_weight_bytes("nf4", 640_000, 2_000, 4)
    # per pass: the packed weight read + its 16-bit copy written; forward and input gradient, + recompute
    assert dequant_bytes_per_layer(BASE, "nf4", 4, recompute_share=0.0) == pytest.approx(2 * (nf4 + 2 * 640_000) / 4)
    assert dequant_bytes_per_layer(BASE, "nf4", 4, recompute_share=1.0, tp=2) == pytest.approx(
        3 * (nf4 + 2 * 640_000) / 4 / 2)
    assert dequant_bytes_per_layer(BASE, "int8", 4, recompute_share=0.0) == 0  # LLM.int8 is not priced so
    assert dequant_bytes_per_layer(BASE, "none", 4, recompute_share=0.0) == 0
    assert dequant_bytes_per_layer(None, "nf4", 4, recompute_share=0.0) == 0


def test_step_time_prices_the_dequantisation_as_memory_traffic() -> None:
    from optplan.estimators.finetune import DEQUANT_BANDWIDTH_FRACTION, dequant_bytes_per_layer
    from optplan.estimators.hardware import Cluster
    from optplan.estimators.timing import step_time
    from tests.factories import make_gpu

    profile = make_profile(params=1_001_000, trainable=1_000, layers=4, hidden=64, seq=128)
    profile = profile.model_copy(update={"adapter": MEASURED})
    cluster = Cluster(gpu=make_gpu(24), gpus=1, gpus_per_node=1)
    base = Strategy(precision="bf16-pure", engine="torch", mbs=2, grad_accum=3)
    plain = step_time(profile, base, cluster)
    quant = step_time(profile, base.model_copy(update={"quant": "nf4"}), cluster)
    per_mb = 4 * dequant_bytes_per_layer(MEASURED, "nf4", 4, recompute_share=0.0)
    expected = 3 * per_mb / (cluster.gpu.memory_bandwidth_bytes_per_s * DEQUANT_BANDWIDTH_FRACTION)
    assert quant.memory_bound_s - plain.memory_bound_s == pytest.approx(expected, rel=1e-9)
    assert quant.compute_s == plain.compute_s
    assert quant.step_s > plain.step_s
