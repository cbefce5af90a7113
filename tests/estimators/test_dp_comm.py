"""Data-parallel collectives' overlap interference (estimators/dp_comm.py): an overlapped collective slows the compute
it hides behind by the engine's ``overlap_interference`` times the GPU-side share of its time (``gpu_side_share``),
all of it inside a node, the link's bandwidth over NVLink's across nodes."""

from __future__ import annotations

import pytest

from optplan.estimators.comm import Link
from optplan.estimators.dp_comm import data_parallel_comm, gpu_side_share
from optplan.estimators.efficiency import engine_efficiency
from optplan.estimators.parallel import placement
from optplan.estimators.strategy import Strategy

NVLINK = Link(bandwidth_bytes_per_s=200e9, alpha_s=0.0, inter_node=False)
NIC = Link(bandwidth_bytes_per_s=50e9, alpha_s=0.0, inter_node=True)


def test_gpu_side_share() -> None:
    assert gpu_side_share(NVLINK, 200e9) == 1.0  # inside a node: the kernels move data all along
    assert gpu_side_share(NIC, 200e9) == pytest.approx(0.25)  # waits on the NICs three quarters of the time
    assert gpu_side_share(NIC, 20e9) == 1.0  # never above one
    assert gpu_side_share(NIC, None) == 1.0  # without the intra-node bandwidth: the whole time (the old rule)


def test_fsdp_interference_scales_with_the_collectives_gpu_side_work() -> None:
    """The same FSDP gathers and reduce-scatters, hidden behind a long compute window: over NVLink the engine's whole
    interference lands on the step; over NICs a quarter of NVLink's speed a quarter of it does."""
    strategy = Strategy(engine="torch", fsdp="full", precision="bf16", dp=16, mbs=2)
    pl = placement(strategy, 8)
    kappa = engine_efficiency("torch").overlap_interference
    assert kappa > 0
    units = 40

    def comm(link: Link) -> tuple[float, float]:
        c = data_parallel_comm(strategy, 7e9, 1.0, link, link, pl, step_compute_s=100.0, mb_compute_s=100.0,
                               last_bwd_s=66.0, units=units, intra_bytes_per_s=NVLINK.bandwidth_bytes_per_s)
        return c.total_s, c.exposed_s

    total_in, exposed_in = comm(NVLINK)
    total_out, exposed_out = comm(NIC)
    assert total_out == pytest.approx(4 * total_in)  # a quarter of the bandwidth: four times as long
    # exposed = the first unit's gather (total / units) + kappa x share x the hidden rest
    floor_in, floor_out = total_in / units, total_out / units
    assert exposed_in - floor_in == pytest.approx(kappa * (total_in - floor_in))
    assert exposed_out - floor_out == pytest.approx(kappa * 0.25 * (total_out - floor_out))
    # the same bytes cost the compute the same, however long the network takes to carry them
    assert exposed_out - floor_out == pytest.approx(exposed_in - floor_in)


def test_exposed_collectives_are_not_discounted() -> None:
    """Megatron without overlap exposes its whole all-reduce, over any link: the share scales overlapped time only."""
    strategy = Strategy(engine="megatron", precision="bf16", dp=16, mbs=2)
    pl = placement(strategy, 8)
    c = data_parallel_comm(strategy, 7e9, 1.0, NIC, NIC, pl, step_compute_s=100.0, mb_compute_s=100.0,
                           last_bwd_s=66.0, units=40, intra_bytes_per_s=200e9)
    assert c.exposed_s == pytest.approx(c.total_s)
