"""Channels-first convolution nets on Hopper (estimators/conv_layout.py, data/conv_layout.yaml): the H200 measured
timm's ResNet-50 in bf16 autocast busy 55.0 ms channels-first against 28.8 channels-last at micro-batch 128, where the
RTX 3090's fitted 0.5 passes priced 2.4 ms of difference. The H200 and H100s take the measured passes by convolution
math; other GPUs keep counted_traffic.py's fit; channels-last steps pay none."""

from __future__ import annotations

import pytest

from optplan.estimators.conv_layout import measured_layout, nchw_passes
from optplan.estimators.counted_traffic import NCHW_TRANSPOSE_PASSES, memory_s
from optplan.estimators.hardware import find_gpu
from optplan.estimators.profile import EagerStep
from optplan.estimators.strategy import Strategy

STEP = EagerStep(forward_kernels=300.0, backward_kernels=400.0, block_forward_kernels=20.0,
                 memory_bytes_per_sample=400e6, memory_bytes_fixed=0.0, memory_forward_bytes_per_sample=150e6,
                 conv_flops_per_sample=12e9, nchw_conv_bytes_per_sample=100e6)


def test_hopper_takes_the_measured_passes_and_other_gpus_the_3090_fit() -> None:
    h200 = measured_layout()["H200"]
    assert h200.passes_16bit > 5 * NCHW_TRANSPOSE_PASSES and h200.passes_tf32 > 3 * NCHW_TRANSPOSE_PASSES
    for name in ("H200", "H100-SXM", "H100-PCIe"):
        assert nchw_passes(name, tf32=False, default=0.5) == h200.passes_16bit
        assert nchw_passes(name, tf32=True, default=0.5) == h200.passes_tf32
    for name in ("A100-80GB", "RTX-3090", "B200"):
        assert nchw_passes(name, tf32=False, default=0.5) == 0.5


@pytest.mark.parametrize("precision", ["amp-bf16", "fp32"])
def test_a_channels_first_step_pays_hoppers_passes_and_a_channels_last_one_none(precision: str) -> None:
    s = Strategy(precision=precision, engine="torch", mbs=128)  # type: ignore[arg-type]
    h200, a100 = find_gpu("H200"), find_gpu("A100-80GB")
    last = STEP.model_copy(update={"nchw_conv_bytes_per_sample": 0.0})
    extra_h200 = memory_s(STEP, s, h200, 0.8) - memory_s(last, s, h200, 0.8)
    extra_a100 = memory_s(STEP, s, a100, 0.8) - memory_s(last, s, a100, 0.8)
    passes = nchw_passes("H200", tf32=precision == "fp32", default=NCHW_TRANSPOSE_PASSES)
    # the same bytes, each GPU's passes at its own bandwidth
    ratio = (passes / NCHW_TRANSPOSE_PASSES) * (a100.memory_bandwidth_bytes_per_s / h200.memory_bandwidth_bytes_per_s)
    assert extra_h200 / extra_a100 == pytest.approx(ratio, rel=1e-9)
    assert extra_h200 > 0
