"""A small transformer-like model for ``python -m zero_dtensor.bench`` (no attention kernels: cheap on CPU).

Per block: LayerNorm, fused ``qkv`` projection, output projection, LayerNorm, MLP ``h -> 4h -> h`` (12 tensors,
``12·h² + 13·h`` parameters); plus an input projection, a final LayerNorm and a head (6 tensors).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Block", "TransformerLike", "count"]


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        x = x + self.proj(attn)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class TransformerLike(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def count(hidden: int, layers: int) -> tuple[int, int]:
    """``(parameters, tensors)`` of ``TransformerLike(hidden, layers)`` without building it."""
    per_block = 12 * hidden * hidden + 13 * hidden
    return layers * per_block + 2 * (hidden * hidden + hidden) + 2 * hidden, 12 * layers + 6
