"""probes/trainloop.py (also the exported train.py): the dtype FSDP2 reduces gradients in follows the plan's
``fsdp_reduce_dtype`` (estimators/fsdp_grad_sync.py prices the bytes), fp32 under the mixed recipes by default."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.device_mesh as device_mesh
import torch.distributed.fsdp as fsdp
from torch import nn

from optplan.probes.trainloop import Trainer


def _policies(monkeypatch: pytest.MonkeyPatch, **strategy: Any) -> list[Any]:
    """The ``mp_policy`` each ``fully_shard`` call of Trainer.apply_fsdp receives (None without one)."""
    calls: list[Any] = []
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda *a, **k: "mesh")
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: calls.append(kw.get("mp_policy")))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    Trainer({"engine": "torch", "fsdp": "full", **strategy}).apply_fsdp(model, list(model), torch.device("cpu"))
    assert len(calls) == 3  # each block, then the root
    return calls


@pytest.mark.parametrize(("precision", "reduce", "param_dtype", "reduce_dtype"), [
    ("bf16", "auto", torch.bfloat16, torch.float32),
    ("bf16", "fp32", torch.bfloat16, torch.float32),
    ("bf16", "bf16", torch.bfloat16, torch.bfloat16),
    ("fp16", "fp16", torch.float16, torch.float16),
    ("fp8", "bf16", torch.bfloat16, torch.bfloat16),
    ("bf16-pure", "fp32", None, torch.float32),
])
def test_the_policy_reduces_as_the_plan_says(monkeypatch: pytest.MonkeyPatch, precision: str, reduce: str,
                                             param_dtype: torch.dtype | None, reduce_dtype: torch.dtype) -> None:
    for policy in _policies(monkeypatch, precision=precision, fsdp_reduce_dtype=reduce):
        assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)


def test_bf16_pure_by_default_has_no_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    # FSDP2 then reduces in the parameters' bf16, which fsdp_reduce_bytes("bf16-pure") prices
    assert _policies(monkeypatch, precision="bf16-pure") == [None, None, None]
