"""Ranks advancing in simulated time: the event loop the planners share.

``list_schedule``, ``fill.fill_weights`` and ``cooldown.critical_path_tail`` each
build rank orders by simulating: a rank that is free picks its next op from those whose input
has arrived, runs it, and wakes when it ends. They differ only in how a rank picks (their policy);
``Ranks`` holds the rest: when each rank is free, the order it has chosen, the queue of (time,
rank) wake-ups, and when each op's input is on its rank. What an op waits for and who reads a
value are ``schedule.dataflow``'s answers, so no planner states the dependency rule itself.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from cutpipe.schedule.codes import B_CODE, BW_CODE, F_CODE, KIND_BITS, W_CODE, Codec
from cutpipe.schedule.dataflow import Dataflow, awaited


class Ranks:
    """Every rank's clock and order, the wake-up queue, and when each op's input arrives.

    ``ready[code]`` is when what op ``code`` awaits is on the op's rank: set when the op that
    makes it is placed (plus ``latency`` if that ran on another rank), 0.0 for an op that awaits
    nothing, None until then. A wake-up is never earlier than the rank's clock, and ties pop in
    rank order, so a loop over ``wakeups`` is deterministic. A rank may *park*: on one op, to wake
    when that op's input is made, or on nothing in particular, to wake when any input of its
    arrives.
    """

    def __init__(self, flow: Dataflow, latency: float) -> None:
        R, S, m = flow.placement.num_ranks, flow.num_stages, flow.num_microbatches
        self.flow = flow
        self.codec = Codec(S, m)
        self.clock = [0.0] * R  # when each rank is free
        self.orders: list[list[int]] = [[] for _ in range(R)]
        self.ready: list[float | None] = [None] * self.codec.span
        for stage in range(S):
            for kind in (F_CODE, B_CODE, W_CODE, BW_CODE):
                if awaited(kind, stage, 0, S) is None:  # reads the batch: ready from the start
                    for microbatch in range(m):
                        self.ready[self.codec.action(kind, stage, microbatch)] = 0.0
        self._readers = flow.readers(latency)  # index by ``code % self._width``
        self._width = len(self._readers)
        self._owners = flow.owners
        self._queue = [(0.0, rank) for rank in range(R)]  # sorted, so already a heap
        self._parked: dict[int, list[int]] = {}  # op code -> ranks waiting for its input
        self._idle: set[int] = set()  # ranks waiting for any input to arrive

    def wakeups(self) -> Iterator[tuple[float, int]]:
        """(time, rank) in time order until no rank is due; the loop may ``wake`` more."""
        queue = self._queue
        while queue:
            yield heapq.heappop(queue)

    def wake(self, rank: int, at: float) -> None:
        """Let ``rank`` decide again at ``at`` (or when it is free, if later)."""
        heapq.heappush(self._queue, (max(at, self.clock[rank]), rank))

    def place(self, rank: int, code: int, end: float) -> None:
        """``rank`` runs ``code`` (a single op or a pair) until ``end``, when what it makes is
        made: the rank and those parked on a reader of it wake then, an idle reader's rank when
        the value reaches it."""
        self.orders[rank].append(code)
        self.clock[rank] = end
        heapq.heappush(self._queue, (end, rank))  # ``wake``, now that the clock is ``end``
        readers, width, ready = self._readers, self._width, self.ready
        halves = self.codec.split_pair(code) if code < 0 else (code,)
        if not (self._parked or self._idle):  # nobody to wake: just record the arrivals
            for half in halves:
                for step, delay in readers[half % width]:
                    ready[half + step] = end + delay
            return
        for half in halves:
            for step, delay in readers[half % width]:
                reader = half + step
                ready[reader] = at = end + delay
                for waiting in self._parked.pop(reader, ()):
                    self.wake(waiting, end)
                owner = self._owners[reader >> KIND_BITS]
                if owner in self._idle:
                    self._idle.discard(owner)
                    self.wake(owner, at)

    def park(self, rank: int, code: int | None = None) -> None:
        """Let ``rank`` sleep until the input of op ``code`` is made (None: until any input of
        one of its ops arrives)."""
        if code is None:
            self._idle.add(rank)
        else:
            self._parked.setdefault(code, []).append(rank)
