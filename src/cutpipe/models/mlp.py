"""The built-in example model: a stack of Linear + tanh blocks, cut by layer into stages."""

from __future__ import annotations

import torch
from torch import nn


def mlp(blocks: int = 16, width: int = 128, seed: int = 0) -> nn.Sequential:
    """``blocks`` of ``Linear(width, width)`` then tanh, initialised from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(blocks):
        linear = nn.Linear(width, width)
        with torch.no_grad():
            bound = 1 / width**0.5
            linear.weight.uniform_(-bound, bound, generator=generator)
            linear.bias.uniform_(-bound, bound, generator=generator)
        layers.append(nn.Sequential(linear, nn.Tanh()))
    return nn.Sequential(*layers)
