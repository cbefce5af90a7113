"""estimators/cast_traffic.py: autocast's weight casts per micro-batch, and where the step time takes them."""

from __future__ import annotations

import pytest

from optplan.estimators.cast_traffic import CAST_BYTES, autocast_cast_bytes_per_microbatch
from optplan.estimators.efficiency import efficiency_for, engine_efficiency
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.precision import get_recipe
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.timing import step_time


def test_casts_by_recipe() -> None:
    amp = get_recipe("amp-bf16")
    assert autocast_cast_bytes_per_microbatch(amp, params=10, trainable=10, recompute=False) == 2 * CAST_BYTES * 10
    assert autocast_cast_bytes_per_microbatch(amp, params=10, trainable=10, recompute=True) == 3 * CAST_BYTES * 10
    assert autocast_cast_bytes_per_microbatch(amp, params=10, trainable=0, recompute=False) == CAST_BYTES * 10
    for name in ("bf16", "bf16-pure", "fp32"):  # 16-bit weights cast nothing per micro-batch; fp32 has no autocast
        assert autocast_cast_bytes_per_microbatch(get_recipe(name), params=10, trainable=10, recompute=True) == 0
    with pytest.raises(ValueError, match="params"):
        autocast_cast_bytes_per_microbatch(amp, params=-1, trainable=0, recompute=False)


def test_amp_steps_pay_their_casts_once_per_microbatch(profile: ModelProfile) -> None:
    """bf16 moves 12 bytes per parameter more in its step (master copies), amp-bf16 12 per micro-batch: one
    micro-batch per step leaves amp no faster, accumulation makes it slower (the H200 grid measured bf16 ahead)."""
    cluster = Cluster(gpu=find_gpu("H200"), gpus=1, gpus_per_node=1)

    # the fused elementwise count, which both recipes share, so the difference is the casts and the accumulation
    # (eager, amp-bf16 also casts activations: estimators/eager_traffic.py's amp class, tested there)
    fused = engine_efficiency("deepspeed").model_copy(update={"eager": False})

    def mem(precision: str, accum: int) -> float:
        return step_time(profile, Strategy(precision=precision, mbs=1, grad_accum=accum), cluster,
                         engine=fused).memory_bound_s

    one, four = mem("amp-bf16", 1), mem("amp-bf16", 4)
    hbm = cluster.gpu.memory_bandwidth_bytes_per_s * efficiency_for(cluster.gpu).hbm_fraction
    casts = 2 * CAST_BYTES * profile.params / hbm
    accumulate = 3 * (4 - 2) * profile.params / hbm  # fp32 against bf16 gradients, read-add-written per micro-batch
    assert one - mem("bf16", 1) == pytest.approx(casts + accumulate, rel=0.02)
    assert four - mem("bf16", 4) == pytest.approx(4 * (casts + accumulate), rel=0.02)
