"""estimators/optimizer_traffic.py: the optimizer step's HBM bytes per parameter, checked against the bytes the
installed torch's own AdamW reads and writes (counted by a dispatch mode over ``optimizer.step()``)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.optimizer_time import optimizer_step_s
from optplan.estimators.optimizer_traffic import (
    master_handling_bytes,
    optimizer_step_bytes_per_param,
    unfused_step_note,
)
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy


class _Traffic(TorchDispatchMode):
    """Bytes every ATen op reads (distinct tensor arguments) and writes (mutated arguments, else outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)

        def tensors(obj: object) -> list[torch.Tensor]:
            return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]

        seen: set[tuple[int, int]] = set()
        for t in tensors((args, kwargs)):
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key not in seen:
                seen.add(key)
                self.bytes += t.numel() * t.element_size()
        written = [v for a, v in zip(func._schema.arguments, args, strict=False)
                   if a.alias_info is not None and a.alias_info.is_write]
        self.bytes += sum(t.numel() * t.element_size() for t in tensors(written if written else out))
        return out


def _counted_bytes_per_param(**impl: bool) -> float:
    n = 1 << 14
    params = [torch.nn.Parameter(torch.randn(n)) for _ in range(3)]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **impl)
    for _ in range(2):  # the first step creates the moments
        for p in params:
            p.grad = torch.randn(n)
        if _ == 0:
            opt.step()
    with _Traffic() as traffic:
        opt.step()
    return traffic.bytes / (3 * n)


@pytest.mark.parametrize(("impl", "kwargs"), [("foreach", {"foreach": True}), ("single_tensor", {"foreach": False})])
def test_unfused_adamw_traffic_is_torchs_own(impl: str, kwargs: dict[str, bool]) -> None:
    """80 bytes per fp32 parameter: eight element-wise passes, as torch/optim/adam.py runs them."""
    want = optimizer_step_bytes_per_param("adamw", get_recipe("amp-bf16"), 8, impl)  # type: ignore[arg-type]
    assert want == 80
    assert _counted_bytes_per_param(**kwargs) == pytest.approx(want)


def test_fused_adamw_is_one_pass() -> None:
    """torch._fused_adamw_ reads the parameter, gradient and moments and writes back all but the gradient (the
    dispatch schema also marks the gradients mutable, for unscaling: 4 bytes the kernel does not write)."""
    want = optimizer_step_bytes_per_param("adamw", get_recipe("amp-bf16"), 8, "fused")
    assert want == 28
    assert _counted_bytes_per_param(fused=True) == pytest.approx(want + 4)


def test_master_weights_add_the_copies_around_the_step() -> None:
    bf16 = get_recipe("bf16")
    assert master_handling_bytes(bf16) == 2 + 4 + 4 + 2
    assert master_handling_bytes(get_recipe("amp-bf16")) == 0
    assert optimizer_step_bytes_per_param("adamw", bf16, 8, "foreach") == 80 + 12
    pure = get_recipe("bf16-pure")  # 16-bit weights and moments, no master: half of every pass
    assert optimizer_step_bytes_per_param("adamw", pure, 4, "foreach") == 40
    # SGD keeps the one-kernel count over its own state (momentum, 4 bytes)
    assert optimizer_step_bytes_per_param("sgd", get_recipe("fp32"), 4, "foreach") == 2 * 4 + 4 + 2 * 4
    with pytest.raises(ValueError, match="state_bytes_per_param"):
        optimizer_step_bytes_per_param("adamw", bf16, -1, "fused")


def test_torch_engine_steps_slower_than_a_fused_engine(profile: ModelProfile) -> None:
    """torch's default AdamW on CUDA is foreach (80 B/param); DeepSpeed's FusedAdam one pass (28 B/param);
    a probe that hands DeepSpeed a torch optimizer says so with adam_impl."""
    gpu = find_gpu("H200")
    torch_s = Strategy(precision="amp-bf16", mbs=1, engine="torch")
    ds = Strategy(precision="amp-bf16", mbs=1, engine="deepspeed", zero=1)
    p = float(profile.params)
    t = optimizer_step_s(p, torch_s, gpu, profile, shard_ranks=1, hbm_fraction=0.8)
    f = optimizer_step_s(p, ds, gpu, profile, shard_ranks=1, hbm_fraction=0.8)
    assert t == pytest.approx(p * 80 / (gpu.memory_bandwidth_bytes_per_s * 0.8))
    assert t / f == pytest.approx(80 / 28)
    assert optimizer_step_s(p, ds, gpu, profile, shard_ranks=1, hbm_fraction=0.8,
                            adam_impl="foreach") == pytest.approx(t)


def test_an_expensive_unfused_step_is_said_with_the_fused_alternative() -> None:
    bf16 = get_recipe("bf16")
    note = unfused_step_note("adamw", bf16, 8, "foreach", optimizer_s=0.0289, step_s=0.0823)
    assert note is not None and "92 B per parameter" in note and "35 % of the step" in note
    assert "fused=True" in note and "40 B, about 12.6 ms" in note
    assert unfused_step_note("adamw", bf16, 8, "fused", optimizer_s=0.0289, step_s=0.0823) is None
    assert unfused_step_note("adamw", bf16, 8, "foreach", optimizer_s=0.001, step_s=0.0823) is None  # 1 %: quiet
    assert unfused_step_note("sgd", bf16, 4, "foreach", optimizer_s=0.05, step_s=0.0823) is None


def test_estimates_carry_the_note_for_torch_not_for_deepspeed() -> None:
    """1B parameters at micro-batch 1: the foreach step is over a quarter of the step; at 64 it is a few %."""
    big = make_profile(params=1_000_000_000, hidden=2048, layers=24)
    cluster = Cluster(gpu=find_gpu("H200"), gpus=1, gpus_per_node=1)

    def said(strategy: Strategy) -> list[str]:
        return [n for n in estimate(big, cluster, strategy).notes if "AdamW's default" in n]

    assert len(said(Strategy(precision="bf16", mbs=1, engine="torch"))) == 1
    assert said(Strategy(precision="bf16", mbs=64, engine="torch")) == []
    assert said(Strategy(precision="bf16", mbs=1, engine="deepspeed", zero=1)) == []
