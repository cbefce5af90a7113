"""Which module is the repeated block (probes/blocks.py): the layer, not the parts of it that outnumber it, and the
blocks inside a hierarchy's stages, not the stages."""

from __future__ import annotations

import torch
import torch.nn as nn
import torchvision

from optplan.probes.blocks import find_repeated_block


class SeqMlpBlock(nn.Module):
    """A transformer layer whose MLP is an ``nn.Sequential`` (two Linears a layer: 12 Linears against 6 layers)."""

    def __init__(self, h: int = 32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.attn = nn.MultiheadAttention(h, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(x)


class Stage(nn.Module):
    """A hierarchy's stage: a down-projection and its own stack of blocks, wider than the stage before."""

    def __init__(self, c_in: int, c: int, depth: int) -> None:
        super().__init__()
        self.down = nn.Linear(c_in, c)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(c), nn.Linear(c, c)) for _ in range(depth)])


def test_a_layer_with_a_sequential_mlp_is_the_block_not_its_linears() -> None:
    model = nn.Sequential(nn.Embedding(100, 32), *[SeqMlpBlock() for _ in range(6)], nn.Linear(32, 100))
    block = find_repeated_block(model)
    assert block is not None and block.cls is SeqMlpBlock and len(block.blocks) == 6


def test_blocks_in_stages_stay_the_blocks() -> None:
    model = nn.ModuleList([Stage(8, 16, 2), Stage(16, 32, 3), Stage(32, 64, 2)])
    block = find_repeated_block(model)
    assert block is not None and block.cls is nn.Sequential and len(block.blocks) == 7  # the stages' blocks


def test_a_plain_stack_of_linears_keeps_the_linears() -> None:
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.ReLU())])
    block = find_repeated_block(model)
    assert block is not None and block.cls is nn.Linear and len(block.blocks) == 4


def test_torchvision_models_get_their_residual_units() -> None:
    """torchvision's layers hold Sequentials of parts (MLPBlock, Conv2dNormActivation) that outnumber the blocks;
    DenseNet's layers sit in a ModuleDict."""
    want = {"vit_b_16": ("EncoderBlock", 12), "swin_t": ("SwinTransformerBlock", 12), "convnext_tiny": ("CNBlock", 18),
            "efficientnet_b0": ("MBConv", 16), "mobilenet_v2": ("InvertedResidual", 17),
            "densenet121": ("_DenseLayer", 58), "resnet50": ("Bottleneck", 16)}
    for name, (cls, count) in want.items():
        with torch.device("meta"):
            model = getattr(torchvision.models, name)()
        block = find_repeated_block(model)
        assert block is not None and (block.cls.__name__, len(block.blocks)) == (cls, count), name


def test_a_dict_of_named_parts_is_no_container_of_blocks() -> None:
    """nanoGPT's ``transformer = nn.ModuleDict(wte=Embedding, wpe=Embedding, h=ModuleList(blocks), ...)``: two
    Embeddings tie two blocks in count and outweigh them; the dict is a bag of parts, not a stack."""
    model = nn.ModuleDict({"wte": nn.Embedding(1000, 32), "wpe": nn.Embedding(1000, 32),
                           "h": nn.ModuleList([SeqMlpBlock(), SeqMlpBlock()]), "ln_f": nn.LayerNorm(32)})
    block = find_repeated_block(model)
    assert block is not None and block.cls is SeqMlpBlock and block.path == "h"


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.cross = nn.Linear(32, 32), nn.Linear(32, 32)


class EncoderDecoder(nn.Module):
    """Two stacks of different block classes (BART's encoder and decoder layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList([EncoderLayer() for _ in range(3)])
        self.decoder = nn.ModuleList([DecoderLayer() for _ in range(4)])


def test_a_second_stack_and_several_containers_are_named() -> None:
    """The blocks are one class: another repeated class beside them (an encoder-decoder's other stack) is named, as
    it is neither checkpointed nor wrapped; blocks of one class in several containers (a ResNet's stages, T5's
    encoder and decoder) are listed, since they are profiled at full depth."""
    from optplan.probes.blocks import stack_notes

    block = find_repeated_block(EncoderDecoder())
    assert block is not None and block.cls is DecoderLayer and len(block.blocks) == 4
    assert block.other_stacks == (("EncoderLayer", 3, 3 * (32 * 32 + 32)),)
    (note,) = stack_notes(block)
    assert note.startswith("a second stack of 3 x EncoderLayer") and "cover DecoderLayer only" in note, note
    resnet = find_repeated_block(torchvision.models.resnet50())
    assert resnet is not None and resnet.other_stacks == ()
    assert resnet.containers == (("layer1", 3), ("layer2", 4), ("layer3", 6), ("layer4", 3))
    assert stack_notes(resnet) == ["the 16 Bottleneck blocks sit in 4 containers (layer1 3, layer2 4, layer3 6, "
                                   "layer4 3); depth reduction cuts a single container, so they were profiled at full "
                                   "depth"]
    one = find_repeated_block(nn.Sequential(*[SeqMlpBlock() for _ in range(4)]))
    assert one is not None and stack_notes(one) == []


def test_a_unets_double_convolutions_are_the_block_not_their_convolutions() -> None:
    """A UNet's ``nn.Conv2d`` outnumber everything in containers (two per double convolution, in its
    ``nn.Sequential``), but one convolution is nothing a checkpoint can spare: the unit that holds them is the block,
    every instance of it (in the encoder's ``Sequential`` or an attribute of the decoder's up-steps), as train.py
    checkpoints every outermost instance of the class."""
    from optplan.probes.static import blocks_of

    class DoubleConv(nn.Module):
        def __init__(self, cin: int, cout: int) -> None:
            super().__init__()
            self.double_conv = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                             nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

    class Up(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
            self.conv = DoubleConv(2 * c, c)

    class UNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inc = DoubleConv(3, 8)
            self.down = nn.ModuleList([nn.Sequential(nn.MaxPool2d(2), DoubleConv(8 * 2 ** i, 16 * 2 ** i))
                                       for i in range(3)])
            self.ups = [Up(8 * 2 ** i) for i in range(3)]
            for i, u in enumerate(self.ups):
                self.add_module(f"up{i}", u)
            self.outc = nn.Conv2d(8, 2, 1)

    model = UNet()
    block = find_repeated_block(model)
    assert block is not None and block.cls is DoubleConv and len(block.blocks) == 7 and not block.reducible
    assert {id(b) for b in blocks_of(model, DoubleConv)} == {id(b) for b in block.blocks}
    # a plain stack of layers has no unit around them: the layers stay the block (test above)
    flat = nn.Sequential(*[m for _ in range(4) for m in (nn.Conv2d(4, 4, 3), nn.ReLU())])
    found = find_repeated_block(flat)
    assert found is not None and found.cls is nn.Conv2d
