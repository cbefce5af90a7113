"""probes/traffic.py: the bytes eager memory-bound kernels move, counted on the operators a step dispatches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from optplan.probes.traffic import TrafficCounter, block_attribution, op_class

T, H = 64, 32


def test_elementwise_ops_count_inputs_and_outputs_once() -> None:
    with FakeTensorMode():
        x = torch.empty(T, H, dtype=torch.bfloat16)
        bias = torch.empty(H, dtype=torch.bfloat16)
        with TrafficCounter() as counter:
            y = x * 2  # reads T·H, writes T·H (2 bytes each); the scalar moves nothing
            z = y + bias.expand(T, H)  # the broadcast bias is read once: H elements
    assert z.shape == (T, H)
    tr = counter.traffic
    assert tr.by_op["mul"] == 2 * T * H * 2
    assert tr.by_op["add"] == (2 * T * H + H) * 2
    assert tr.forward_bytes == tr.by_op["mul"] + tr.by_op["add"]


def test_views_gemms_and_attention_move_nothing() -> None:
    with FakeTensorMode():
        x = torch.empty(2, 4, T, 8)
        w = torch.empty(H, H)
        with TrafficCounter() as counter:
            v = x.transpose(1, 2).reshape(2, T, 32)  # a copy only where a view cannot be taken
            m = torch.empty(T, H) @ w
            a = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
    assert m.shape == (T, H) and a.shape == x.shape and v.shape == (2, T, 32)
    assert "mm" not in counter.traffic.by_op
    assert not any("attention" in k for k in counter.traffic.by_op)
    assert op_class(torch.ops.aten.mm.default) == "gemm"
    assert op_class(torch.ops.aten.transpose.int) == "view"
    assert op_class(torch.ops.aten.gelu.default) == "memory"
    # the transpose's reshape is a real copy (clone of 2·T·32 floats: read + write)
    assert counter.traffic.forward_bytes == 2 * (2 * T * 32 * 4)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.fc(x))


def test_block_attribution_splits_forward_and_backward_per_block() -> None:
    with FakeTensorMode():
        blocks = [_Block(), _Block()]
        model = nn.Sequential(*blocks)
        x = torch.empty(T, H, requires_grad=True)
        counter = TrafficCounter()
        with block_attribution(blocks, counter), counter:
            loss = (model(x) * 3).sum()  # the head's mul and sum are outside the blocks
            counter.backward = True
            loss.backward()
    tr = counter.traffic
    e = T * H * 4
    fwd, bwd = tr.per_block()
    assert tr.blocks == 2
    assert fwd == 2 * e + 3 * e  # gelu (read, write) + residual add (read two, write one)
    assert tr.forward_bytes > tr.block_forward_bytes  # the head's ops are not a block's
    # backward of a block: gelu_backward (read grad and input, write grad) + the residual's gradient sum
    assert bwd >= 3 * e
    assert tr.backward_bytes > tr.block_backward_bytes
    # operators per block forward (the host cost of eager selective checkpointing is per operator): the linear's
    # transpose (a view) and matmul, gelu, the residual add; the head's mul and sum and backward are not counted
    assert tr.ops_per_block() == 4 and tr.block_forward_ops == 8
    # kernels (the host issues each: estimators/eager_host.py): the same less the view, plus the head's mul and sum
    assert tr.kernels_per_block() == 3 and tr.block_forward_kernels == 6 and tr.forward_kernels == 8
    assert tr.backward_kernels >= 2 * 3  # each block's gelu_backward, its matmuls' gradients...


def test_the_profile_counts_its_own_blocks_eager_bytes() -> None:
    """The static profile counts one block's memory-bound bytes per token on its own steps, per precision class;
    on examples/gpt2.py (the plain reference block) they are the packaged reference coefficients."""
    from optplan.estimators.eager_traffic import layer_bytes_per_token
    from optplan.probes.loader import profile_model_file

    prof = profile_model_file(Path(__file__).resolve().parents[2] / "examples" / "gpt2.py", seq_len=128)
    shape = prof.transformer
    assert shape is not None and prof.eager_layer_bytes_per_token is not None
    assert set(prof.eager_layer_bytes_per_token) == {"fp32", "amp", "bf16"}
    for klass, (fwd, bwd) in prof.eager_layer_bytes_per_token.items():
        ref = layer_bytes_per_token(kind="plain", precision=klass, hidden=shape.hidden, ffn=4 * shape.hidden,  # type: ignore[arg-type]
                                    kv=shape.hidden, head_dim=shape.hidden // shape.heads, grouped_query=False)
        assert fwd == pytest.approx(ref[0], rel=0.01) and bwd == pytest.approx(ref[1], rel=0.01)
    # and the operators one block's forward dispatches: autocast adds its casts to the fp32 count, bf16 weights do
    # not (a GPT-2 block: two layer norms, the fused qkv and output projections, attention, the MLP, two residuals)
    ops = prof.eager_layer_ops
    assert ops is not None and set(ops) == {"fp32", "amp", "bf16"}
    assert 20 <= ops["fp32"] == ops["bf16"] < ops["amp"] <= 100
    # and the kernels of the whole step (views excluded) at the full depth, 12 blocks: autocast's casts add to the
    # fp32 count, the backward launches more than the forward, the head's few kernels sit outside the blocks
    kernels = prof.eager_step
    assert kernels is not None and set(kernels) == {"fp32", "amp", "bf16"}
    counts = {k: (v.forward_kernels, v.backward_kernels, v.block_forward_kernels) for k, v in kernels.items()}
    assert counts["fp32"] == counts["bf16"] and kernels["amp"].forward_kernels > kernels["fp32"].forward_kernels
    # and what the step's memory-bound kernels move per sample: 16-bit weights and activations move about half of
    # fp32's, the forward less than the whole; no convolutions
    fp32, bf16 = kernels["fp32"], kernels["bf16"]
    assert fp32.memory_bytes_per_sample and bf16.memory_bytes_per_sample
    assert 0.4 < bf16.memory_bytes_per_sample / fp32.memory_bytes_per_sample < 0.6
    assert 0 < fp32.memory_forward_bytes_per_sample < fp32.memory_bytes_per_sample
    assert fp32.conv_flops_per_sample == 0 and fp32.nchw_conv_bytes_per_sample == 0
    for k in kernels.values():
        assert 0 < k.block_forward_kernels <= ops["amp"] and k.backward_kernels > k.forward_kernels
        assert 12 * k.block_forward_kernels < k.forward_kernels <= 12 * k.block_forward_kernels + 20


class _ConvNet(nn.Module):
    def __init__(self, groups: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, groups=groups, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.bn(self.conv1(x)))).mean()


@pytest.mark.parametrize("groups", [1, 16])
def test_convolutions_count_their_flops_and_channels_first_activation_bytes(groups: int) -> None:
    """Each convolution's FLOPs (forward, input and weight gradients; grouped ones as probes/flop_formulas.py counts
    them) and, laid out NCHW, its activation bytes; channels-last moves the same bytes elsewhere but no layout's."""
    b, side = 2, 8
    found = {}
    for layout in (torch.contiguous_format, torch.channels_last):
        net = _ConvNet(groups).to(memory_format=layout)  # small real tensors
        x = torch.randn(b, 3, side, side).contiguous(memory_format=layout)
        with TrafficCounter() as counter:
            loss = net(x)
            forward_only = counter.traffic.nchw_conv_bytes
            counter.backward = True
            loss.backward()
        found[layout] = (counter.traffic, forward_only)
    pixels = b * side * side
    conv1 = 2 * pixels * 16 * 3 * 9  # no input gradient for the first convolution: forward + weight gradient
    conv2 = 2 * pixels * 16 * (16 // groups) * 9  # forward + input + weight gradients
    (nchw, _), (nhwc, nhwc_forward) = found[torch.contiguous_format], found[torch.channels_last]
    assert nchw.conv_flops == nhwc.conv_flops == 2 * conv1 + 3 * conv2
    # channels-last convolutions need no transpose (the mean's gradient arrives contiguous, so conv2's backward
    # does on this CPU: counted, as on a GPU)
    assert nhwc_forward == 0 and nhwc.nchw_conv_bytes < nchw.nchw_conv_bytes
    act = 4 * pixels  # one fp32 channel of the batch, bytes
    # forward: conv1 reads 3 channels, writes 16; conv2 reads 16, writes 16; backward: conv2 reads its output's
    # gradient and input and writes the input's gradient (48), conv1 reads its output's gradient and input (19)
    assert nchw.nchw_conv_bytes == act * ((3 + 16) + (16 + 16) + 48 + 19)
    assert nchw.forward_bytes == nhwc.forward_bytes > 0


def test_the_profile_of_a_conv_net_counts_per_sample_slopes() -> None:
    """examples/resnet.py's profile: memory-bound bytes, convolution FLOPs and channels-first bytes per sample; the
    convolutions are nearly all of the step's FLOPs (the fc layer the rest)."""
    from optplan.probes.loader import profile_model_file

    prof = profile_model_file(Path(__file__).resolve().parents[2] / "examples" / "resnet.py")
    step = (prof.eager_step or {})["amp"]
    assert step.memory_bytes_per_sample and step.memory_bytes_per_sample > 100e6  # ResNet-50: ~285 MB in 16 bits
    assert 0.99 < step.conv_flops_per_sample / prof.train_flops_per_sample <= 1.0
    assert step.nchw_conv_bytes_per_sample > 0.2 * step.memory_bytes_per_sample
    fp32 = (prof.eager_step or {})["fp32"]
    assert fp32.memory_bytes_per_sample and fp32.memory_bytes_per_sample > 1.5 * step.memory_bytes_per_sample
