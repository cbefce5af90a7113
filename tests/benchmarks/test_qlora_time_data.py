"""benchmarks/data/qlora_time_published.json: every runtime pair is cited and names the memory benchmark's rows of
the same runs, and the measured overhead per micro-batch follows from the runtimes by hand."""

from __future__ import annotations

import pytest

from benchmarks import fidelity_finetune_published as memory_bench
from benchmarks import fidelity_qlora_time as bench

DOC = bench.load()
_, MEMORY_ROWS = memory_bench.load_rows()
BY_ID = {row["id"]: row for row in MEMORY_ROWS}


def test_pairs_name_the_runs_of_the_memory_benchmark() -> None:
    assert len(DOC["rows"]) >= 8
    for pair in DOC["rows"]:
        assert "http" in pair["source_detail"]
        lora, qlora = BY_ID[pair["lora_row"]], BY_ID[pair["qlora_row"]]
        assert (lora["method"], qlora["method"]) == ("lora", "qlora")
        assert (lora["micro_batch"], qlora["micro_batch"]) == (pair["lora_micro_batch"], pair["qlora_micro_batch"])
        assert lora["gpu"] == qlora["gpu"] == pair["gpu"] and lora["gpus"] == qlora["gpus"] == pair["gpus"] == 1
        assert qlora["quant"] in ("nf4", "nf4-dq")
        assert pair["qlora_runtime_min"] > pair["lora_runtime_min"] > 0


def test_measured_overhead_by_hand() -> None:
    pair = {"epochs": 4, "qlora_micro_batch": 2, "lora_runtime_min": 32.82, "qlora_runtime_min": 45.67}
    # 4 x 1,900 samples; (45.67 - 32.82) min over them, times 2 samples per micro-batch
    assert bench.measured_overhead_s(pair, 1900) == pytest.approx((45.67 - 32.82) * 60 / 7600 * 2)
