"""GPT-2 small (124M), nanoGPT style: an optplan model file.

Everything is defined here; nothing is downloaded. ``build_model()`` returns GPT-2 small
(12 layers, 12 heads, 768 wide, vocabulary 50257, context 1024, biases, lm_head tied to the token
embedding): 124,439,808 unique parameters.

Smaller configurations, for tests and quick demos:

* in Python: ``build_model(n_layer=4, n_embd=128, n_head=4)`` (keyword overrides of ``GPTConfig``);
* from the command line: ``OPTPLAN_GPT2_CONFIG='{"n_layer": 4, "n_embd": 128, "n_head": 4}'``
  (a JSON object of ``GPTConfig`` fields; keyword overrides win over it).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG_ENV = "OPTPLAN_GPT2_CONFIG"

OPTPLAN = {
    "seq_len": 1024,
    "global_batch": 512,  # sequences per optimizer step (~0.5M tokens)
    "tokens": 10e9,  # token budget of a GPT-2 small reproduction
    "optimizer": "adamw",
    "precision": "amp-bf16",
}


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits [B, T, vocab]; with ``targets`` (nanoGPT style) returns ``(logits, loss)``."""
        b, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"sequence of length {t} is longer than block_size {self.config.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def make_config(**overrides: object) -> GPTConfig:
    """GPT-2 small, updated by ``$OPTPLAN_GPT2_CONFIG`` (JSON object) and then by ``overrides``."""
    values: dict[str, object] = {}
    raw = os.environ.get(CONFIG_ENV, "").strip()
    if raw:
        values.update(json.loads(raw))
    values.update(overrides)
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"unknown GPTConfig field(s) {unknown}; known: {sorted(known)}")
    return GPTConfig(**values)  # type: ignore[arg-type]


def build_model(**overrides: object) -> GPT:
    """GPT-2 small (or the configuration given by ``$OPTPLAN_GPT2_CONFIG`` / keyword overrides)."""
    return GPT(make_config(**overrides))


def example_batch(batch_size: int, seq_len: int) -> torch.Tensor:
    """Token ids [batch_size, seq_len]; next-token targets are derived from them in ``loss_fn``."""
    vocab = make_config().vocab_size
    return torch.randint(0, vocab, (batch_size, seq_len), dtype=torch.long)


def loss_fn(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (the targets are the inputs shifted left by one; the last wraps)."""
    targets = torch.roll(batch, shifts=-1, dims=1)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
