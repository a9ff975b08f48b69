"""The runner's own collectives over the pipeline group, in one small interface.

Besides the point-to-point traffic of the schedule (the transport's), a runner needs a few
collectives: the step's agreement (an all-gather started in the background), the step
boundary's gradient check (on a side channel of its own), the loss all-reduce,
DualPipe's mirror sums and the initial copy of its weights, a barrier before a recorded step, and
gathering measured timelines. Each one says what it waits for (for the watchdog) and turns a
connection broken by a failed peer into ``PeerLost``. A one-rank pipeline gets ``Alone``, which
does nothing, so the runner never asks whether it has peers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cutpipe.runtime.failure.heartbeat import Progress
from cutpipe.runtime.transport.flat import reduce_gradients, share_values
from cutpipe.runtime.transport.mailbox import PeerLost, wait


def collective(operation: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a collective; a connection broken by a failed peer becomes ``PeerLost``."""
    try:
        return operation(*args, **kwargs)
    except RuntimeError as error:
        raise PeerLost(None, str(error)) from error


def _start(
    operation: Callable[..., Any], tensor: torch.Tensor, peer: int, in_group: int, tag: int
) -> Any:
    """Post one point-to-point transfer with pipeline rank ``peer`` (``in_group`` in the
    operation's group); a broken connection becomes ``PeerLost``."""
    try:
        return operation([tensor], in_group, tag)
    except RuntimeError as error:
        raise PeerLost(peer, str(error)) from error


class Round:
    """A gather in flight: calling it waits for every rank's word and gives them stacked by rank
    (on the CPU); ``first()`` waits only for pipeline rank 0's."""

    def __init__(
        self, every: Callable[[], torch.Tensor], first: Callable[[], torch.Tensor] | None = None
    ) -> None:
        self._every = every
        self._first = first

    def __call__(self) -> torch.Tensor:
        return self._every()

    def first(self) -> torch.Tensor:
        return self._first() if self._first is not None else self._every()[0]


class Exchange:
    """An all-gather of one small CPU tensor per step, made of point-to-point messages on a
    process group of its own.

    On gloo an asynchronous all-gather runs on a worker thread and takes ``world - 1`` rounds of
    messages, and a message whose receive is not yet posted waits for the receiver's notice. Here
    each rank sends its word straight to every other rank: a round costs one message's latency,
    which every step pays before its first transfer (docs/runtime.md, "Overhead per op"). Every
    rank must start every round, with words of one shape; the runner's agreement does. No
    receive stays posted between rounds: gloo work still pending when torch.profiler stops
    crashes the process.
    """

    def __init__(self, global_ranks: Sequence[int], rank: int, progress: Progress) -> None:
        self._group = dist.new_group(list(global_ranks), use_local_synchronization=True)
        self._rank = rank
        self._peers = [peer for peer in range(len(global_ranks)) if peer != rank]
        self._in_group = [dist.get_group_rank(self._group, global_ranks[p]) for p in self._peers]
        self._progress = progress
        self._round = 0
        # the transfers of a round never finished (its step failed): a buffer must outlive its
        # transfer, so they are kept until they complete
        self._started: tuple[list[Any], list[torch.Tensor]] | None = None
        self._unfinished: list[tuple[list[Any], list[torch.Tensor]]] = []

    def start(self, word: torch.Tensor, what: str) -> Round:
        """Send ``word`` to every peer; the returned round waits for theirs (once) and gives the
        words stacked by rank."""
        word = word.cpu()
        tag, self._round = self._round, self._round + 1
        if self._started is not None:
            self._unfinished.append(self._started)
        self._unfinished = [
            (works, kept)
            for works, kept in self._unfinished
            if not all(w.is_completed() for w in works)
        ]
        buffers = [torch.empty_like(word) for _ in self._peers]
        peers = list(zip(self._peers, self._in_group, strict=True))
        receives = [
            _start(self._group.recv, buffer, peer, in_group, tag)
            for buffer, (peer, in_group) in zip(buffers, peers, strict=True)
        ]
        sends = [_start(self._group.send, word, peer, in_group, tag) for peer, in_group in peers]
        self._started = (receives + sends, [*buffers, word])
        progress = self._progress

        waited: set[int] = set()  # gloo's wait() on a finished receive never returns again

        def finish() -> torch.Tensor:
            progress.wait_for(None, what)  # a collective: the diagnosis follows who is not in it
            works = zip(receives + sends, self._peers + self._peers, strict=True)
            for index, (work, peer) in enumerate(works):
                if index not in waited:
                    wait(work, peer)
                    waited.add(index)
            progress.done_waiting()
            if self._round == tag + 1:
                self._started = None
            rows = list(buffers)
            rows.insert(self._rank, word)
            return torch.stack(rows)

        def first() -> torch.Tensor:
            if self._rank == 0:
                return word
            if 0 not in waited:  # peers are in rank order: rank 0 comes first
                progress.wait_for(0, what)
                wait(receives[0], 0)
                waited.add(0)
                progress.done_waiting()
            return buffers[0]

        return Round(finish, first)


class FromRankZero:
    """Rank 0's word of each round, sent point to point to every other rank on a group of its
    own: beside an all-gather, which completes only once every rank has joined it, this is how a
    rank learns rank 0's word without waiting for the others."""

    def __init__(self, global_ranks: Sequence[int], rank: int, progress: Progress) -> None:
        self._group = dist.new_group(list(global_ranks), use_local_synchronization=True)
        self._rank = rank
        self._in_group = [dist.get_group_rank(self._group, g) for g in global_ranks]
        self._progress = progress
        self._round = 0
        self._sends: list[tuple[Any, torch.Tensor]] = []  # rank 0's, kept alive until done

    def start(self, word: torch.Tensor, what: str) -> Callable[[], torch.Tensor]:
        """Rank 0 sends ``word`` to every rank; the returned call gives it (on rank 0 at once,
        elsewhere once it has come)."""
        tag, self._round = self._round, self._round + 1
        if self._rank == 0:
            self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
            for peer in range(1, len(self._in_group)):
                work = _start(self._group.send, word, peer, self._in_group[peer], tag)
                self._sends.append((work, word))
            return lambda: word
        buffer = torch.empty_like(word)
        receive = _start(self._group.recv, buffer, 0, self._in_group[0], tag)
        waited: list[bool] = []
        progress = self._progress

        def first() -> torch.Tensor:
            if not waited:  # gloo's wait() on a finished receive never returns again
                progress.wait_for(0, what)
                wait(receive, 0)
                progress.done_waiting()
                waited.append(True)
            return buffer

        return first

    def settle(self) -> None:
        """Rank 0: wait for the sends of rounds every rank has joined."""
        for work, _ in self._sends:
            wait(work, None)
        self._sends.clear()


class AllGather:
    """An asynchronous all-gather of one small tensor per round on ``group`` (NCCL's way; on gloo
    ``Exchange`` is cheaper), with rank 0's word also sent point to point when ``first`` is
    given, for a round's ``first()``."""

    def __init__(
        self, group: dist.ProcessGroup, size: int, progress: Progress,
        first: FromRankZero | None = None,
    ) -> None:  # fmt: skip
        self._group = group
        self._size = size
        self._progress = progress
        self._first = first

    def start(self, word: torch.Tensor, what: str) -> Round:
        words = [torch.empty_like(word) for _ in range(self._size)]
        work = collective(dist.all_gather, words, word, group=self._group, async_op=True)
        first = self._first.start(word, what) if self._first is not None else None
        progress = self._progress

        def finish() -> torch.Tensor:
            progress.wait_for(None, what)
            wait(work, None)
            if first is not None and self._first is not None:
                first()  # no receive outlives its round
                self._first.settle()  # every rank is in this round: rank 0's sends are done
            progress.done_waiting()
            return torch.stack(words).cpu()

        return Round(finish, first)  # without ``first``: rank 0's word comes with everyone's


class Collectives:
    """The collectives of one rank of a pipeline group of two or more ranks. On gloo the step's
    agreement is an ``Exchange`` (``exchange`` overrides the choice); elsewhere (NCCL) an
    all-gather, beside which rank 0's word also travels point to point when
    ``early_first_word`` (``step_boundary="overlap"``: a step's first transfer waits only for
    it)."""

    def __init__(
        self, group: dist.ProcessGroup, global_ranks: Sequence[int], rank: int, progress: Progress,
        *, early_first_word: bool = False, exchange: bool | None = None,
    ) -> None:  # fmt: skip
        self._group = group
        self._global = list(global_ranks)
        self._rank = rank
        self._progress = progress
        self._mirror: dist.ProcessGroup | None = None
        self._mirror_peer = -1
        if exchange is None:
            exchange = dist.get_backend(group) == "gloo"
        self._exchange = Exchange(global_ranks, rank, progress) if exchange else None
        self._agreement = self._exchange or AllGather(
            group, len(global_ranks), progress,
            FromRankZero(global_ranks, rank, progress) if early_first_word else None,
        )  # fmt: skip

    def _waiting(self, what: str, peer: int | None = None) -> None:
        self._progress.wait_for(peer, what)

    def _done(self) -> None:
        self._progress.done_waiting()

    def start_gather(self, word: torch.Tensor, what: str) -> Round:
        """Start gathering every rank's ``word`` in the background; the returned round waits and
        gives the words stacked by rank (on the CPU)."""
        return self._agreement.start(word, what)

    def side_channel(self) -> Exchange | AllGather:
        """A gather of its own, for words that stay in flight across a step boundary (the step's
        verdict under ``step_boundary="overlap"``): its own group, so that neither the agreement's
        rounds nor, on NCCL, the schedule's transfers queue behind it. Every rank makes its side
        channels in the same order."""
        if self._exchange is not None:
            return Exchange(self._global, self._rank, self._progress)
        group = dist.new_group(self._global, use_local_synchronization=True)
        return AllGather(group, len(self._global), self._progress)

    def sum(self, tensor: torch.Tensor, what: str) -> None:
        """All-reduce ``tensor`` in place over the pipeline."""
        self._waiting(what)
        collective(dist.all_reduce, tensor, group=self._group)
        self._done()

    def barrier(self, what: str) -> None:
        self._waiting(what)
        collective(dist.barrier, group=self._group)
        self._done()

    def start_gather_to_first(
        self, tensor: torch.Tensor, what: str
    ) -> Callable[[], list[torch.Tensor] | None]:
        """Start gathering every rank's ``tensor`` on rank 0; the returned call waits (once) and
        gives them there (None elsewhere). What a rank does before calling it hides the wait."""
        gathered = [torch.empty_like(tensor) for _ in self._global] if self._rank == 0 else None
        work = collective(
            dist.gather, tensor, gathered, dst=self._global[0], group=self._group, async_op=True
        )
        waited: list[bool] = []

        def finish() -> list[torch.Tensor] | None:
            if not waited:
                self._waiting(what)
                wait(work, None)
                self._done()
                waited.append(True)
            return gathered

        return finish

    # -- DualPipe's mirrored copies --------------------------------------------------------------

    def pair_with(self, peer: int) -> None:
        """Make the group of this rank and ``peer``, which hold copies of the same stages."""
        members = sorted({self._global[self._rank], self._global[peer]})
        self._mirror = dist.new_group(members, use_local_synchronization=True)
        self._mirror_peer = peer

    def copy_from_lower(self, parameters: Sequence[nn.Parameter]) -> None:
        """Start the two copies equal: the lower rank's values win."""
        source = self._global[min(self._rank, self._mirror_peer)]
        share_values(parameters, lambda flat: dist.broadcast(flat, src=source, group=self._mirror))

    def sum_copies(self, parameters: Sequence[nn.Parameter]) -> None:
        """Add up the gradients of the two copies of each stage."""
        peer = self._mirror_peer
        self._waiting(f"the sum of DualPipe's two copies with rank {peer}", peer)
        reduce_gradients(
            parameters, lambda flat: collective(dist.all_reduce, flat, group=self._mirror)
        )
        self._done()


class Alone:
    """The collectives of a one-rank pipeline: there is nobody to talk to."""

    def start_gather(self, word: torch.Tensor, what: str) -> Round:
        return Round(lambda: word.unsqueeze(0).cpu())

    def side_channel(self) -> Alone:
        return self

    def start(self, word: torch.Tensor, what: str) -> Round:
        return self.start_gather(word, what)

    def sum(self, tensor: torch.Tensor, what: str) -> None:
        pass

    def barrier(self, what: str) -> None:
        pass

    def start_gather_to_first(
        self, tensor: torch.Tensor, what: str
    ) -> Callable[[], list[torch.Tensor]]:
        return lambda: [tensor]

    def pair_with(self, peer: int) -> None:
        pass

    def copy_from_lower(self, parameters: Sequence[nn.Parameter]) -> None:
        pass

    def sum_copies(self, parameters: Sequence[nn.Parameter]) -> None:
        pass
