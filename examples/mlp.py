"""A tiny MLP for tests and quick demos: an optplan model file.

``Linear(in, hidden)`` then ``depth`` residual blocks ``x + Linear(GELU(Linear(LayerNorm(x))))`` held
in an ``nn.ModuleList`` (so the profile finds a repeated block), then ``Linear(hidden, classes)``.
Defaults: in 64, hidden 256, depth 4, classes 10. ``build_model(depth=..., ...)`` takes overrides.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

IN_FEATURES = 64
HIDDEN = 256
DEPTH = 4
CLASSES = 10

OPTPLAN = {
    "global_batch": 256,
    "optimizer": "adamw",
    "precision": "fp32",
}


class MLPBlock(nn.Module):
    def __init__(self, hidden: int, expansion: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, expansion * hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(expansion * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, in_features: int = IN_FEATURES, hidden: int = HIDDEN, depth: int = DEPTH,
                 classes: int = CLASSES) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, hidden)
        self.blocks = nn.ModuleList([MLPBlock(hidden) for _ in range(depth)])
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, classes]; ``labels`` is accepted and ignored (the loss is ``loss_fn``)."""
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model(**overrides: int) -> MLP:
    """The MLP (keyword overrides: in_features, hidden, depth, classes)."""
    return MLP(**overrides)


def example_batch(batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [B, 64], labels [B]); ``seq_len`` is ignored."""
    return torch.randn(batch_size, IN_FEATURES), torch.randint(0, CLASSES, (batch_size,))


def loss_fn(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross entropy against the labels."""
    return F.cross_entropy(logits, batch[1])
