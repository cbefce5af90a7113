"""A Llama-3-style decoder (RMSNorm, SwiGLU, RoPE, grouped-query attention): an optplan model file.

Everything is defined here; nothing is downloaded. Sizes (Llama 3 shapes):

=====  ======  ======  =====  ========  ======  =======  =====================
size   dim     layers  heads  kv heads  ffn     vocab    head
=====  ======  ======  =====  ========  ======  =======  =====================
1B     2048    16      32     8         8192    128256   tied to the embedding
8B     4096    32      32     8         14336   128256   untied
70B    8192    80      64     8         28672   128256   untied
=====  ======  ======  =====  ========  ======  =======  =====================

Pick one with the environment variable ``OPTPLAN_LLAMA_SIZE`` (``1B``, ``8B``, ``70B``) or by editing
``OPTPLAN["size"]`` below; the environment variable wins. Tests can also call
``build_model(dim=256, n_layers=2, ...)`` with keyword overrides of ``LlamaConfig``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZE_ENV = "OPTPLAN_LLAMA_SIZE"


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 8192
    vocab_size: int = 128256
    max_seq_len: int = 131072
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_embeddings: bool = True


SIZES: dict[str, LlamaConfig] = {
    "1B": LlamaConfig(),
    "8B": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, tie_embeddings=False),
    "70B": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, tie_embeddings=False),
}


def selected_size(default: str = "1B") -> str:
    """The size named by ``$OPTPLAN_LLAMA_SIZE``, else ``default`` (case-insensitive)."""
    size = os.environ.get(SIZE_ENV, "").strip() or default
    key = size.upper()
    if key not in SIZES:
        raise ValueError(f"unknown Llama size {size!r}: use one of {', '.join(SIZES)}")
    return key


OPTPLAN = {
    "size": selected_size("1B"),  # edit the default here, or set OPTPLAN_LLAMA_SIZE
    "seq_len": 4096,
    "global_batch": 512,  # sequences per optimizer step (2M tokens)
    "tokens": 2e12,
    "optimizer": "adamw",
    "precision": "bf16",
}
OPTPLAN["name"] = f"llama-{OPTPLAN['size']}"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * out.type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions 0..T-1, computed per forward from the ``inv_freq`` buffer."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, device: torch.device, dtype: torch.dtype):
        t = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:  # grouped-query attention: share each k/v head among `rep` query heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.dim // cfg.n_heads, cfg.rope_theta)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, T = tokens.shape
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope(T, h.device, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def make_config(size: str | None = None, **overrides: object) -> LlamaConfig:
    """The config of ``size`` (default: ``$OPTPLAN_LLAMA_SIZE`` or ``OPTPLAN["size"]``) with overrides."""
    key = selected_size(size or str(OPTPLAN["size"]))
    return replace(SIZES[key], **overrides)  # type: ignore[arg-type]


def build_model(size: str | None = None, **overrides: object) -> Llama:
    """The selected Llama size (see the module docstring); keyword overrides change ``LlamaConfig``."""
    return Llama(make_config(size, **overrides))


def example_batch(batch_size: int, seq_len: int) -> torch.Tensor:
    """Token ids [batch_size, seq_len]."""
    return torch.randint(0, make_config().vocab_size, (batch_size, seq_len), dtype=torch.long)


def loss_fn(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (targets are the inputs shifted left by one; the last wraps)."""
    targets = torch.roll(batch, shifts=-1, dims=1)
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
