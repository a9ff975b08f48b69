"""``Chain``: ``nn.Sequential`` for layers that pass several tensors along.

A layer that returns a tuple gets its successor called with the tuple's items as arguments, so
layers like ``forward(hidden, aux) -> (hidden, aux)`` stack; single tensors pass as usual.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class Chain(nn.Sequential):
    def forward(self, *inputs: Any) -> Any:
        value: Any = inputs if len(inputs) != 1 else inputs[0]
        for module in self:
            value = module(*value) if isinstance(value, tuple) else module(value)
        return value
