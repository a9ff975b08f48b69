"""A pass of the cost-aware search (``tune.cost_aware``): a V schedule built in rounds.

After a warm-up that fills the pipe, each round every rank places one backward and then one
forward, so the microbatches in flight stay fixed, and W passes are held back for the cool-down
as far as each rank's idle allowance lets them: what takes the frontier's V between 1.125x and
1.75x 1F1B's memory down (docs/plan.md, "The memory/bubble frontier").
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from cutpipe.plan.search.caps import CAP_SLACK, within
from cutpipe.schedule.codes import B_CODE, F_CODE, KIND_BITS, W_CODE, Codec
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs

#: ``rounds_schedule``: how many times the V is built per policy, each build after the first
#: with every rank's idle allowance taken from the build before (a third never won on the
#: frontier's shapes).
ROUND_PASSES = 2
#: Warm-up leads tried by ``rounds_schedule``, in forwards: how far past the arrival of its
#: second chunk's first input a rank's last warm-up forward may end. More memory wants more
#: lead (0.5 wins at 1.625x and 2x the frontier's cap, 0.25 at 1.5x, 0 at 1.375x).
ROUND_LEADS = (0.0, 0.25, 0.5)


@dataclass(frozen=True)
class RoundsPolicy:
    """How ``v_rounds`` fills a rank's waits with W passes and how far its warm-up runs."""

    fill_b: bool  # a wait for a second-chunk backward beyond the allowance runs a W first
    lead: float = 0.0  # warm-up forwards may end this many forwards after the input arrives


class _VRounds:
    """Build a V schedule in rounds, timing every op as it is placed.

    After a warm-up that fills the pipe, each round every rank places one backward and then
    one forward, so the microbatches in flight stay fixed, as in 1F1B. The W passes are what
    bends: a rank runs one before an op whose input is still on its way if it ends before that
    input arrives, or if the wait is longer than the rank's *allowance* (the idle time it may
    add without idling more than the rank that idles most). Keeping W passes back fills the
    cool-down, where the last backwards cross the V and the ranks have nothing else to run; the
    allowance says how long a rank may wait now to keep them for then.
    """

    def __init__(self, placement: Placement, m: int, costs: Costs, cap: float,
                 policy: RoundsPolicy, allowance: list[float] | None) -> None:  # fmt: skip
        R, S = placement.num_ranks, placement.num_stages
        self.R, self.S, self.m, self.cap, self.policy = R, S, m, cap, policy
        self.allowance = allowance
        ep_f, ep_b = costs.per_stage("ep_f", S), costs.per_stage("ep_b", S)
        self.cost = (
            [x + e for x, e in zip(costs.per_stage("f", S), ep_f, strict=True)],
            [x + e for x, e in zip(costs.per_stage("b", S), ep_b, strict=True)],
            costs.per_stage("w", S),
        )
        self.activation = costs.per_stage("activation", S)
        kept = costs.w_memory
        self.freed = (-1.0, 1 - kept, kept)  # share of the activation each kind frees
        owner = placement.pipes[0]
        hop = [costs.comm if owner[s] != owner[s + 1] else 0.0 for s in range(S - 1)]
        # per kind and stage: the kind and stage of the op that feeds it, and the hop after it
        # (stage 0's forward reads the batch: ``arrival`` answers it before looking here)
        self.source = (
            [(F_CODE, max(s - 1, 0), hop[s - 1] if s else 0.0) for s in range(S)],
            [(B_CODE, s + 1, hop[s]) for s in range(S - 1)] + [(F_CODE, S - 1, 0.0)],
            [(B_CODE, s, 0.0) for s in range(S)],
        )
        self.limit = cap + CAP_SLACK * max(1.0, abs(cap))  # ``within``, inlined: it is hot
        self.codec = Codec(S, m)
        self.end = [-1.0] * self.codec.span  # per op code: its end, -1 until placed
        self.clock = [0.0] * R
        self.memory = [0.0] * R
        self.peak = [0.0] * R
        self.idle = [0.0] * R
        self.first = [0.0] * R  # when each rank's first op starts
        self.forwards = [[0, 0] for _ in range(R)]  # per rank and chunk: placed so far
        self.backwards = [[0, 0] for _ in range(R)]
        self.pending: list[deque[tuple[int, int]]] = [deque() for _ in range(R)]
        self.orders: list[list[int]] = [[] for _ in range(R)]

    def stage(self, rank: int, chunk: int) -> int:
        return rank if chunk == 0 else self.S - 1 - rank

    def arrival(self, kind: int, stage: int, mb: int) -> float | None:
        """When the input of an op is on its rank; None while its producer is unplaced."""
        if kind == F_CODE and stage == 0:
            return 0.0
        source, producer, delay = self.source[kind][stage]
        end = self.end[((mb * self.S + producer) << KIND_BITS) | source]
        return None if end < 0 else end + delay

    def place(self, rank: int, kind: int, stage: int, mb: int) -> None:
        at = self.arrival(kind, stage, mb) if mb < self.m else None
        if at is None:
            raise ValueError(f"v_rounds: op {kind} of stage {stage}, mb {mb} cannot run yet")
        clock = self.clock[rank]
        start = at if at > clock else clock
        if self.orders[rank]:
            self.idle[rank] += start - clock
        else:
            self.first[rank] = start
        code = ((mb * self.S + stage) << KIND_BITS) | kind
        self.clock[rank] = self.end[code] = start + self.cost[kind][stage]
        memory = self.memory[rank] - self.freed[kind] * self.activation[stage]
        self.memory[rank] = memory
        if memory > self.peak[rank]:
            self.peak[rank] = memory
        self.orders[rank].append(code)
        if kind == F_CODE:
            self.forwards[rank][stage != rank] += 1
        elif kind == B_CODE:
            self.backwards[rank][stage != rank] += 1
            self.pending[rank].append((stage, mb))

    def weight(self, rank: int) -> None:
        stage, mb = self.pending[rank].popleft()
        self.place(rank, W_CODE, stage, mb)

    def forward(self, rank: int, chunk: int) -> None:
        self.place(rank, F_CODE, self.stage(rank, chunk), self.forwards[rank][chunk])

    def room(self, rank: int, extra: float) -> bool:
        return self.memory[rank] + extra <= self.limit

    def free_for(self, rank: int, extra: float) -> None:
        """W passes until ``extra`` more activation fits, as far as W passes free it."""
        while not self.room(rank, extra) and self.pending[rank]:
            self.weight(rank)

    def fill(self, rank: int, at: float | None, beyond: bool) -> None:
        """Before an op whose input arrives at ``at``: the W passes that end by then, and with
        ``beyond`` one more if the wait is longer than the rank's allowance."""
        pending, w = self.pending[rank], self.cost[W_CODE]
        if at is None:
            return
        while pending and at >= self.clock[rank] + w[pending[0][0]]:
            self.weight(rank)
        worst = max(self.idle)
        if self.allowance is not None:
            worst = max(worst, max(self.allowance) - self.allowance[rank])
        if beyond and pending and at - self.clock[rank] > worst - self.idle[rank]:
            self.weight(rank)

    def warm_up(self) -> None:
        """A first-chunk forward down every rank; then each rank from the tip back runs more
        first-chunk forwards (the ranks before it alongside, to feed them) while they end
        before its second chunk's first input arrives (``lead`` forwards later at most) and
        leave room for the 2 + 2r activations its next forwards take, then its second chunk's
        first forward; then each rank catches up on forwards with the rank before it."""
        R, m, f = self.R, self.m, self.cost[F_CODE]
        for rank in range(R):
            self.forward(rank, 0)
        for rank in range(R - 1, -1, -1):
            arrive = self.arrival(F_CODE, self.stage(rank, 1), 0)
            while (rank < R - 1 and arrive is not None
                   and self.room(rank, self.activation[rank] * (2 + 2 * rank))
                   and self.clock[rank] + f[rank] <= arrive + self.policy.lead * f[rank]
                   and self.forwards[rank][0] < m - rank):  # fmt: skip
                for lower in range(rank + 1):
                    self.forward(lower, 0)
            self.forward(rank, 1)
        chunk = 0
        for rank in range(1, R):
            mine, before = self.forwards[rank], self.forwards[rank - 1]
            while sum(mine) < sum(before) or mine[1] <= before[1] < m:
                upper = [u for u in range(R - 1, rank - 1, -1) if self.forwards[u][chunk] < m]
                if not upper and self.forwards[rank][1 - chunk] >= m:
                    raise ValueError("v_rounds: the warm-up cannot fill the pipe")
                for u in upper:
                    self.forward(u, chunk)
                chunk = 1 - chunk

    def backward_chunk(self, rank: int) -> int | None:
        """The second chunk's backward (nearer the loss) unless the first chunk's has fallen
        behind it and its gradient is there, or the second chunk is done; None if both are.
        In the cool-down (no forwards left) the second chunk's goes first whenever its gradient
        is there no later: its chain runs on down the whole V, the first chunk's ends sooner."""
        back, m = self.backwards[rank], self.m
        if back[0] >= m and back[1] >= m:
            return None
        if back[0] >= back[1] and back[1] < m:
            return 1
        if rank == self.R - 1 or back[1] >= m:
            return 0
        first = self.arrival(B_CODE, rank, back[0])
        if self.forwards[rank][1] >= m:  # cool-down: the longer chain first if it is there
            second = self.arrival(B_CODE, self.S - 1 - rank, back[1])
            if second is not None and (first is None or second <= first):
                return 1
        return 0 if first is not None else 1

    def forward_chunk(self, rank: int) -> int | None:
        """The second chunk's forward if its input is there, else the first chunk's if its
        input is there and the second chunk has caught up; None if neither can run."""
        done, m = self.forwards[rank], self.m
        if done[1] >= m:
            return None
        if done[1] >= done[0]:
            return 0 if done[0] < m else None
        if rank == self.R - 1 or self.arrival(F_CODE, self.stage(rank, 1), done[1]) is not None:
            return 1
        if done[0] < m and self.arrival(F_CODE, rank, done[0]) is not None:
            return 0
        return None

    def steady(self) -> None:
        """Rounds of one backward and one forward per rank, then the W passes left."""
        R = self.R
        for _ in range(2 * self.m):
            for rank in range(R):
                self.free_for(rank, 0.0)
            chunks = [self.backward_chunk(rank) for rank in range(R)]
            # gradients run down the first chunks from the tip, up the second ones from rank 0
            order = [r for r in range(R - 1, -1, -1) if chunks[r] == 0]
            order += [r for r in range(R) if chunks[r] == 1]
            for rank in order:
                stage = self.stage(rank, chunks[rank])
                mb = self.backwards[rank][chunks[rank]]
                self.fill(
                    rank, self.arrival(B_CODE, stage, mb), chunks[rank] == 0 or self.policy.fill_b
                )
                self.place(rank, B_CODE, stage, mb)
            for rank in range(R):
                chunk = self.forward_chunk(rank)
                if chunk is None:
                    continue
                stage = self.stage(rank, chunk)
                self.free_for(rank, self.activation[stage])
                self.fill(rank, self.arrival(F_CODE, stage, self.forwards[rank][chunk]), True)
                self.forward(rank, chunk)
        for rank in range(R):
            while self.pending[rank]:
                self.weight(rank)
        if any(len(ops) != 6 * self.m for ops in self.orders):
            raise ValueError("v_rounds: the rounds left ops unplaced")


def v_rounds(
    placement: Placement, m: int, costs: Costs, cap: float, policy: RoundsPolicy,
    allowance: list[float] | None = None,
) -> tuple[Schedule, list[float], float]:  # fmt: skip
    """One V schedule built in rounds (``_VRounds``), each rank's idle time in it and its
    longest span; a ValueError if the rounds cannot place every op or the peak breaks the cap."""
    rounds = _VRounds(placement, m, costs, cap, policy, allowance)
    rounds.warm_up()
    rounds.steady()
    if not within(max(rounds.peak), cap):
        raise ValueError("v_rounds: a forward found no room under the cap")
    orders = tuple(map(tuple, rounds.orders))
    span = max(end - first for end, first in zip(rounds.clock, rounds.first, strict=True))
    return Schedule("cost-aware-v", placement, m, orders), rounds.idle, span


def rounds_schedule(
    placement: Placement, m: int, costs: Costs, cap: float, passes: int = ROUND_PASSES
) -> Schedule | None:
    """The V built in rounds whose longest span is shortest, over the policies of
    ``RoundsPolicy`` and ``passes`` builds each (every build after the first allowing each
    rank the idle the build before left it short of the idlest; each build of a large shape
    takes a quarter of a second); None if none builds."""
    best: tuple[float, Schedule] | None = None
    for fill_b, lead in itertools.product((True, False), ROUND_LEADS):
        policy, allowance = RoundsPolicy(fill_b, lead), None
        for _ in range(passes):
            try:
                schedule, idle, span = v_rounds(placement, m, costs, cap, policy, allowance)
            except ValueError:  # these rounds starved a rank or broke the cap
                break
            if best is None or span < best[0]:
                best = (span, schedule)
            allowance = idle
    return None if best is None else best[1]
