"""bitsandbytes' paged optimizers: state sizes, the state off the GPU at the forward/backward peak when it does not fit
beside it (and back for the step), the page traffic's time, and the strategy rules."""

from __future__ import annotations

import pytest

from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster
from optplan.estimators.memory import memory_breakdown
from optplan.estimators.optimizer_time import PCIE_BYTES_PER_S
from optplan.estimators.strategy import Strategy
from optplan.estimators.timing import PAGING_ROUND_TRIPS, with_paging
from tests.factories import make_gpu, make_profile

PROFILE = make_profile(params=1_000_000_000, layers=24, hidden=2048, seq=2048)
BIG = 2**50


def _strategy(optimizer: str) -> Strategy:
    return Strategy(engine="torch", precision="bf16-pure", optimizer=optimizer, mbs=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("paged,plain", [("paged_adamw8bit", "adamw8bit"), ("paged_adamw", "adamw")])
def test_resident_when_it_fits(paged: str, plain: str) -> None:
    m = memory_breakdown(PROFILE, _strategy(paged), BIG)
    assert "paged_optimizer_state_off_gpu" not in m.detail_bytes and m.host_bytes == 0
    if paged == "paged_adamw8bit":  # the same state as AdamW8bit
        assert m.total_bytes == memory_breakdown(PROFILE, _strategy(plain), BIG).total_bytes
    else:  # fp32 moments whatever the weights (bitsandbytes' 32-bit paged state): 8 bytes per parameter
        assert m.optimizer_bytes == 8 * 1_000_000_000


def test_paged_out_at_the_peak_when_it_does_not_fit() -> None:
    resident = memory_breakdown(PROFILE, _strategy("paged_adamw"), BIG)
    state = resident.optimizer_bytes
    # just too small to hold the state beside the forward/backward peak
    tight = resident.total_bytes - state // 2
    m = memory_breakdown(PROFILE, _strategy("paged_adamw"), tight)
    assert m.detail_bytes["paged_optimizer_state_off_gpu"] == state and m.host_bytes == state
    # the device holds the larger of the forward/backward peak without the state and the step with it
    run_peak = resident.total_bytes - state
    assert m.total_bytes < resident.total_bytes
    assert m.total_bytes >= run_peak * 0.98  # the fragmentation margin follows the smaller allocation
    if m.moment == "optimizer_step":
        assert m.optimizer_bytes == state
    else:
        assert m.optimizer_bytes == 0


def test_page_traffic_is_priced_and_noted() -> None:
    cluster = Cluster(gpu=make_gpu(14), gpus=1, gpus_per_node=1)  # 15.2 GiB with the state resident
    est = estimate(PROFILE, cluster, _strategy("paged_adamw"))
    out = est.memory.detail_bytes["paged_optimizer_state_off_gpu"]
    plain = estimate(PROFILE, Cluster(gpu=make_gpu(400), gpus=1, gpus_per_node=1), _strategy("paged_adamw"))
    assert "paged_optimizer_state_off_gpu" not in plain.memory.detail_bytes
    extra = PAGING_ROUND_TRIPS * out / PCIE_BYTES_PER_S
    assert est.time.optimizer_s == pytest.approx(plain.time.optimizer_s + extra)
    assert est.fits and any("pages out to host memory" in n for n in est.notes)
    assert any("stays on the GPU" in n for n in plain.notes)
    faster = with_paging(plain.time, 0)
    assert faster == plain.time
    slower = with_paging(plain.time, 10**9)
    assert slower.step_s == pytest.approx(plain.time.step_s + PAGING_ROUND_TRIPS * 1e9 / PCIE_BYTES_PER_S)
    assert slower.samples_per_s * slower.step_s == pytest.approx(plain.time.samples_per_s * plain.time.step_s)


def test_strategy_rules_and_aliases() -> None:
    assert Strategy(optimizer="paged_adamw_8bit", engine="torch").optimizer == "paged_adamw8bit"  # type: ignore[arg-type]
    assert Strategy(optimizer="paged_adamw_32bit", engine="torch").optimizer == "paged_adamw"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="runs in a torch training loop"):
        Strategy(optimizer="paged_adamw", engine="deepspeed", zero=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pages its state itself"):
        Strategy(optimizer="paged_adamw", engine="torch", fsdp="full", offload_params="cpu")  # type: ignore[arg-type]
