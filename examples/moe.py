"""A Mixture-of-Experts decoder (DeepSeekMoE / Mixtral style): an optplan model file.

Llama-3 blocks (examples/llama.py: RMSNorm, RoPE, grouped-query attention) whose MLP is, from layer
``first_dense`` on, an MoE layer: a router (``nn.Linear(dim, num_experts)``, softmax in fp32, top-k, weights
renormalised), ``num_experts`` SwiGLU experts of width ``moe_ffn_dim`` in an ``nn.ModuleList``, and
``n_shared_experts`` shared experts (one SwiGLU MLP of ``n_shared_experts`` · ``moe_ffn_dim``) every token passes
through (DeepSeekMoE, Dai et al. 2024, arXiv 2401.06066 §3). Tokens reach their experts by a data-dependent loop
(``torch.where`` over the router's choice), as in the Mixtral reference code: optplan profiles it with a balanced
dispatch instead (probes/moe_dispatch.py) and a real CPU run routes for real.

=========  =====  ======  =====  =======  ======  =====  ======  =======  ======  ======
size       dim    layers  heads  experts  top-k   width  shared  dense    ffn     vocab
=========  =====  ======  =====  =======  ======  =====  ======  =======  ======  ======
lite       2048   27      16     64       6       1408   2       1        10944   102400
mixtral    4096   32      32/8   8        2       14336  0       0        14336   32000
=========  =====  ======  =====  =======  ======  =====  ======  =======  ======  ======

``lite`` is DeepSeek-V2-Lite's expert layout with grouped-query attention in place of its latent attention;
``mixtral`` is Mixtral 8x7B's shape. Pick one with ``OPTPLAN_MOE_SIZE`` or ``OPTPLAN["size"]``; tests call
``build_model(dim=..., ...)`` with keyword overrides of ``MoeConfig``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZE_ENV = "OPTPLAN_MOE_SIZE"


def _llama():  # the sibling examples/llama.py, for its attention, norm and rotary embedding
    name = "optplan_example_llama_for_moe"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("llama.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


llama = _llama()


@dataclass(frozen=True)
class MoeConfig:
    dim: int = 2048
    n_layers: int = 27
    n_heads: int = 16
    n_kv_heads: int = 16
    ffn_dim: int = 10944  # the dense layers' MLP width
    vocab_size: int = 102400
    max_seq_len: int = 4096
    num_experts: int = 64
    num_experts_per_tok: int = 6
    moe_ffn_dim: int = 1408
    n_shared_experts: int = 2
    first_dense: int = 1
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = False


SIZES: dict[str, MoeConfig] = {
    "LITE": MoeConfig(),
    "MIXTRAL": MoeConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                         max_seq_len=32768, num_experts=8, num_experts_per_tok=2, moe_ffn_dim=14336,
                         n_shared_experts=0, first_dense=0, norm_eps=1e-5, rope_theta=1e6),
}


def selected_size(default: str = "lite") -> str:
    """The size named by ``$OPTPLAN_MOE_SIZE``, else ``default`` (case-insensitive)."""
    size = os.environ.get(SIZE_ENV, "").strip() or default
    if size.upper() not in SIZES:
        raise ValueError(f"unknown MoE size {size!r}: use one of {', '.join(s.lower() for s in SIZES)}")
    return size.upper()


OPTPLAN = {
    "size": selected_size("lite"),  # edit the default here, or set OPTPLAN_MOE_SIZE
    "seq_len": 4096,
    "global_batch": 1024,
    "tokens": 5.7e12,
    "optimizer": "adamw",
    "precision": "bf16",
}
OPTPLAN["name"] = f"moe-{OPTPLAN['size'].lower()}"


class Expert(nn.Module):
    """A SwiGLU MLP dim -> width -> dim."""

    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, width, bias=False)  # gate
        self.w3 = nn.Linear(dim, width, bias=False)  # up
        self.w2 = nn.Linear(width, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Router, routed experts, shared experts."""

    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList([Expert(cfg.dim, cfg.moe_ffn_dim) for _ in range(cfg.num_experts)])
        self.shared_experts = Expert(cfg.dim, cfg.moe_ffn_dim * cfg.n_shared_experts) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)  # the tokens routed to expert e: known only from the values
            if token.numel():
                y = expert(x[token]) * weights[token, slot, None]
                out = out.index_add(0, token, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, cfg: MoeConfig, index: int) -> None:
        super().__init__()
        self.attention_norm = llama.RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = llama.Attention(cfg)
        self.ffn_norm = llama.RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if index >= cfg.first_dense else llama.FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class MoeTransformer(nn.Module):
    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layers)])
        self.norm = llama.RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope = llama.RotaryEmbedding(cfg.dim // cfg.n_heads, cfg.rope_theta)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope(tokens.shape[1], h.device, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def make_config(size: str | None = None, **overrides: object) -> MoeConfig:
    """The config of ``size`` (default: ``$OPTPLAN_MOE_SIZE`` or ``OPTPLAN["size"]``) with overrides."""
    return replace(SIZES[selected_size(size or str(OPTPLAN["size"]))], **overrides)  # type: ignore[arg-type]


def build_model(size: str | None = None, **overrides: object) -> MoeTransformer:
    """The selected size (see the module docstring); keyword overrides change ``MoeConfig``."""
    return MoeTransformer(make_config(size, **overrides))


def example_batch(batch_size: int, seq_len: int) -> torch.Tensor:
    """Token ids [batch_size, seq_len]."""
    return torch.randint(0, make_config().vocab_size, (batch_size, seq_len), dtype=torch.long)


loss_fn = llama.loss_fn
