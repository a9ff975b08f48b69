"""A pass of the cost-aware search: local search, one rank's order changed per simulation.

Moves are small (an op swapped with the next, a W pass moved a few places later) and each is
judged by simulating the whole step, so the budget is a count of simulations: the same call
gives the same schedule on every machine.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator

from cutpipe.plan.search.expedite import passes_done, try_order
from cutpipe.schedule.codes import KIND_MASK, W_CODE
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

#: How far ``local_search`` tries to move a W pass later in one move.
W_DELAYS = 8


def _swapped_or_delayed_orders(ops: tuple[int, ...], first: int) -> Iterator[list[int]]:
    """Neighbours of one rank's order, sweeping from ``first``: each op swapped with the next,
    and each W pass moved up to ``W_DELAYS`` places later (a W that waits keeps its memory but
    frees its slot for a B that someone downstream is waiting for; adjacent swaps alone cross
    that plateau badly)."""
    n = len(ops) - 1
    for offset in range(n):
        k = (first + offset) % n
        swapped = list(ops)
        swapped[k], swapped[k + 1] = swapped[k + 1], swapped[k]
        yield swapped
        if ops[k] >= 0 and ops[k] & KIND_MASK == W_CODE:
            for later in range(k + 2, min(len(ops), k + 1 + W_DELAYS)):
                yield [*ops[:k], *ops[k + 1 : later + 1], ops[k], *ops[later + 1 :]]


def local_search(
    schedule: Schedule, costs: Costs, cap: float, score: Callable, evaluations: int,
    seconds: float | None = None, seed: int = 0,
) -> Schedule:  # fmt: skip
    """Swap neighbouring ops of a rank, or move a W later (``_swapped_or_delayed_orders``), when
    the simulator says the step gets faster (or stays as fast with its F and B passes done
    sooner, ``expedite.passes_done``) and the order stays valid and under the cap;
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
            for order in _swapped_or_delayed_orders(ops, rng.randrange(len(ops) - 1)):
                if time.monotonic() >= deadline or budget <= 0:
                    break
                budget -= 1
                tried = try_order(best, rank, order, costs, cap, score)
                if tried is not None and tried[0] < best_score:
                    best_score, best, _, best_result = tried
                    improved = True
                    break  # this rank's order changed: sweep it again from the new order
    return best
