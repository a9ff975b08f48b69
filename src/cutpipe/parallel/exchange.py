"""All-to-all exchanges of rows between the ranks of a group, started now and waited for later.

Expert parallelism moves tokens to the ranks that own their experts (dispatch) and back (combine),
each an ``all_to_all_single`` with uneven splits. An ``AllToAll`` is one such exchange with its
splits fixed: ``start`` sends rows and returns at once, ``Pending.wait`` hands over what arrived.
Its gradient travels the same way in reverse (``start_backward``), so a stage that runs phase by
phase can put another microbatch's compute between the start and the wait of either direction.

A ``CountedAllToAll`` needs no count exchange before it: when every part (an expert) takes at
most ``capacity`` rows, each rank sends each peer a block of one size, a header with its row
count for each of the peer's parts and then ``capacity`` rows per part, the unused ones zero.
The receiver reads the counts with the rows and keeps only the rows that were sent.

``all_to_all`` is either exchange as a differentiable, blocking function for code that runs
the MoE as one ordinary autograd graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from cutpipe.runtime.compute.phased import Exchange

#: A count travels in the rows' own dtype as base-256 digits: each is exact in every float format
#: rows travel in (bf16 holds the integers up to 256), and three of them count up to 256**3 - 1.
DIGIT_BASE = 256
DIGITS = 3


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


class CountedAllToAll:
    """Rows for ``parts`` parts (experts) of each peer, at most ``capacity`` per part, that
    carry their counts (see the module): no count exchange first.

    ``send_counts[r, j]``: the rows for part j of rank r, the rows to send ordered by (r, j).
    After ``start(rows).wait()``, ``received_counts[r, j]`` says how many rows rank r sent for
    this rank's part j, and the received rows come in (r, j) order, as an uneven ``AllToAll``
    would deliver them. The backward knows both sides' counts by then: it sends the gradient
    unpadded, as an uneven ``AllToAll``.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, send_counts: torch.Tensor, capacity: int
    ) -> None:
        if capacity >= DIGIT_BASE**DIGITS:
            raise ValueError(
                f"a capacity of {capacity} rows per expert is more than a counted dispatch "
                f"carries ({DIGIT_BASE**DIGITS - 1}): use a smaller capacity factor or microbatch"
            )
        self.group = group
        self.peers, self.parts = send_counts.shape
        self.capacity = capacity
        self.send_counts = send_counts
        self.received_counts: torch.Tensor | None = None

    def _header_rows(self, width: int) -> int:
        return -(-self.parts * DIGITS // width)

    def start(self, rows: torch.Tensor) -> CountedPending:
        """Send ``rows`` (ordered by destination rank, then part), padded into equal blocks."""
        sent, width = rows.shape[0], rows.shape[1]
        header = self._header_rows(width)
        block = header + self.parts * self.capacity
        buffer = rows.new_zeros(self.peers, block, width)
        digits = torch.stack(
            [self.send_counts // DIGIT_BASE**d % DIGIT_BASE for d in range(DIGITS)], -1
        ).reshape(self.peers, -1)
        buffer.view(self.peers, -1)[:, : digits.shape[1]] = digits.to(rows.dtype)
        # each row's place: its part's slots in its peer's block, in the order they were given
        part = torch.repeat_interleave(
            torch.arange(self.peers * self.parts, device=rows.device),
            self.send_counts.reshape(-1),
            output_size=sent,
        )
        first = torch.cumsum(self.send_counts.reshape(-1), 0) - self.send_counts.reshape(-1)
        within = torch.arange(sent, device=rows.device) - first[part]
        place = (part // self.parts) * block + header + (part % self.parts) * self.capacity
        buffer.view(-1, width).index_copy_(0, place + within, rows)
        even = [block] * self.peers
        pending = AllToAll(self.group, even, even).start(buffer.view(-1, width))
        return CountedPending(self, pending, header)

    def start_backward(self, grad: torch.Tensor) -> Pending:
        """Send the gradient of the received rows back (uneven: both sides' counts are known)."""
        assert self.received_counts is not None, "start(...).wait() first"
        uneven = AllToAll(
            self.group, self.send_counts.sum(1).tolist(), self.received_counts.sum(1).tolist()
        )
        return uneven.start_backward(grad)


class CountedPending:
    """A ``CountedAllToAll`` in flight: ``wait`` reads the counts and keeps the sent rows."""

    def __init__(self, exchange: CountedAllToAll, pending: Pending, header: int) -> None:
        self._exchange, self._pending, self._header = exchange, pending, header

    def wait(self) -> torch.Tensor:
        exchange = self._exchange
        received = self._pending.wait()
        width = received.shape[1]
        blocks = received.view(exchange.peers, -1, width)
        digits = blocks[:, : self._header].reshape(exchange.peers, -1)
        digits = digits[:, : exchange.parts * DIGITS].reshape(exchange.peers, exchange.parts, -1)
        scale = DIGIT_BASE ** torch.arange(DIGITS, device=received.device)
        counts = (digits.round().long() * scale).sum(-1)
        exchange.received_counts = counts
        slots = blocks[:, self._header :].reshape(
            exchange.peers, exchange.parts, exchange.capacity, width
        )
        used = torch.arange(exchange.capacity, device=received.device) < counts.unsqueeze(-1)
        return slots[used]


class _AllToAllFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, exchange: Exchange) -> torch.Tensor:  # type: ignore[override]
        ctx.exchange = exchange
        return exchange.start(rows).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.exchange.start_backward(grad).wait(), None


def all_to_all(rows: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """``exchange`` as one blocking, differentiable step (its backward is the reverse exchange)."""
    return _AllToAllFunction.apply(rows, exchange)
