"""Measured memory of a training step on any device, from the tensors really held.

A CPU has no allocator statistics to ask, so ``ActivationMeter`` watches what autograd saves for
the backward (``torch.autograd.graph.saved_tensors_hooks``): it counts each saved storage once,
from the moment it is first saved until the storage itself is freed, whoever keeps it alive (the
graph, or a deferred weight gradient waiting for its W). Parameters are not activations and are
left out. ``state_bytes`` adds up what lives across steps: parameters, gradients and the
optimizer's state. Together they give a rank's peak: state plus the activation peak.

Tensors no backward needs are not seen (a buffer held only for an exchange, a temporary freed
inside one op), so the activation figure is a lower bound, close to the graph's real footprint.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch


class ActivationMeter:
    """Bytes of saved-for-backward storages alive now, and the most alive at once."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._also_excluded: set[int] = set()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self._hooks: Any = None

    def reset(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak = self.current

    def also_exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Leave the storages of ``tensors`` out too, in place of the last call's: parameters
        that live in new storage every step, such as FSDP's all-gathered (unsharded) ones."""
        self._also_excluded = {t.untyped_storage().data_ptr() for t in tensors}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, meta, ...: nothing to count
            return tensor
        key, size = storage.data_ptr(), storage.nbytes()
        if (
            key and size and key not in self._live
            and key not in self._excluded and key not in self._also_excluded
        ):  # fmt: skip
            self._live[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return tensor

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of distinct storages among ``tensors`` (None skipped, shared storage counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_bytes(
    parameters: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held between steps."""
    parameters = list(parameters)
    optimizer_tensors: list[torch.Tensor] = []
    if optimizer is not None:
        for state in optimizer.state.values():
            optimizer_tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": tensor_bytes(parameters),
        "gradients": tensor_bytes(p.grad for p in parameters),
        "optimizer": tensor_bytes(optimizer_tensors),
    }
