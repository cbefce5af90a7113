"""The profiler's measurement of the quantised layers' inputs (what an old bitsandbytes keeps), LoRA dropout in the
profile, and dropout profiled with CUDA's bool mask."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

import torch  # noqa: E402

from optplan.estimators.finetune import LoraRequest  # noqa: E402
from optplan.probes.dropout import gpu_dropout  # noqa: E402
from optplan.probes.loader import profile_model_file  # noqa: E402
from optplan.probes.quant_inputs import bnb_keeps_4bit_inputs_here  # noqa: E402

H, F, LAYERS, SEQ = 64, 160, 3, 32  # conftest.TINY_HF_LLAMA
def _bf16_per_sample(prof) -> float:  # type: ignore[no-untyped-def]
    return next(a.per_sample_bytes for a in prof.activations
                if a.precision == "bf16-weights" and a.checkpointing == "none")


def test_quant_inputs_and_dropout_in_the_profile(tiny_hf_llama_file: Path) -> None:
    plain = profile_model_file(tiny_hf_llama_file, seq_len=SEQ, lora=LoraRequest(rank=4))
    dropped = profile_model_file(tiny_hf_llama_file, seq_len=SEQ, lora=LoraRequest(rank=4, dropout=0.05))
    qv = profile_model_file(tiny_hf_llama_file, seq_len=SEQ, lora=LoraRequest(rank=4, targets=("q_proj", "v_proj")))
    for prof in (plain, dropped, qv):
        assert prof.adapter is not None
        # attention in, attention out, MLP in (h each: q/k/v and gate/up read one tensor) and MLP out (F)
        assert prof.adapter.quant_input_elements == 3 * H + F
        assert prof.adapter.bnb_4bit_keeps_inputs is bnb_keeps_4bit_inputs_here()
    assert (plain.adapter.dropout, dropped.adapter.dropout) == (0.0, 0.05)  # type: ignore[union-attr]
    # without dropout every adapted layer's lora_A keeps its input; the attention output is a view of the
    # attention's own saved output (SDPA)
    assert plain.adapter.quant_input_unkept_elements == 0  # type: ignore[union-attr]
    # with dropout lora_A keeps the dropped copy instead: all but the attention output go unkept
    assert dropped.adapter.quant_input_unkept_elements == 2 * H + F  # type: ignore[union-attr]
    # q and v adapted: their input is kept; the MLP's input and the MLP output are not
    assert qv.adapter.quant_input_unkept_elements == H + F  # type: ignore[union-attr]
    # dropout's memory, per token and block, as a GPU keeps it: each of the 7 adapted layers keeps a 16-bit dropped
    # input and a bool mask (3 bytes per input element: 6 layers read h, down_proj reads F), where the inputs
    # themselves (2h + F, 2 bytes) are no longer kept; the first block (no input gradient) and the extrapolation
    # from 2 blocks make it approximate
    expected = (3 * (6 * H + F) - 2 * (2 * H + F)) * SEQ * LAYERS
    assert _bf16_per_sample(dropped) - _bf16_per_sample(plain) == pytest.approx(expected, rel=0.1)


def test_gpu_dropout_keeps_a_bool_mask() -> None:
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.dtype] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.Dropout(0.25)(x)
    assert saved == [torch.bfloat16]  # the CPU's dropout keeps a noise tensor of the input's dtype
    saved.clear()
    with gpu_dropout(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = torch.nn.Dropout(0.25)(x)
    assert saved == [torch.bool]  # CUDA's fused kernel: a bool mask
    y.float().sum().backward()
    kept = (y != 0).float()
    assert torch.allclose(x.grad.float(), kept / 0.75, rtol=1e-2)  # type: ignore[union-attr]  # bf16 scale
    assert torch.nn.functional.dropout(x, 0.25, training=False) is x  # eval mode is untouched
