"""Grouped convolutions' backward FLOPs: each gradient costs what the forward does (probes/flop_formulas.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from optplan.probes.flop_formulas import FLOP_FIXES


def _counts(conv: nn.Module, x: torch.Tensor, *, fixed: bool) -> tuple[int, int]:
    mapping = FLOP_FIXES if fixed else None
    with FlopCounterMode(display=False, custom_mapping=mapping) as fwd:
        y = conv(x)
    with FlopCounterMode(display=False, custom_mapping=mapping) as bwd:
        y.sum().backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.mark.parametrize("groups", [1, 4, 32, 64])
def test_a_grouped_convolution_backward_is_twice_its_forward(groups: int) -> None:
    conv = nn.Conv2d(64, 128, 3, padding=1, groups=groups, bias=False)
    x = torch.randn(2, 64, 10, 10, requires_grad=True)
    fwd, bwd = _counts(conv, x, fixed=True)
    assert fwd == 2 * 2 * 10 * 10 * 128 * (64 // groups) * 9  # 2 x N x H x W x C_out x C_in/groups x k²
    assert bwd == 2 * fwd


def test_torch_counts_the_weight_gradient_groups_times_and_the_fix_only_changes_grouped_ones() -> None:
    x = torch.randn(2, 64, 10, 10, requires_grad=True)
    plain = nn.Conv2d(64, 64, 3, padding=1, bias=False)
    depthwise = nn.Conv2d(64, 64, 3, padding=1, groups=64, bias=False)
    assert _counts(plain, x, fixed=False) == _counts(plain, x, fixed=True)
    fwd, torch_bwd = _counts(depthwise, x, fixed=False)
    # torch: input gradient right (= fwd), weight gradient 64x (the bug the fix exists for)
    assert torch_bwd == fwd + 64 * fwd
    assert _counts(depthwise, x, fixed=True)[1] == 2 * fwd


def test_only_the_gradients_asked_for_are_counted() -> None:
    conv = nn.Conv2d(8, 16, 3, groups=4, bias=False)
    x = torch.randn(1, 8, 6, 6)  # no input gradient: the first layer of a network
    fwd, bwd = _counts(conv, x, fixed=True)
    assert bwd == fwd


def test_a_transposed_grouped_convolution() -> None:
    conv = nn.ConvTranspose2d(32, 16, 4, stride=2, groups=8, bias=False)
    x = torch.randn(2, 32, 5, 5, requires_grad=True)
    fwd, bwd = _counts(conv, x, fixed=True)
    assert fwd == 2 * 2 * 5 * 5 * 32 * (16 // 8) * 16  # per input point: C_in x C_out/groups x k²
    assert bwd == 2 * fwd
