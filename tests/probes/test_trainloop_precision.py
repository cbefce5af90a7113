"""probes/trainloop.py (also the exported train.py): the loss under the engine's autocast, and the CUDA arch list
DeepSpeed's op builder can read."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from optplan.probes.trainloop import Trainer, deepspeed_arch_list


def _loss_dtype(trainer: Trainer) -> torch.dtype:
    """The dtype of a matmul taken where the loop takes its loss (outside the module's forward)."""
    trainer.apply_precision(nn.Linear(4, 4))
    with trainer._autocast(), trainer._loss_autocast():
        return (torch.ones(2, 4) @ torch.ones(4, 4)).dtype


@pytest.mark.parametrize(("ds_config", "want"), [
    ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, torch.bfloat16),
    ({"bf16": {"enabled": True}}, torch.float32),  # 16-bit weights: no autocast; the inputs are cast instead
    ({}, torch.float32),
])
def test_deepspeed_loss_runs_under_its_autocast(ds_config: dict, want: torch.dtype) -> None:
    """DeepSpeed's torch_autocast covers engine.forward only; the loop's loss is taken under the same autocast,
    as torch AMP takes it (the H200's GPT-2 AMP runs under DeepSpeed had one fp32 logits tensor per sample less
    than the prediction while their cross entropy ran in bf16)."""
    trainer = Trainer({"engine": "deepspeed", "precision": "amp-bf16", "zero": 1}, ds_config=ds_config)
    assert _loss_dtype(trainer) == want


def test_accelerate_and_torch_amp_take_the_loss_under_autocast() -> None:
    assert _loss_dtype(Trainer({"engine": "torch", "precision": "amp-bf16"}, use_accelerate=True)) == torch.bfloat16
    torch_amp = Trainer({"engine": "torch", "precision": "amp-bf16"})
    assert _loss_dtype(torch_amp) == torch.bfloat16
    torch_amp.apply_precision(nn.Linear(4, 4))
    assert torch_amp._loss_autocast().__class__.__name__ == "nullcontext"  # the step's own autocast covers it
    assert _loss_dtype(Trainer({"engine": "torch", "precision": "fp32"})) == torch.float32


@pytest.mark.parametrize(("given", "want"), [
    (None, None), ("9.0", "9.0"), ("9.0a", "9.0"), ("8.0;9.0;9.0a;10.0f+PTX", "8.0;9.0;10.0+PTX"),
    ("7.5 8.0 9.0a 12.0+PTX", "7.5 8.0 9.0 12.0+PTX"), ("9.0a+PTX", "9.0+PTX"),
])
def test_arch_list_deepspeed_can_parse(given: str | None, want: str | None) -> None:
    assert deepspeed_arch_list(given) == want


def test_importing_deepspeed_fixes_the_arch_list_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    notes: list[str] = []
    trainer = Trainer({"engine": "deepspeed", "precision": "fp32", "zero": 1}, ds_config={}, notes=notes)
    trainer._deepspeed_arch_list()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0"
    assert len(notes) == 1 and "'8.0;9.0a' read as '8.0;9.0'" in notes[0]


def test_fp8_keeps_bf16_weights_and_master_copies_and_says_so_on_cpu() -> None:
    """An fp8 plan's weights, gradients and master copies are bf16's (estimators/precision.py); on the cpu device
    its matmuls stay bf16 and the run says so (it trained in fp32, silently, before)."""
    notes: list[str] = []
    trainer = Trainer({"engine": "torch", "precision": "fp8"}, notes=notes)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    trainer.apply_precision(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert trainer.input_dtype == torch.bfloat16
    assert trainer.build_optimizer(list(model.parameters())) is trainer.master is not None
    assert any("fp8 on the cpu device" in n for n in notes)


def test_fp8_on_cuda_needs_fp8_tensor_cores_and_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    from optplan.probes.trainloop import TrainFailure

    trainer = Trainer({"engine": "torch", "precision": "fp8"}, device_type="cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_a: (8, 0))
    with pytest.raises(TrainFailure, match=r"compute capability >= 8.9.*8\.0: plan with --precision bf16"):
        trainer.apply_fp8(nn.Linear(16, 16))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_a: (9, 0))
    monkeypatch.setitem(__import__("sys").modules, "torchao", None)  # not installed
    monkeypatch.setitem(__import__("sys").modules, "torchao.float8", None)
    with pytest.raises(TrainFailure, match="pip install torchao, or plan with --precision bf16"):
        trainer.apply_fp8(nn.Linear(16, 16))
