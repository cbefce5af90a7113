"""The example model files: exact parameter counts (from the architecture formulas) and the contract."""

from __future__ import annotations

import pytest
import torch

from optplan.probes.model_census import count_params


def meta_params(build) -> int:
    with torch.device("meta"):
        model = build()
    return count_params(model)[0]


def gpt2_params(n_layer: int, n_embd: int, vocab: int, block: int) -> int:
    d = n_embd
    per_block = (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (2 * d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return vocab * d + block * d + n_layer * per_block + 2 * d  # lm_head tied to wte: counted once


def llama_params(dim: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, tied: bool) -> int:
    hd = dim // heads
    attn = dim * heads * hd + 2 * dim * kv * hd + heads * hd * dim
    per_layer = attn + 3 * dim * ffn + 2 * dim
    return vocab * dim + layers * per_layer + dim + (0 if tied else vocab * dim)


def resnet50_params(classes: int = 1000) -> int:
    def bn(c: int) -> int:
        return 2 * c

    total = 7 * 7 * 3 * 64 + bn(64)
    inplanes = 64
    for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            out = 4 * planes
            total += inplanes * planes + bn(planes) + 9 * planes * planes + bn(planes) + planes * out + bn(out)
            if i == 0 and (stride != 1 or inplanes != out):
                total += inplanes * out + bn(out)
            inplanes = out
    return total + 2048 * classes + classes


def test_gpt2_small_is_exactly_124_439_808(example):
    gpt2 = example("gpt2")
    assert meta_params(gpt2.build_model) == 124_439_808
    assert gpt2_params(12, 768, 50257, 1024) == 124_439_808
    with torch.device("meta"):
        model = gpt2.build_model()
    assert model.lm_head.weight is model.transformer.wte.weight


def test_gpt2_small_configs_and_env(example, monkeypatch):
    gpt2 = example("gpt2")
    assert meta_params(lambda: gpt2.build_model(n_layer=4, n_embd=128, n_head=4, vocab_size=512, block_size=64)) \
        == gpt2_params(4, 128, 512, 64)
    monkeypatch.setenv(gpt2.CONFIG_ENV, '{"n_layer": 2, "n_embd": 64, "n_head": 2}')
    assert meta_params(gpt2.build_model) == gpt2_params(2, 64, 50257, 1024)
    with pytest.raises(TypeError, match="unknown GPTConfig"):
        gpt2.build_model(n_layers=3)


@pytest.mark.parametrize("size, dims", [
    ("1B", (2048, 16, 32, 8, 8192, 128256, True)),
    ("8B", (4096, 32, 32, 8, 14336, 128256, False)),
    ("70B", (8192, 80, 64, 8, 28672, 128256, False)),
])
def test_llama_sizes_exact(example, size, dims):
    llama = example("llama")
    assert meta_params(lambda: llama.build_model(size)) == llama_params(*dims)


def test_llama_published_sizes(example):
    llama = example("llama")
    assert llama_params(2048, 16, 32, 8, 8192, 128256, True) == 1_235_814_400  # Llama-3.2-1B
    assert llama_params(4096, 32, 32, 8, 14336, 128256, False) == 8_030_261_248  # Llama-3-8B
    assert llama_params(8192, 80, 64, 8, 28672, 128256, False) == 70_553_706_496  # Llama-3-70B
    assert llama.SIZES["1B"].tie_embeddings and not llama.SIZES["70B"].tie_embeddings


def test_llama_size_from_env(example, monkeypatch):
    llama = example("llama")
    monkeypatch.setenv(llama.SIZE_ENV, "8b")
    assert llama.make_config().dim == 4096
    monkeypatch.setenv(llama.SIZE_ENV, "13B")
    with pytest.raises(ValueError, match="unknown Llama size"):
        llama.make_config()


def test_resnet50_params(example):
    resnet = example("resnet")
    assert meta_params(resnet.build_model) == resnet50_params() == 25_557_032


def test_mlp_params(example):
    mlp = example("mlp")
    h, i, c, depth = mlp.HIDDEN, mlp.IN_FEATURES, mlp.CLASSES, mlp.DEPTH
    block = 2 * h + (h * 4 * h + 4 * h) + (4 * h * h + h)
    assert meta_params(mlp.build_model) == (i * h + h) + depth * block + (h * c + c)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mlp", "resnet"])
def test_examples_run_a_real_step_at_small_size(example, name):
    """Each example's example_batch / forward / loss_fn work together on real tensors."""
    mod = example(name)
    small = {"gpt2": dict(n_layer=1, n_embd=32, n_head=2, block_size=16),
             "llama": dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128),
             "mlp": dict(depth=2), "resnet": {}}[name]
    if name == "resnet":
        model = mod.ResNet((1, 1, 1, 1), num_classes=1000)
    else:
        model = mod.build_model(**small)
    batch = mod.example_batch(2, 16)
    out = model(*batch) if isinstance(batch, tuple) else model(batch)
    loss = mod.loss_fn(out, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
