"""benchmarks/compiled_activations_cpu.py measures what a forward holds for the backward in a subprocess: its eager
path (the compiled one takes minutes of Inductor on this CPU and runs in the benchmark only) reproduces the module's
figures, and its optplan counts are the estimators' own."""

from __future__ import annotations

import pytest
from factories import load_benchmark

bench = load_benchmark("compiled_activations_cpu.py")


def test_the_optplan_counts_are_korthikantis_and_the_op_policys() -> None:
    llama, gpt2 = bench.optplan_counts("llama"), bench.optplan_counts("gpt2")
    assert llama["none"] == pytest.approx(12 + 4 * 128 / 512 + 8 * 1792 / 512)  # 12 h + 4 kv + 8 F
    assert gpt2["none"] == pytest.approx(34)  # Korthikanti's 34 h (no dropout masks counted apart)
    assert 0 < llama["selective"] < llama["none"] and 0 < gpt2["selective"] < gpt2["none"]


def test_an_eager_llama_block_holds_more_than_the_formula_and_gpt2_about_it() -> None:
    """examples/llama.py's eager block keeps its RMSNorms' fp32 tensors and the repeated k/v (about 52 h at 8,192
    tokens against the formula's 41 h); GPT-2's fused LayerNorm and GELU keep about the formula's count."""
    llama = bench.saved_over_h("llama", "none", False, tokens=2048)
    gpt2 = bench.saved_over_h("gpt2", "none", False, tokens=2048)
    assert llama > 1.15 * bench.optplan_counts("llama")["none"]
    assert gpt2 == pytest.approx(bench.optplan_counts("gpt2")["none"], rel=0.15)
