"""The first pass of the cost-aware search: list scheduling, one order per rank by simulated time.

Ranks advance in simulated time; a free rank runs a B whose gradient has arrived (B is on the
critical path), else an F whose input has arrived if its activation fits under the memory cap,
else a deferred W (which fills what would be a bubble), else it waits for the next arrival. How
ties are broken is a ``Policy``; ``tune.cost_aware`` tries every one of ``policies`` and lets
the simulator pick.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from cutpipe.plan.search.caps import within
from cutpipe.plan.search.events import Ranks
from cutpipe.plan.search.round_trips import round_trips
from cutpipe.schedule.codes import B_CODE, F_CODE, W_CODE
from cutpipe.schedule.dataflow import Dataflow, Key, produced
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs


@dataclass(frozen=True)
class Policy:
    """How the list scheduler breaks ties."""

    later_chunk_first: bool  # on a V: prefer the chunk nearer the loss (stage 2R-1-r)
    lookahead: bool  # do not start work if more urgent work arrives before it would end
    w_before_f: bool  # run pending W before a ready F (keeps memory low, as ZB-V's steady state)
    warmup: bool = False  # before its first B a rank runs an F only if it ends before that B
    # can arrive (``round_trips``): a warm-up F that ends later only delays the first gradient
    patient_tail: bool = False  # after its last F a rank waits for an arriving B rather than
    # start a W that would delay it, while its idle time stays within the most any rank has
    # idled (a span is work plus idle: only the longest counts)


def policies(placement: str) -> tuple[Policy, ...]:
    """The list-scheduling policies tried on ``placement``: on a V the chunk nearer the loss
    first (the other order starves it: 0.36 to 0.56 span bubble where this one gives 0.03 to
    0.15, and ``rounds_schedule`` now leads the V anyway); patience only without lookahead
    (which waits anyway); the warm-up rule only on a linear placement (on a V it left ranks
    waiting forever in every case tried)."""
    return tuple(
        Policy(chunk, lookahead, w_first, warmup, patient)
        for chunk in (True,)
        for warmup in ((False, True) if placement == "linear" else (False,))
        for lookahead in (True, False)
        for w_first in (False, True)
        for patient in ((False,) if lookahead else (False, True))
    )


class _ListScheduler:
    """Build one order per rank greedily under a ``Policy``, timing every op as it is placed.

    The state is per stage (the next microbatch to forward and its op, forwards whose backward
    has not run, which forwards ran) and per rank (backwards whose gradient has arrived, in a
    heap by arrival; W passes not yet run; live activation memory; when its first forward
    started, whether it has run a backward, how long it has idled, when its last op ends, how
    many ops it has left). ``Ranks`` keeps the clocks, the orders and when each op's input is
    on its rank.
    """

    def __init__(
        self, placement: Placement, m: int, costs: Costs, cap: float, policy: Policy
    ) -> None:
        R, S = placement.num_ranks, placement.num_stages
        self.placement, self.m, self.cap, self.policy = placement, m, cap, policy
        self.ranks = Ranks(Dataflow(placement, m), costs.comm)
        self.flow, self.codec = self.ranks.flow, self.ranks.codec
        self.f, self.b, self.w = (costs.per_stage(n, S) for n in ("f", "b", "w"))
        self.ep_f, self.ep_b = costs.per_stage("ep_f", S), costs.per_stage("ep_b", S)
        self.activation = costs.per_stage("activation", S)
        self.kept = costs.w_memory
        self.chunks = [
            sorted(placement.stages_of(r), reverse=policy.later_chunk_first) for r in range(R)
        ]
        self.next_f = [0] * S  # per stage: next microbatch to forward
        self.next_code = [self.codec.action(F_CODE, stage, 0) for stage in range(S)]  # its op
        self.in_flight = [0] * S  # per stage: forwards whose backward has not run yet
        self.f_done = [[False] * m for _ in range(S)]
        # per rank: (arrival, stage, mb) of backwards whose gradient is there or on its way
        self.ready_b: list[list[tuple[float, int, int]]] = [[] for _ in range(R)]
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(R)]
        self.memory = [0.0] * R
        self.trips = round_trips(placement, costs)
        self.first_forward: list[float | None] = [None] * R  # when each rank started its first F
        self.warm = [True] * R  # no B run yet
        self.idle = [0.0] * R  # per rank: time spent waiting since its first op
        self.free_at: list[float | None] = [None] * R  # when the rank's last op ends
        self.remaining = [3 * m * len(self.chunks[r]) for r in range(R)]
        self.ready = self.ranks.ready  # when each op's input is on its rank

    def fits(self, rank: int, stage: int) -> bool:
        """An F fits if, after it, a later chunk with nothing in flight can still start: a V
        rank whose memory is all first-chunk activations could never reach the loss. (A later
        chunk with something in flight will free memory when its backward arrives.)"""
        activation, next_f, m = self.activation, self.next_f, self.m
        reserve = sum(
            activation[s]
            for s in self.chunks[rank]
            if s > stage and next_f[s] < m and not self.in_flight[s]
        )
        return within(self.memory[rank] + activation[stage] + reserve, self.cap)

    def arrivals(self, rank: int, now: float, below: int | None = None) -> list[float]:
        """Known future times at which work becomes ready on ``rank``: a B (priority 0) or the
        F of a chunk (priority 1, 2, ... in preference order); only priorities below ``below``."""
        ready_b = self.ready_b[rank]
        times = [ready_b[0][0]] if ready_b else []
        for priority, stage in enumerate(self.chunks[rank], start=1):
            if below is not None and priority >= below:
                break
            at = self.ready[self.next_code[stage]] if self.next_f[stage] < self.m else None
            if at is not None and self.fits(rank, stage):
                times.append(at)
        return [t for t in times if t > now]

    def due(self, rank: int, now: float, below: int | None = None) -> float | None:
        """With lookahead, when the next more urgent work arrives (None: nothing known)."""
        return min(self.arrivals(rank, now, below), default=None) if self.policy.lookahead else None

    def warming_too_long(self, rank: int, now: float, stage: int) -> bool:
        """With the warm-up rule: an F that would end after ``rank``'s first B can arrive."""
        started = self.first_forward[rank]
        if not self.policy.warmup or not self.warm[rank] or started is None:
            return False
        return now + self.f[stage] + self.ep_f[stage] > started + self.trips[rank]

    def patient(self, rank: int, now: float, weight: float) -> bool:
        """Whether ``rank`` should leave a W of ``weight`` for a B that arrives during it."""
        ready_b = self.ready_b[rank]
        if not self.policy.patient_tail or not ready_b:
            return False
        if any(self.next_f[s] < self.m for s in self.chunks[rank]):  # not in the tail yet
            return False
        wait = ready_b[0][0] - now
        return 0 < wait < weight and self.idle[rank] + wait <= max(self.idle)

    def decide(self, rank: int, now: float) -> tuple[int, int, int] | None:
        """The op ``rank`` starts at ``now``, or None to wait."""
        ready_b, pending_w = self.ready_b[rank], self.pending_w[rank]
        if ready_b and ready_b[0][0] <= now:
            _, stage, mb = heapq.heappop(ready_b)
            return (B_CODE, stage, mb)
        if self.policy.w_before_f and pending_w:
            stage, mb = pending_w.popleft()
            return (W_CODE, stage, mb)
        f, ep_f = self.f, self.ep_f
        for priority, stage in enumerate(self.chunks[rank], start=1):
            at = self.ready[self.next_code[stage]] if self.next_f[stage] < self.m else None
            if at is not None and at <= now and self.fits(rank, stage):
                if self.warming_too_long(rank, now, stage):
                    continue
                urgent = self.due(rank, now, priority)
                if urgent is None or urgent >= now + f[stage] + ep_f[stage]:
                    return (F_CODE, stage, self.next_f[stage])
        if pending_w:
            stage, mb = pending_w[0]
            weight = self.w[stage]
            urgent = self.due(rank, now)
            if (urgent is None or urgent >= now + weight) and not self.patient(rank, now, weight):
                pending_w.popleft()
                return (W_CODE, stage, mb)
        return None

    def backward_ready(self, key: Key) -> None:
        """A backward whose forward ran and whose input ``key`` has arrived can start."""
        kind, stage = self.flow.reader(key)
        mb = key[2]
        if kind == B_CODE and self.f_done[stage][mb]:
            at = self.ready[self.codec.action(B_CODE, stage, mb)]
            heapq.heappush(self.ready_b[self.flow.consumer(key)], (at, stage, mb))

    def start(self, rank: int, now: float, kind: int, stage: int, mb: int) -> None:
        """``rank`` runs the op at ``now``: its memory, its stage's progress and the backwards
        it makes ready follow."""
        codec, activation = self.codec, self.activation
        self.remaining[rank] -= 1
        if kind == F_CODE:
            code = self.next_code[stage]
            end = now + self.f[stage] + self.ep_f[stage]
            self.memory[rank] += activation[stage]
            self.in_flight[stage] += 1
            if self.first_forward[rank] is None:
                self.first_forward[rank] = now
            self.next_f[stage] += 1
            self.next_code[stage] = codec.action(F_CODE, stage, self.next_f[stage])
            self.f_done[stage][mb] = True
            at = self.ready[codec.action(B_CODE, stage, mb)]
            if at is not None:  # its gradient came first
                heapq.heappush(self.ready_b[rank], (at, stage, mb))
        elif kind == B_CODE:
            code = codec.action(kind, stage, mb)
            end = now + self.b[stage] + self.ep_b[stage]
            self.memory[rank] -= (1 - self.kept) * activation[stage]
            self.in_flight[stage] -= 1
            self.warm[rank] = False
            self.pending_w[rank].append((stage, mb))
        else:
            code = codec.action(kind, stage, mb)
            end = now + self.w[stage]
            self.memory[rank] -= self.kept * activation[stage]
        free_at = self.free_at[rank]
        if free_at is not None:
            self.idle[rank] += now - free_at
        self.free_at[rank] = end
        self.ranks.place(rank, code, end)
        if kind != W_CODE:
            self.backward_ready(produced(kind, stage, mb))

    def run(self) -> Schedule:
        """Wake ranks in time order until every op is placed; a ValueError if some rank is left
        waiting for memory the cap never frees."""
        ranks, clock, remaining = self.ranks, self.ranks.clock, self.remaining
        for now, r in ranks.wakeups():
            if remaining[r] == 0 or now < clock[r]:
                continue
            clock[r] = now
            choice = self.decide(r, now)
            if choice is None:
                upcoming = self.arrivals(r, now)
                if upcoming:
                    ranks.wake(r, min(upcoming))
                else:
                    ranks.park(r)
                continue
            self.start(r, now, *choice)
        if any(remaining):
            stuck = [r for r in range(self.placement.num_ranks) if remaining[r]]
            raise ValueError(
                f"no schedule fits the activation memory cap {self.cap:g} on ranks {stuck}: "
                "raise the cap (a rank must hold at least one activation of each stage it runs)"
            )
        name = "cost-aware" if self.placement.kind == "linear" else "cost-aware-v"
        orders = tuple(tuple(order) for order in ranks.orders)
        return Schedule(name, self.placement, self.m, orders)


def list_schedule(
    placement: Placement, m: int, costs: Costs, cap: float, policy: Policy
) -> Schedule:
    """One order per rank from greedy list scheduling under ``policy`` (``_ListScheduler``)."""
    return _ListScheduler(placement, m, costs, cap, policy).run()
