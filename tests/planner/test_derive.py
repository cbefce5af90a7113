"""Strategy flags -> one consistent Strategy: derived degrees, accumulation, engine and offload."""

from __future__ import annotations

import pytest
from conftest import make_gpu

from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import Cluster
from optplan.planner.derive import StrategyFlags, derive_strategy

C64 = Cluster(gpu=make_gpu(), gpus=64, gpus_per_node=8)


def test_dp_is_derived_from_the_other_degrees() -> None:
    s = derive_strategy(StrategyFlags(tp=4, pp=2, cp=2), C64)
    assert (s.dp, s.tp, s.pp, s.cp, s.world_size) == (4, 4, 2, 2, 64)
    assert s.sp and s.engine == "megatron"


def test_gas_follows_the_global_batch() -> None:
    s = derive_strategy(StrategyFlags(tp=8, mbs=2, global_batch=256), C64)
    assert s.dp == 8 and s.grad_accum == 16 and s.global_batch == 256


def test_engine_and_offload_defaults() -> None:
    assert derive_strategy(StrategyFlags(fsdp="full"), C64).engine == "torch"
    assert derive_strategy(StrategyFlags(zero=2), C64).engine == "deepspeed"
    ds = derive_strategy(StrategyFlags(zero=3, offload="params"), C64)
    assert (ds.offload_optimizer, ds.offload_params) == ("cpu", "cpu")
    fsdp = derive_strategy(StrategyFlags(fsdp="full", offload="params"), C64)
    assert (fsdp.offload_optimizer, fsdp.offload_params) == ("none", "cpu")
    opt = derive_strategy(StrategyFlags(zero=1, offload="optimizer"), C64)
    assert (opt.offload_optimizer, opt.offload_params) == ("cpu", "none")
    assert derive_strategy(StrategyFlags(tp=2, sp=False), C64).sp is False


@pytest.mark.parametrize(("flags", "match"), [
    (StrategyFlags(tp=3), "not divisible by tp·pp·cp"),
    (StrategyFlags(dp=4, tp=4), "does not match --gpus 64"),
    (StrategyFlags(global_batch=100), "not divisible by mbs x dp"),
    (StrategyFlags(global_batch=128, gas=4), "contradicts --global-batch"),
    (StrategyFlags(tp=0), "--tp must be >= 1"),
    (StrategyFlags(mbs=0), "--mbs must be >= 1"),
    (StrategyFlags(zero=3, offload="params", offload_params="cpu"), "not both"),
    (StrategyFlags(zero=3, offload="params", offload_params="none"), "not both"),  # an explicit none too
])
def test_inconsistent_flags_are_one_line_errors(flags: StrategyFlags, match: str) -> None:
    with pytest.raises(OptplanError, match=match):
        derive_strategy(flags, C64)
