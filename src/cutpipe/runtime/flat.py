"""One collective for many tensors: flatten them, run it once, write the result back.

A collective per parameter costs a round trip each; gradients and weights of a stage are many
small tensors, so the runner (DualPipe's mirror copies) and the mesh (data and expert parallel
averaging) move them as one flat buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


@torch.no_grad()
def reduce_gradients(
    parameters: Sequence[nn.Parameter], reduce: Callable[[torch.Tensor], None], scale: float = 1.0
) -> None:
    """``reduce`` the parameters' gradients in place (a missing gradient counts as zeros, since
    the other ranks still send theirs), times ``scale``, into ``.grad``."""
    if not parameters:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = torch.cat([g.reshape(-1) for g in grads])
    reduce(flat)
    if scale != 1.0:
        flat *= scale
    for parameter, value in zip(parameters, unflatten(flat, grads), strict=True):
        if parameter.grad is None:
            parameter.grad = value.clone()
        else:
            parameter.grad.copy_(value)


@torch.no_grad()
def share_values(parameters: Sequence[nn.Parameter], move: Callable[[torch.Tensor], None]) -> None:
    """``move`` the parameters' values as one buffer (e.g. a broadcast) and copy them back."""
    if not parameters:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in parameters])
    move(flat)
    for parameter, value in zip(parameters, unflatten(flat, parameters), strict=True):
        parameter.copy_(value)


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as each of ``like``, in order (the inverse of concatenating
    their flattened values)."""
    pieces = flat.split([t.numel() for t in like])
    return [piece.view_as(t) for piece, t in zip(pieces, like, strict=True)]
