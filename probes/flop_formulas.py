"""FLOP formulas the profile counts with in place of torch's own where those are wrong (FLOPs; multiply-adds x 2).

torch's ``FlopCounterMode`` (torch.utils.flop_counter) prices ``aten.convolution_backward``'s weight gradient as a
convolution of the input, batch and channels swapped, with the output gradient as its filter: C_in x C_out x the
rest, whatever the groups. A grouped convolution's weight gradient only pairs each output channel with the C_in /
groups inputs of its group, so torch counts it ``groups`` times too many: a depthwise 3x3 convolution over 256
channels (groups 256) is counted 256x (torch 2.4-2.13, checked on 2.13: for a 256-channel 3x3 convolution over a
2x256x14x14 input, 464 MFLOP of backward at groups 256, 477 at 32, 925 at 1, where the forward counts 1.8, 14 and
462). MobileNet, EfficientNet, ResNeXt, RegNet and ConvNeXt profiles read 1.5-13x their training FLOPs through it
(benchmarks/fidelity_convnets.py).

:func:`convolution_backward_flop`: the input gradient is a transposed convolution of the output gradient with the
same filter, and the weight gradient pairs the same input and output elements the forward does, so each is exactly
the forward's multiply-adds (Goodfellow, Bengio & Courville 2016, *Deep Learning* §9.5, eq. 9.11-9.13): backward =
(number of gradients asked, ``output_mask[:2]``) x forward. For an ungrouped convolution this is what torch counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.flop_counter import conv_flop_count


def convolution_backward_flop(grad_out_shape: Sequence[int], x_shape: Sequence[int], w_shape: Sequence[int],
                              _bias: Any, _stride: Any, _padding: Any, _dilation: Any, transposed: bool,
                              _output_padding: Any, _groups: Any, output_mask: Sequence[bool],
                              out_shape: Any = None, **_: Any) -> int:
    """FLOPs of ``aten.convolution_backward`` (module docstring): the forward's count once per gradient computed
    (input, weight; the bias gradient is a reduction, not counted, as torch does not count it)."""
    forward = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed=bool(transposed))
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


FLOP_FIXES: dict[Any, Any] = {torch.ops.aten.convolution_backward: convolution_backward_flop}
"""``FlopCounterMode(custom_mapping=FLOP_FIXES)``: the formulas above in place of torch's."""


__all__ = ["FLOP_FIXES", "convolution_backward_flop"]
