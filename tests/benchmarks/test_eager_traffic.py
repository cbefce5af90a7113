"""benchmarks/eager_traffic.py: the eager layer counts are linear in the widths and say what they claim."""

from __future__ import annotations

import yaml

from benchmarks import eager_traffic as et


def test_counts_are_linear_in_the_widths_and_gated_layers_move_more() -> None:
    gated, g_worst = et.fit(et.gated_rows("amp"), et.TERMS)
    plain, p_worst = et.fit(et.plain_rows("amp"), ("h", "ffn", "head_dim"))
    assert g_worst < 0.01 and p_worst < 0.01
    # a plain (nanoGPT) layer under bf16 autocast: the FFN's GELU reads and writes F bf16 values (4 B) per token
    # forward; its backward reads the gradient and the input and writes one (6 B) plus the bias gradient's read (2 B)
    assert abs(plain["fwd"]["ffn"] - 4.0) < 0.1 and abs(plain["bwd"]["ffn"] - 8.0) < 0.1
    llama = dict(et.SHAPES[2][2])
    same_width = {"h": llama["h"], "ffn": llama["ffn"], "head_dim": llama["head_dim"]}
    g = et.bytes_at(gated["fwd"], llama) + et.bytes_at(gated["bwd"], llama)
    p = et.bytes_at(plain["fwd"], same_width) + et.bytes_at(plain["bwd"], same_width)
    assert g > 2.0 * p  # RMSNorm in fp32, RoPE and the repeated k/v: the gap a single multiplier cannot see


def test_the_packaged_coefficients_are_the_benchmarks_fit() -> None:
    fits, residuals = et.fit_all()
    packaged = yaml.safe_load(et.DATA.read_text(encoding="utf-8"))
    assert et.data_document(fits, max(residuals.values())) == packaged, (
        "rerun: python benchmarks/eager_traffic.py --write")
