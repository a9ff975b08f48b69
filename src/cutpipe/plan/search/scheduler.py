"""Cost-aware zero-bubble schedules: place every F, B and W by simulated time, under a memory cap.

The fixed orders of ZB-H1, ZB-H2 and ZB-V are zero-bubble only when F = B = W. Given the real
costs (per stage, with communication), ``cost_aware`` builds each rank's order by list scheduling:
ranks advance in simulated time; a free rank runs a B whose gradient has arrived (B is on the
critical path), else an F whose input has arrived if its activation fits under the memory cap,
else a deferred W (which fills what would be a bubble), else it waits for the next arrival.

A few policies are tried (``policies``: which chunk's F and B go first on a V, whether a W may
start when a B is due during it, a warm-up rule, patience in the tail) and every candidate,
together with the fixed orders that respect the cap, is timed by the simulator; the fastest
wins. On a V the schedule is also built in rounds (``rounds_schedule``: one backward and one
forward per rank per round, W passes held back for the cool-down as far as each rank's idle
allowance lets it). So the result is never slower than the fixed orders. The best few get
their cool-downs re-sequenced by critical path (``plan.cooldown``), which is what takes ZB-V
at the zero-bubble paper's setting to the lower bound of ``plan.bounds``, and the best two of
those a local search whose budget is a count of simulations (``improve``), so results repeat
on every machine; last, the ops that wait for their rank on the critical path are moved earlier
(``plan.expedite``), which the local search, starting on the longest-span rank, never reaches.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cutpipe.plan.progress import progress
from cutpipe.plan.search.caps import within
from cutpipe.plan.search.cooldown import settle_cooldown
from cutpipe.plan.search.events import Ranks
from cutpipe.plan.search.expedite import expedite, passes_done, try_order
from cutpipe.plan.search.rounds import ROUND_PASSES, rounds_schedule
from cutpipe.records import check_count
from cutpipe.schedule.codes import B_CODE, F_CODE, KIND_BITS, KIND_MASK, W_CODE
from cutpipe.schedule.dataflow import Dataflow, Key, produced
from cutpipe.schedule.limits import check_size
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.registry import schedule_info
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import PER_STAGE, Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate


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


def round_trips(placement: Placement, costs: Costs) -> list[float]:
    """Per rank: from the start of its first forward to the earliest its first gradient can
    arrive, if nothing else holds up that microbatch on its way to the loss and back."""
    S, c = placement.num_stages, costs.comm
    f = [x + e for x, e in zip(costs.per_stage("f", S), costs.per_stage("ep_f", S), strict=True)]
    b = [x + e for x, e in zip(costs.per_stage("b", S), costs.per_stage("ep_b", S), strict=True)]
    owner = placement.pipes[0]
    starts, ready = [0.0] * S, [0.0] * S
    for s in range(1, S):
        starts[s] = starts[s - 1] + f[s - 1] + (c if owner[s] != owner[s - 1] else 0.0)
    ready[S - 1] = starts[S - 1] + f[S - 1]
    for s in range(S - 2, -1, -1):
        ready[s] = ready[s + 1] + b[s + 1] + (c if owner[s] != owner[s + 1] else 0.0)
    trips = [math.inf] * placement.num_ranks
    first = [math.inf] * placement.num_ranks
    for s in range(S):
        first[owner[s]] = min(first[owner[s]], starts[s])
        trips[owner[s]] = min(trips[owner[s]], ready[s])
    return [t - a for t, a in zip(trips, first, strict=True)]


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


def placement_for(kind: str, ranks: int) -> Placement:
    """The placement ``cost_aware`` means by ``kind``: "linear" or "v"."""
    if kind == "linear":
        return Placement.linear(ranks)
    if kind == "v":
        return Placement.vshape(ranks)
    raise ValueError(f"cost-aware schedules place stages 'linear' or 'v', got {kind!r}")


def list_schedule(
    placement: Placement, m: int, costs: Costs, cap: float, policy: Policy
) -> Schedule:
    """One order per rank from greedy list scheduling under ``policy``."""
    R, S = placement.num_ranks, placement.num_stages
    ranks = Ranks(Dataflow(placement, m), costs.comm)
    flow, codec = ranks.flow, ranks.codec
    f, b, w = (costs.per_stage(n, S) for n in ("f", "b", "w"))
    ep_f, ep_b = costs.per_stage("ep_f", S), costs.per_stage("ep_b", S)
    activation = costs.per_stage("activation", S)
    kept = costs.w_memory
    chunks = [sorted(placement.stages_of(r), reverse=policy.later_chunk_first) for r in range(R)]
    next_f = [0] * S  # per stage: next microbatch to forward
    next_code = [codec.action(F_CODE, stage, 0) for stage in range(S)]  # and its op
    in_flight = [0] * S  # per stage: forwards whose backward has not run yet
    f_done = [[False] * m for _ in range(S)]
    ready_b: list[list[tuple[float, int, int]]] = [[] for _ in range(R)]  # (arrival, stage, mb)
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(R)]
    memory = [0.0] * R
    trips = round_trips(placement, costs)
    first_forward: list[float | None] = [None] * R  # when each rank started its first F
    warm = [True] * R  # no B run yet
    idle = [0.0] * R  # per rank: time spent waiting since its first op
    free_at: list[float | None] = [None] * R  # when the rank's last op ends
    remaining = [3 * m * len(chunks[r]) for r in range(R)]
    ready = ranks.ready  # when each op's input is on its rank

    def fits(rank: int, stage: int) -> bool:
        """An F fits if, after it, a later chunk with nothing in flight can still start: a V
        rank whose memory is all first-chunk activations could never reach the loss. (A later
        chunk with something in flight will free memory when its backward arrives.)"""
        reserve = sum(
            activation[s] for s in chunks[rank] if s > stage and next_f[s] < m and not in_flight[s]
        )
        return within(memory[rank] + activation[stage] + reserve, cap)

    def arrivals(rank: int, now: float, below: int | None = None) -> list[float]:
        """Known future times at which work becomes ready on ``rank``: a B (priority 0) or the
        F of a chunk (priority 1, 2, ... in preference order); only priorities below ``below``."""
        times = [ready_b[rank][0][0]] if ready_b[rank] else []
        for priority, stage in enumerate(chunks[rank], start=1):
            if below is not None and priority >= below:
                break
            at = ready[next_code[stage]] if next_f[stage] < m else None
            if at is not None and fits(rank, stage):
                times.append(at)
        return [t for t in times if t > now]

    def due(rank: int, now: float, below: int | None = None) -> float | None:
        """With lookahead, when the next more urgent work arrives (None: nothing known)."""
        return min(arrivals(rank, now, below), default=None) if policy.lookahead else None

    def warming_too_long(rank: int, now: float, stage: int) -> bool:
        """With the warm-up rule: an F that would end after ``rank``'s first B can arrive."""
        started = first_forward[rank]
        if not policy.warmup or not warm[rank] or started is None:
            return False
        return now + f[stage] + ep_f[stage] > started + trips[rank]

    def patient(rank: int, now: float, weight: float) -> bool:
        """Whether ``rank`` should leave a W of ``weight`` for a B that arrives during it."""
        if not policy.patient_tail or not ready_b[rank]:
            return False
        if any(next_f[s] < m for s in chunks[rank]):  # not in the tail yet
            return False
        wait = ready_b[rank][0][0] - now
        return 0 < wait < weight and idle[rank] + wait <= max(idle)

    def decide(rank: int, now: float) -> tuple[int, int, int] | None:
        """The op ``rank`` starts at ``now``, or None to wait."""
        if ready_b[rank] and ready_b[rank][0][0] <= now:
            _, stage, mb = heapq.heappop(ready_b[rank])
            return (B_CODE, stage, mb)
        if policy.w_before_f and pending_w[rank]:
            stage, mb = pending_w[rank].popleft()
            return (W_CODE, stage, mb)
        for priority, stage in enumerate(chunks[rank], start=1):
            at = ready[next_code[stage]] if next_f[stage] < m else None
            if at is not None and at <= now and fits(rank, stage):
                if warming_too_long(rank, now, stage):
                    continue
                urgent = due(rank, now, priority)
                if urgent is None or urgent >= now + f[stage] + ep_f[stage]:
                    return (F_CODE, stage, next_f[stage])
        if pending_w[rank]:
            stage, mb = pending_w[rank][0]
            urgent = due(rank, now)
            if (urgent is None or urgent >= now + w[stage]) and not patient(rank, now, w[stage]):
                pending_w[rank].popleft()
                return (W_CODE, stage, mb)
        return None

    def backward_ready(key: Key) -> None:
        """A backward whose forward ran and whose input ``key`` has arrived can start."""
        kind, stage = flow.reader(key)
        mb = key[2]
        if kind == B_CODE and f_done[stage][mb]:
            at = ready[codec.action(B_CODE, stage, mb)]
            heapq.heappush(ready_b[flow.consumer(key)], (at, stage, mb))

    clock = ranks.clock
    for now, r in ranks.wakeups():
        if remaining[r] == 0 or now < clock[r]:
            continue
        clock[r] = now
        choice = decide(r, now)
        if choice is None:
            upcoming = arrivals(r, now)
            if upcoming:
                ranks.wake(r, min(upcoming))
            else:
                ranks.park(r)
            continue
        kind, stage, mb = choice
        remaining[r] -= 1
        if kind == F_CODE:
            code = next_code[stage]
            end = now + f[stage] + ep_f[stage]
            memory[r] += activation[stage]
            in_flight[stage] += 1
            if first_forward[r] is None:
                first_forward[r] = now
            next_f[stage] += 1
            next_code[stage] = codec.action(F_CODE, stage, next_f[stage])
            f_done[stage][mb] = True
            if (at := ready[codec.action(B_CODE, stage, mb)]) is not None:  # gradient came first
                heapq.heappush(ready_b[r], (at, stage, mb))
        elif kind == B_CODE:
            code = codec.action(kind, stage, mb)
            end = now + b[stage] + ep_b[stage]
            memory[r] -= (1 - kept) * activation[stage]
            in_flight[stage] -= 1
            warm[r] = False
            pending_w[r].append((stage, mb))
        else:
            code = codec.action(kind, stage, mb)
            end = now + w[stage]
            memory[r] -= kept * activation[stage]
        if free_at[r] is not None:
            idle[r] += now - free_at[r]
        free_at[r] = end
        ranks.place(r, code, end)
        if kind != W_CODE:
            backward_ready(produced(kind, stage, mb))
    if any(remaining):
        stuck = [r for r in range(R) if remaining[r]]
        raise ValueError(
            f"no schedule fits the activation memory cap {cap:g} on ranks {stuck}: raise the cap "
            "(a rank must hold at least one activation of each stage it runs)"
        )
    name = "cost-aware" if placement.kind == "linear" else "cost-aware-v"
    return Schedule(name, placement, m, tuple(tuple(o) for o in ranks.orders))


def fill_weights(base: Schedule, costs: Costs, cap: float, patient: bool) -> Schedule:
    """Keep ``base``'s order of forwards and backwards, and place its W passes by time.

    A rank whose next F or B must wait for its input runs pending W passes in the gap; with
    ``patient``, only those that end before the input arrives (if the arrival is known), so
    that no W delays the critical path. A W also runs first when the next F would break the
    memory cap. Whatever is left runs at the end, oldest first.
    """
    placement, m = base.placement, base.num_microbatches
    R, S = placement.num_ranks, placement.num_stages
    ranks = Ranks(base.dataflow, costs.comm)
    codec = base.codec
    w = costs.per_stage("w", S)
    activation = costs.per_stage("activation", S)
    kept = costs.w_memory
    timing = costs.timing(base)
    durations = (timing.forward, timing.backward, timing.weight, timing.full_backward)
    main = [[c for c in ops if c < 0 or c & KIND_MASK != W_CODE] for ops in base.codes]
    pointer = [0] * R
    memory = [0.0] * R
    pending: list[deque[tuple[int, int]]] = [deque() for _ in range(R)]

    def halves(code: int) -> tuple[int, ...]:
        return codec.split_pair(code) if code < 0 else (code,)

    def allocation(code: int) -> float:
        return sum(
            activation[(h >> KIND_BITS) % S] for h in halves(code) if h & KIND_MASK == F_CODE
        )

    def run_weight(r: int, now: float) -> None:
        stage, mb = pending[r].popleft()
        memory[r] -= kept * activation[stage]
        ranks.place(r, codec.action(W_CODE, stage, mb), now + w[stage])

    for now, r in ranks.wakeups():
        if now < ranks.clock[r] or (pointer[r] >= len(main[r]) and not pending[r]):
            continue
        now = ranks.clock[r]
        if pointer[r] >= len(main[r]):  # only weight passes left
            run_weight(r, now)
            continue
        code = main[r][pointer[r]]
        times = [ranks.ready[half] for half in halves(code)]
        ready = None if None in times else max([now, *times])
        over = not within(memory[r] + allocation(code), cap)
        if pending[r] and (over or ready is None or ready > now):
            stage = pending[r][0][0]
            if over or not patient or (ready is not None and now + w[stage] <= ready):
                run_weight(r, now)
                continue
        if ready is None:  # wait until the producer runs
            ranks.park(r, halves(code)[times.index(None)])
            continue
        if ready > now:
            ranks.clock[r] = ready
            ranks.wake(r, ready)
            continue
        # run the op
        pointer[r] += 1
        if code < 0:
            duration = timing.pair(*codec.split_pair(code))
        else:
            duration = durations[code & KIND_MASK][code >> KIND_BITS]
        for half in halves(code):
            mb, stage = divmod(half >> KIND_BITS, S)
            kind = half & KIND_MASK
            if kind == F_CODE:
                memory[r] += activation[stage]
            else:
                memory[r] -= activation[stage] * (1 - kept if kind == B_CODE else 1.0)
                if kind == B_CODE:
                    pending[r].append((stage, mb))
        ranks.place(r, code, now + duration)
    if any(pointer[r] < len(main[r]) or pending[r] for r in range(R)):
        raise ValueError(f"{base.name}: its order of forwards and backwards cannot run")
    return Schedule(f"{base.name}+w", placement, m, tuple(tuple(o) for o in ranks.orders))


#: How far ``improve`` tries to move a W pass later in one move.
W_DELAYS = 8


def _moves(ops: tuple[int, ...], first: int) -> Iterator[list[int]]:
    """Neighbours of one rank's order: each op swapped with the next, and each W pass moved up
    to ``W_DELAYS`` places later (a W that waits keeps its memory but frees its slot for a B
    that someone downstream is waiting for; adjacent swaps alone cross that plateau badly)."""
    n = len(ops) - 1
    for offset in range(n):
        k = (first + offset) % n
        swapped = list(ops)
        swapped[k], swapped[k + 1] = swapped[k + 1], swapped[k]
        yield swapped
        if ops[k] >= 0 and ops[k] & KIND_MASK == W_CODE:
            for later in range(k + 2, min(len(ops), k + 1 + W_DELAYS)):
                moved = [*ops[:k], *ops[k + 1 : later + 1], ops[k], *ops[later + 1 :]]
                yield moved


def improve(
    schedule: Schedule, costs: Costs, cap: float, score: Callable, evaluations: int,
    seconds: float | None = None, seed: int = 0,
) -> Schedule:  # fmt: skip
    """Local search: swap neighbouring ops of a rank, or move a W later (``_moves``), when the
    simulator says the step gets faster (or stays as fast with its F and B passes done sooner,
    ``plan.expedite.passes_done``) and the order stays valid and under the cap;
    longest-span ranks first (they set the step), first improvement wins, until a sweep finds
    none or ``evaluations`` candidates have been simulated. The budget is a count, so the
    result does not depend on the machine; ``seconds`` may bound it too (then it does).
    ``seed`` picks where each rank's sweep starts.
    """
    deadline = math.inf if seconds is None else time.monotonic() + seconds
    budget = evaluations
    rng = random.Random(seed)
    best = schedule
    timeline = simulate(best, costs)
    best_result = metrics(timeline, costs)
    best_score = (score(best_result), passes_done(best, timeline))
    improved = True
    while improved and time.monotonic() < deadline and budget > 0:
        improved = False
        ranks = sorted(range(best.num_ranks), key=lambda r: -best_result.span_per_rank[r])
        for rank in ranks:
            ops = best.codes[rank]
            if len(ops) < 2:
                continue
            for order in _moves(ops, rng.randrange(len(ops) - 1)):
                if time.monotonic() >= deadline or budget <= 0:
                    break
                budget -= 1
                tried = try_order(best, rank, order, costs, cap, score)
                if tried is not None and tried[0] < best_score:
                    best_score, best, _, best_result = tried
                    improved = True
                    break  # this rank's order changed: sweep it again from the new order
    return best


REFILLED = 3  # how many of the best bases get their W passes re-placed
#: Local-search simulations ``cost_aware`` runs by default: a count, so results are the same on
#: every machine; fewer for large shapes, so that they simulate about ``SEARCHED_OPS`` ops.
DEFAULT_EVALUATIONS = 100
SEARCHED_OPS = 500_000
#: Up to this many ops the three best candidates get their cool-downs settled, above it the best.
SETTLED_OPS = 20_000


#: Simulations ``expedite`` may run on the winner in a row without a shorter step, up to
#: ``SETTLED_OPS`` ops (above it the simulations and the settling after them would take the
#: R = 32, m = 256 V past 10 s), and in all: a chain that keeps shortening gets up to ten times
#: as many.
EXPEDITED = 300
EXPEDITED_MOST = 3000


def default_evaluations(stages: int, microbatches: int) -> int:
    """``DEFAULT_EVALUATIONS``, or as many as simulate ``SEARCHED_OPS`` ops (at least 10)."""
    ops = 3 * stages * microbatches
    return max(10, min(DEFAULT_EVALUATIONS, SEARCHED_OPS // ops))


#: The most ops a cost-aware search schedules: it simulates dozens of whole candidates, about
#: half a minute at the limit (R = 32, m = 1024 on a V is 196,608 ops).
MAX_SEARCHED_OPS = 200_000
FIXED = {"linear": ("1f1b", "zbh1", "zbh2"), "v": ("zbv", "dualpipev")}


def default_cap(placement: str, ranks: int, costs: Costs) -> float:
    """1F1B's activation peak: R stage activations, or 2R half-size ones on a V, in the units
    of ``costs.activation``. With per-stage activations (bytes, from the planner) each of those
    is the largest stage's, so the cap holds 1F1B's peak whichever rank sets it."""
    chunks = 2 if placement == "v" else 1
    return ranks * chunks * max(costs.per_stage("activation", chunks * ranks))


def smallest_cap(placement: Placement, costs: Costs) -> float:
    """The least activation peak any schedule can have: the rank whose stages' activations,
    one microbatch each, add up to the most (per-stage activations as the planner gives them)."""
    activation = costs.per_stage("activation", placement.num_stages)
    return max(
        sum(activation[s] for s in placement.stages_of(rank)) for rank in range(placement.num_ranks)
    )


def _fits_start(start: Schedule, kind: Placement, m: int, costs: Costs, cap: float) -> bool:
    """Whether ``start`` is a schedule of this shape whose peak fits ``cap``."""
    if not isinstance(start, Schedule):
        raise TypeError(f"cost_aware: start must be a Schedule or None, got {start!r}")
    if start.placement != kind or start.num_microbatches != m:
        raise ValueError(
            f"cost_aware: start is a {start.placement.kind} schedule of "
            f"{start.placement.num_ranks} ranks and {start.num_microbatches} microbatches, not "
            f"{kind.kind} on {kind.num_ranks} ranks with {m}"
        )
    return within(max(peak_activations(start, costs)), cap)


def check_search(
    placement: str, ranks: int, microbatches: int, costs: Costs, memory_cap: float | None,
    search_seconds: float | None,
) -> None:  # fmt: skip
    """A TypeError or ValueError naming the argument ``cost_aware`` cannot use, before any work."""
    if placement not in ("linear", "v"):
        raise ValueError(f"cost-aware schedules place stages 'linear' or 'v', got {placement!r}")
    check_count(ranks, "cost_aware: ranks")
    check_count(microbatches, "cost_aware: microbatches")
    if not isinstance(costs, Costs):
        raise TypeError(f"cost_aware: costs must be a Costs, got {costs!r}")
    for label, value in (("memory_cap", memory_cap), ("search_seconds", search_seconds)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"cost_aware: {label} must be a number, got {value!r}")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"cost_aware: {label} must be a finite number >= 0, got {value}")
    stages = ranks * (2 if placement == "v" else 1)
    check_size(
        f"a cost-aware search ({placement})", ranks, stages, microbatches, limit=MAX_SEARCHED_OPS
    )
    for name in PER_STAGE:  # a list must give one value per stage: R, or 2R on a V
        if name != "params" or costs.params is not None:
            costs.per_stage(name, stages)


def cost_aware(
    placement: str,
    ranks: int,
    microbatches: int,
    costs: Costs,
    memory_cap: float | None = None,
    objective: Callable | None = None,
    search_seconds: float | None = None,
    search_evaluations: int | None = None,
    seed: int = 0,
    start: Schedule | None = None,
) -> Schedule:
    """The fastest schedule found for these costs whose activation peak stays under the cap.

    ``memory_cap`` is per rank, in the units of ``costs.activation``: stage activations for
    scalar costs, bytes for the planner's per-stage ``Costs`` (``plan.partition.stage_costs``),
    whose fields list one value per stage (R on a linear placement, 2R on a V). Default:
    ``default_cap``, 1F1B's peak (R stage activations; on a V, R full-size ones; per stage,
    the largest stage's). ``objective`` maps a simulated ``Metrics`` to what to minimise
    (default: the makespan, then the span bubble). Candidates:
    the list schedules of every policy, on a V the best built in rounds (``rounds_schedule``),
    the fixed orders that fit the cap, ``start`` if it
    fits (the best at a tighter cap: so a larger cap is never worse), the best of them with
    their W passes re-placed; the best three (the best, above ``SETTLED_OPS`` ops) get their
    cool-downs settled (``plan.cooldown``),
    the best two of those (the best, above ``SETTLED_OPS``) ``search_evaluations`` simulations
    of local search each (default:
    ``default_evaluations``; seeded by ``seed``;
    ``search_seconds`` bounds it in time if given, 0 skips it), then its cool-down settled
    again; up to ``SETTLED_OPS`` ops its critical path expedited (``plan.expedite``, until
    ``EXPEDITED`` simulations in a row, or ``search_evaluations`` if more, do not shorten the
    step, at most ``EXPEDITED_MOST``) and settled once more. Without
    a time bound the same call gives the same schedule on every machine.
    """
    check_search(placement, ranks, microbatches, costs, memory_cap, search_seconds)
    stages = ranks * (2 if placement == "v" else 1)
    if search_evaluations is None:
        search_evaluations = default_evaluations(stages, microbatches)
    check_count(search_evaluations, "cost_aware: search_evaluations", least=0)
    check_count(seed, "cost_aware: seed", least=0)
    kind = placement_for(placement, ranks)
    cap = memory_cap if memory_cap is not None else default_cap(placement, ranks, costs)
    smallest = smallest_cap(kind, costs)
    if not within(smallest, cap):
        raise ValueError(
            f"memory cap {cap:g} is below the smallest possible peak: a rank must hold one "
            f"activation of each stage it runs ({smallest:g} here, {smallest - cap:g} more)"
        )
    score = objective or (lambda result: (result.makespan, result.bubble_ratio_span))

    def rank(schedule: Schedule) -> tuple:
        return score(metrics(simulate(schedule, costs), costs))

    tried = policies(placement)
    steps = len(tried) + len(FIXED[placement]) + 2 * REFILLED + 2
    with progress(f"cost-aware search ({placement}, R={ranks}, m={microbatches})", steps) as tick:
        bases, failure = [], None
        for policy in tried:
            try:
                bases.append(list_schedule(kind, microbatches, costs, cap, policy))
            except ValueError as error:  # this policy starved a rank; others may not
                failure = error
            tick(status="greedy orders")
        for name in FIXED[placement]:
            info = schedule_info(name)
            if info.accepts(ranks, microbatches):
                fixed = info.generate(ranks, microbatches)
                if within(max(peak_activations(fixed, costs)), cap):
                    bases.append(fixed)
            tick(status="fixed orders")
        # one build per rounds policy above SETTLED_OPS ops, where each takes a quarter second
        passes = ROUND_PASSES if 3 * stages * microbatches <= SETTLED_OPS else 1
        if (
            placement == "v"
            and (rounds := rounds_schedule(kind, microbatches, costs, cap, passes)) is not None
        ):
            bases.append(rounds)
        if start is not None and _fits_start(start, kind, microbatches, costs, cap):
            bases.append(start)
        if not bases:
            raise failure or ValueError(f"no schedule fits the activation memory cap {cap:g}")
        scored = sorted((rank(base), index, base) for index, base in enumerate(bases))
        candidates = [(value, base) for value, _, base in scored]
        for _, _, base in scored[:REFILLED]:  # re-placing W passes is slow: the front-runners
            for patient in (True, False):
                filled = fill_weights(base, costs, cap, patient)
                if within(max(peak_activations(filled, costs)), cap):
                    candidates.append((rank(filled), filled))
                tick(status="weight passes")
        candidates.sort(key=lambda candidate: candidate[0])
        few = REFILLED if 3 * stages * microbatches <= SETTLED_OPS else 1  # settling is slow
        settled = sorted(
            ((rank(done), index, done) for index, done in
             enumerate(settle_cooldown(base, costs, score) for _, base in candidates[:few]))
        )  # fmt: skip
        best = settled[0][2]
        tick(status="cool-down")
        if search_evaluations > 0 and search_seconds != 0:
            # from the best two below SETTLED_OPS: a V built in rounds often leads by a little
            # from a basin the local search cannot leave, where the runner-up's leads lower
            starts = [start for _, _, start in settled[: 2 if few > 1 else 1]]
            for runner_up, origin in enumerate(starts):
                searched = improve(origin, costs, cap, score, search_evaluations,
                                   search_seconds, seed)  # fmt: skip
                if searched is not origin:
                    searched = settle_cooldown(searched, costs, score)
                if not runner_up or rank(searched) < rank(best):
                    best = searched
            if few > 1:  # below SETTLED_OPS: the chain that sets the step, waiting at ranks
                # the local search never reaches (each move a simulation of the whole step)
                patience = max(search_evaluations, EXPEDITED)
                expedited = expedite(best, costs, cap, score, EXPEDITED_MOST, patience)
                if expedited is not best:
                    expedited = settle_cooldown(expedited, costs, score)
                    if rank(expedited) <= rank(best):
                        best = expedited
        tick(status="local search")
    name = "cost-aware" if placement == "linear" else "cost-aware-v"
    return Schedule(name, best.placement, best.num_microbatches, best.codes)
