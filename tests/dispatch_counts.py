"""Counting the ops a piece of code dispatches (the recompute tests' matmul counts)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountMatmuls(TorchDispatchMode):
    """How many weight matmuls (``mm``, ``addmm``) ran while the mode was on."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))
