"""All-to-all exchanges of rows between the ranks of a group, started now and waited for later.

Expert parallelism moves tokens to the ranks that own their experts (dispatch) and back (combine),
each an ``all_to_all_single`` with uneven splits. An ``AllToAll`` is one such exchange with its
splits fixed: ``start`` sends rows and returns at once, ``Pending.wait`` hands over what arrived.
Its gradient travels the same way in reverse (``start_backward``), so a stage that runs phase by
phase can put another microbatch's compute between the start and the wait of either direction.

``all_to_all`` is the same exchange as a differentiable, blocking function for code that runs
the MoE as one ordinary autograd graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class Pending:
    """An exchange in flight: ``wait`` returns the received rows once they are all here."""

    __slots__ = ("_received", "_work")

    def __init__(self, work: Any, received: torch.Tensor) -> None:
        self._work = work
        self._received = received

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._received


class AllToAll:
    """Rows ``send_splits[r]`` go to rank r; ``recv_splits[r]`` rows come from rank r."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
    ) -> None:
        self.group = group
        self.send_splits = list(send_splits)
        self.recv_splits = list(recv_splits)

    def _launch(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> Pending:
        if sum(send) != rows.shape[0]:
            raise ValueError(f"{rows.shape[0]} rows to send, but the splits add up to {sum(send)}")
        received = rows.new_empty((sum(recv), *rows.shape[1:]))
        if self.group is None:  # a group of one: the rows stay here
            received.copy_(rows)
            return Pending(None, received)
        work = dist.all_to_all_single(
            received, rows.contiguous(), recv, send, group=self.group, async_op=True
        )
        return Pending(work, received)

    def start(self, rows: torch.Tensor) -> Pending:
        """Send ``rows`` (already ordered by destination rank)."""
        return self._launch(rows, self.send_splits, self.recv_splits)

    def start_backward(self, grad: torch.Tensor) -> Pending:
        """Send the gradient of the received rows back where the rows came from."""
        return self._launch(grad, self.recv_splits, self.send_splits)


class _AllToAllFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, exchange: AllToAll) -> torch.Tensor:  # type: ignore[override]
        ctx.exchange = exchange
        return exchange.start(rows).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.exchange.start_backward(grad).wait(), None


def all_to_all(rows: torch.Tensor, exchange: AllToAll) -> torch.Tensor:
    """``exchange`` as one blocking, differentiable step (its backward is the reverse exchange)."""
    return _AllToAllFunction.apply(rows, exchange)
