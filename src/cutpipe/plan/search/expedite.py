"""Expedite the critical path: move the ops that wait for their rank on it earlier.

The longest span ends in a chain of ops, each started either when its input arrived or when its
rank became free. Where an op on that chain waited for its rank although its input was there,
the ops its rank ran in between delayed the whole chain; moving the op before them shortens the
chain by up to that wait (they then run after it, and the simulator says what that costs). On
the frontier's shapes the chain is the last microbatches' forwards up the pipe and their
backwards down, and each rank it crosses holds it up a little with a W or another backward:
adjacent swaps on the longest-span rank (``local_search``) never reach those ranks within
their budget, and one such move alone rarely shortens the step, since the chain's other waits
still hold it, so moves that keep the step and get its F and B passes done sooner are kept too.
Often the op that holds the chain up is a W that started just before the chain's input arrived:
then the move that helps is that W's, later (past the waiting op and what depends on it on the
same rank: on the last stage an F's own B), so the W passes in the way are delayed too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from cutpipe.plan.search.caps import within
from cutpipe.schedule.codes import KIND_MASK, W_CODE, Codec
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs
from cutpipe.sim.metrics import Metrics, metrics
from cutpipe.sim.simulate import simulate
from cutpipe.sim.timeline import Timeline

#: How many places earlier one move may take an op: waits longer than a few ops are rare on
#: the chain, and each place costs a simulation.
REACH = 4
#: How many places later one move may take a W pass that holds up the chain.
W_REACH = 8
#: Times closer than this count as equal (the simulator adds costs in different orders).
EPSILON = 1e-6


def _waits(
    schedule: Schedule, timeline: Timeline, latency: float
) -> Iterator[tuple[int, int, int]]:
    """Along the longest span's critical path, from its end back: (rank, index, earliest) for
    each op that waited for its rank, ``earliest`` the first place in the rank's order it may
    move to (the first op its rank started after the op's input arrived, or the op running
    when it arrived; ``REACH`` at most)."""
    flow, codes = schedule.dataflow, schedule.codes
    codec = Codec(schedule.num_stages, schedule.num_microbatches)
    where = {code: (rank, i) for rank, ops in enumerate(codes) for i, code in enumerate(ops)}
    starts, ends = timeline.starts, timeline.ends
    spans = [e[-1] - s[0] if len(s) else 0.0 for s, e in zip(starts, ends, strict=True)]
    rank = max(range(schedule.num_ranks), key=lambda r: spans[r])
    i = len(codes[rank]) - 1
    while i > 0:
        code, start = codes[rank][i], starts[rank][i]
        key = flow.awaits(code)
        arrive, producer = -1.0, None
        if key is not None:
            producer = where[codec.action(key[0], key[1], key[2])]
            arrive = ends[producer[0]][producer[1]] + (latency if producer[0] != rank else 0.0)
        if arrive >= start - EPSILON and producer is not None:  # waited for its input
            rank, i = producer
            continue
        earliest = i
        while earliest > max(0, i - REACH) and starts[rank][earliest - 1] >= arrive - EPSILON:
            earliest -= 1
        if earliest > max(0, i - REACH) and ends[rank][earliest - 1] > arrive + EPSILON:
            earliest -= 1  # the op that was running when the input arrived
        if earliest < i:
            yield rank, i, earliest
        i -= 1


def _orders_starting_sooner(ops: tuple[int, ...], i: int, earliest: int) -> Iterator[list[int]]:
    """Orders that start op ``i`` sooner: the op moved to each place from ``i - 1`` back to
    ``earliest``, then each W pass in between moved past it, up to ``W_REACH`` places later."""
    for there in range(i - 1, earliest - 1, -1):
        moved = list(ops)
        moved.insert(there, moved.pop(i))
        yield moved
    for k in range(i - 1, earliest - 1, -1):
        if ops[k] >= 0 and ops[k] & KIND_MASK == W_CODE:
            for later in range(i, min(len(ops), k + 1 + W_REACH)):
                yield [*ops[:k], *ops[k + 1 : later + 1], ops[k], *ops[later + 1 :]]


def passes_done(schedule: Schedule, timeline: Timeline) -> float:
    """The sum of the ends of every F and B (W passes left out): the tie-break of this search
    and of ``local_search``. Among orders of equal objective it prefers those that
    get the critical passes done sooner, which is how a search crosses plateaus that two moves on
    two ranks would cross together."""
    return sum(
        end
        for ops, ends in zip(schedule.codes, timeline.ends, strict=True)
        for code, end in zip(ops, ends, strict=True)
        if code < 0 or code & KIND_MASK != W_CODE
    )


def try_order(
    schedule: Schedule, rank: int, order: Sequence[int], costs: Costs, cap: float,
    score: Callable,
) -> tuple[tuple, Schedule, Timeline, Metrics] | None:  # fmt: skip
    """``schedule`` with ``rank``'s order replaced by ``order``, simulated: its search value
    (score, then ``passes_done``), the schedule, its timeline and metrics; None if the order
    breaks a dependency or the cap. The one evaluation of both local searches."""
    codes = (*schedule.codes[:rank], tuple(order), *schedule.codes[rank + 1 :])
    candidate = Schedule(schedule.name, schedule.placement, schedule.num_microbatches, codes)
    try:
        timeline = simulate(candidate, costs)
    except ValueError:  # moved before what it waits for
        return None
    result = metrics(timeline, costs)
    if not within(max(result.peak_activations_per_rank), cap):
        return None
    return (score(result), passes_done(candidate, timeline)), candidate, timeline, result


def expedite(
    schedule: Schedule, costs: Costs, cap: float, score: Callable, evaluations: int,
    patience: int | None = None,
) -> Schedule:  # fmt: skip
    """Move ops that wait for their rank on the critical path earlier (``_waits``,
    ``_orders_starting_sooner``), keeping a move when the step scores better, or the same with
    its F and B passes done sooner, and the cap holds; at most ``evaluations`` simulations, and at most ``patience`` in a row
    that do not score better (a chain that keeps shortening gets the budget, one that does not
    stops early). Schedules with overlapped pairs or several pipes come back unchanged."""
    if schedule.placement.num_pipes != 1 or any(c < 0 for ops in schedule.codes for c in ops):
        return schedule
    latency = costs.comm
    best, timeline = schedule, simulate(schedule, costs)
    best_score = (score(metrics(timeline, costs)), passes_done(best, timeline))
    patience = evaluations if patience is None else patience
    budget, left, improved = evaluations, patience, True  # left: before patience runs out
    while improved and min(budget, left) > 0:
        improved = False
        for rank, i, earliest in _waits(best, timeline, latency):
            for ops in _orders_starting_sooner(best.codes[rank], i, earliest):
                if min(budget, left) <= 0:
                    break
                budget, left = budget - 1, left - 1
                tried = try_order(best, rank, ops, costs, cap, score)
                if tried is not None and tried[0] < best_score:
                    if tried[0][0] < best_score[0]:  # better, not only passes done sooner
                        left = patience
                    best_score, best, timeline, _ = tried
                    improved = True
                    break
            if improved or min(budget, left) <= 0:
                break
    return best
