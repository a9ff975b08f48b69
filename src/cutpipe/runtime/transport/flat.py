"""One collective for many tensors: flatten them, run it once, write the result back.

A collective per parameter costs a round trip each; gradients and weights of a stage are many
small tensors, so the runner (DualPipe's mirror copies) and the mesh (data and expert parallel
averaging) move them as one flat buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard (tensor parallelism, FSDP), else
    the tensor itself. Writing into it writes into the DTensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def reduce_gradients(
    parameters: Sequence[nn.Parameter], reduce: Callable[[torch.Tensor], None], scale: float = 1.0
) -> None:
    """``reduce`` the parameters' gradients in place (a missing gradient counts as zeros, since
    the other ranks still send theirs), times ``scale``, into ``.grad``. A DTensor parameter
    moves its local shard (its copies elsewhere hold the same layout)."""
    if not parameters:
        return
    flat = flatten_gradients(parameters)
    reduce(flat)
    if scale != 1.0:
        flat *= scale
    write_gradients(parameters, flat)


def flatten_gradients(parameters: Sequence[nn.Parameter]) -> torch.Tensor:
    """The local parts of the parameters' gradients as one new flat tensor (zeros for none)."""
    return torch.cat(
        [
            local_shard(p.grad).reshape(-1)
            if p.grad is not None
            else local_shard(p).new_zeros(local_shard(p).numel())
            for p in parameters
        ]
    )


def write_gradients(parameters: Sequence[nn.Parameter], flat: torch.Tensor) -> None:
    """Copy ``flat`` (from ``flatten_gradients``) back into the parameters' gradients."""
    for parameter, value in zip(
        parameters, unflatten(flat, [local_shard(p) for p in parameters]), strict=True
    ):
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        local_shard(parameter.grad).copy_(value)


@torch.no_grad()
def share_values(parameters: Sequence[nn.Parameter], move: Callable[[torch.Tensor], None]) -> None:
    """``move`` the parameters' values as one buffer (e.g. a broadcast) and copy them back."""
    if not parameters:
        return
    shards = [local_shard(p.detach()) for p in parameters]
    flat = torch.cat([shard.reshape(-1) for shard in shards])
    move(flat)
    for shard, value in zip(shards, unflatten(flat, shards), strict=True):
        shard.copy_(value)


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as each of ``like``, in order (the inverse of concatenating
    their flattened values)."""
    pieces = flat.split([t.numel() for t in like])
    return [piece.view_as(t) for piece, t in zip(pieces, like, strict=True)]
