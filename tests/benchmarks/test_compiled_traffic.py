"""benchmarks/compiled_traffic.py: Inductor's count of a compiled block's bytes, what the packaged data says."""

from __future__ import annotations

import pytest
import torch
import yaml

from benchmarks import compiled_traffic as ct
from optplan.estimators.eager_traffic import compiled_traffic_data, layer_bytes_per_token


def test_a_compiled_llama_block_moves_what_the_packaged_fit_says() -> None:
    ct._quiet_inductor()
    llama = ct._load("llama")
    cfg = llama.make_config("1B", dim=256, ffn_dim=768, n_heads=4, n_kv_heads=2, n_layers=1, vocab_size=512)
    model = llama.Llama(cfg)
    run = ct._runner(model, list(model.layers), lambda b: torch.randint(0, 512, (b, ct.SEQ)), llama.loss_fn, "bf16")
    measured = ct.per_token(run)
    widths = {"kind": "gated", "precision": "bf16", "hidden": 256.0, "ffn": 768.0, "kv": 128.0, "head_dim": 64.0,
              "grouped_query": True}
    packaged, backward = layer_bytes_per_token(**widths, compiled=True)  # type: ignore[arg-type]
    assert backward == 0.0  # forward and backward in one figure
    assert measured == pytest.approx(packaged, rel=0.01)
    eager = sum(layer_bytes_per_token(**widths))  # type: ignore[arg-type]
    assert measured < 0.5 * eager  # Inductor fuses the fp32 RMSNorm, RoPE, the k/v repeat and SwiGLU
    # and moves more than Megatron's hand-fused count for the same layer
    assert measured > ct.megatron_count({"h": 256.0, "ffn": 768.0}, "gated")


def test_the_packaged_document_is_the_benchmarks_format() -> None:
    packaged = yaml.safe_load(ct.DATA.read_text(encoding="utf-8"))
    data = compiled_traffic_data()
    assert set(packaged["blocks"]) == {"gated", "plain"} == set(data.blocks)
    for kind, by_precision in data.blocks.items():
        assert set(by_precision) == {"fp32", "amp", "bf16"}
        for coef in by_precision.values():
            assert coef["bwd"].h == coef["bwd"].ffn == 0.0 and coef["fwd"].h > 0, kind
    doc = ct.data_document(packaged["blocks"], 0.0005)
    assert doc["unit"] == packaged["unit"] and doc["blocks"] == packaged["blocks"]
