"""A step's batch: checked, and cut along dim 0 into the schedule's microbatches.

(In cutpipe "split" names the backward's B/W split only, hence ``to_microbatches``.)
"""

from __future__ import annotations

from typing import Any

import torch


def as_tensors(value: Any, name: str) -> tuple[torch.Tensor, ...]:
    """A tensor or a tuple/list of tensors, as a tuple, or a TypeError naming ``name``."""
    tensors = (value,) if isinstance(value, torch.Tensor) else value
    if not isinstance(tensors, (tuple, list)) or not tensors:
        raise TypeError(
            f"{name} must be a tensor or a tuple of tensors, got {type(value).__name__}"
        )
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"{name} must be a tensor or a tuple of tensors, got a {type(tensor).__name__} in it"
            )
    return tuple(tensors)


def batch_size(value: Any) -> int:
    """The batch (dim 0) size of a tensor or of a tuple's first tensor; -1 if there is none.
    Never raises: it describes whatever a rank was given, for the step's agreement."""
    first = value[0] if isinstance(value, (tuple, list)) and value else value
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return int(first.shape[0])
    return -1


def to_microbatches(
    value: Any, name: str, microbatches: int, device: torch.device
) -> list[tuple[torch.Tensor, ...]]:
    """``value`` (a tensor or tuple of tensors) as ``microbatches`` equal pieces along dim 0, each
    a tuple of tensors on ``device``; a ValueError says what to pass instead."""
    m = microbatches
    tensors = as_tensors(value, name)
    for tensor in tensors:
        if tensor.dim() == 0 or tensor.shape[0] == 0:
            raise ValueError(
                f"{name} has {'no batch dimension' if tensor.dim() == 0 else 'an empty batch'}"
                f": pass a batch of {m} or more samples (a multiple of {m}) along dim 0"
            )
        if tensor.shape[0] % m:
            raise ValueError(
                f"{name} has batch size {tensor.shape[0]}, which does not split into {m} equal "
                f"microbatches: use a batch size divisible by {m}"
            )
    chunks = [t.to(device, non_blocking=True).chunk(m) for t in tensors]
    return [tuple(chunk[i] for chunk in chunks) for i in range(m)]
