"""The memory/bubble frontier: the best cost-aware schedule at every memory cap (docs/plan.md).

Caps run from 1F1B's activation peak to twice it, on a linear placement (one stage per rank)
and on a V (two half-size stages per rank), from one set of per-chunk costs: a linear stage is
two chunks (``Costs.scaled(2)``), so both placements hold the same layers per rank and their
caps are in the same units. Each placement's caps are searched in increasing order, each
search starting from the best schedule of the cap below it, so more memory never gives a worse
schedule. The fixed schedules are marked at their own peaks; the lower bounds of
``bounds`` say how far from the best possible each point can be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from cutpipe.plan.search.bounds import bubble_lower_bound
from cutpipe.plan.search.caps import default_cap
from cutpipe.plan.search.polish import polish
from cutpipe.plan.search.tune import cost_aware, placement_for
from cutpipe.schedule.registry import schedule_info
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

#: Caps as multiples of 1F1B's activation peak: 1x to 2x in eighths.
FACTORS = tuple(1 + k / 8 for k in range(9))
#: The fixed schedules marked on the frontier, with the placement whose costs they take.
MARKED = {"zbh1": "linear", "zbh2": "linear", "dualpipe": "linear", "zbv": "v",
          "dualpipev": "v"}  # fmt: skip


def span_first(result) -> tuple[float, float]:
    """The zero-bubble paper's measure: span bubble, then the step."""
    return (result.bubble_ratio_span, result.makespan)


@dataclass(frozen=True)
class Point:
    """The best schedule found on one placement under one cap."""

    placement: str
    factor: float  # the cap, in multiples of 1F1B's peak
    bubble: float  # span bubble
    makespan: float
    peak: float  # the schedule's activation peak, in multiples of 1F1B's
    bound: float  # no schedule on this placement under this cap has a smaller span bubble
    schedule: Schedule


@dataclass(frozen=True)
class Mark:
    """A fixed schedule at its own activation peak."""

    name: str
    placement: str
    peak: float  # multiples of 1F1B's peak
    bubble: float  # span bubble


def placement_costs(chunk: Costs, placement: str) -> Costs:
    """The costs of one stage: a chunk on a V, two chunks on a linear placement."""
    return chunk if placement == "v" else chunk.scaled(2)


def frontier(
    ranks: int,
    microbatches: int,
    chunk: Costs,
    factors: Sequence[float] = FACTORS,
    placements: Sequence[str] = ("linear", "v"),
    evaluations: int | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    polish_effort: float = 0.0,
) -> list[Point]:
    """The best span-bubble schedule of each placement at each cap, searched from the
    tightest cap up (``progress`` hears each point as it is done). ``polish_effort`` > 0 also
    polishes each point above its lower bound with CP-SAT (``plan.polish``, that many solver
    seconds per round) before the next cap starts from it."""
    if list(factors) != sorted(factors) or not factors or factors[0] <= 0:
        raise ValueError(f"frontier caps must be positive and increasing, got {list(factors)}")
    points = []
    for placement in placements:
        costs = placement_costs(chunk, placement)
        base = default_cap(placement, ranks, costs)
        kind = placement_for(placement, ranks)
        best = None
        for factor in factors:
            cap = factor * base
            best = cost_aware(placement, ranks, microbatches, costs, cap, span_first,
                              search_evaluations=evaluations, seed=seed, start=best)  # fmt: skip
            result = metrics(simulate(best, costs), costs)
            bound = bubble_lower_bound(kind, microbatches, costs, cap)
            if polish_effort > 0 and result.bubble_ratio_span > bound + 1e-12:
                best = polish(best, costs, cap, "span", effort=polish_effort)
                result = metrics(simulate(best, costs), costs)
            points.append(Point(placement, factor, result.bubble_ratio_span, result.makespan,
                                max(peak_activations(best, costs)) / base, bound, best))  # fmt: skip
            if progress is not None:
                progress(f"{placement} {factor:g}x: {result.bubble_ratio_span:.4f}")
    return points


#: ``w_memory_sweep``'s default shares of an activation a B keeps until its W, largest first.
W_SHARES = (0.5, 0.25, 0.0)


def w_memory_sweep(
    placement: str,
    ranks: int,
    microbatches: int,
    costs: Costs,
    cap: float,
    shares: Sequence[float] = W_SHARES,
    evaluations: int | None = None,
    seed: int = 0,
) -> list[tuple[float, Schedule]]:
    """The best span-bubble schedule under ``cap`` for each ``w_memory`` of ``shares``, searched
    from the largest share down, each search starting from the schedule of the share before.

    A B that keeps less of its activation for its W holds less memory, so a schedule that fits
    under the cap with a larger share fits with a smaller one: passing it as ``start`` makes less
    memory held never give a worse result. Searched alone, it can: on the zero-bubble paper's V
    at 1.5 times 1F1B's memory, w_memory 0.25 reaches a span bubble of 0 and w_memory 0 only
    0.0017 (docs/plan.md, "The memory/bubble frontier").
    """
    if list(shares) != sorted(shares, reverse=True) or not shares:
        raise ValueError(f"w_memory shares must be decreasing, got {list(shares)}")
    found, best = [], None
    for share in shares:
        best = cost_aware(placement, ranks, microbatches, replace(costs, w_memory=share), cap,
                          span_first, search_evaluations=evaluations, seed=seed,
                          start=best)  # fmt: skip
        found.append((share, best))
    return found


def marks(ranks: int, microbatches: int, chunk: Costs) -> list[Mark]:
    """Each fixed schedule of ``MARKED`` that accepts the shape, at its activation peak."""
    out = []
    for name, placement in MARKED.items():
        info = schedule_info(name)
        if not info.accepts(ranks, microbatches):
            continue
        costs = placement_costs(chunk, placement)
        schedule = info.generate(ranks, microbatches)
        result = metrics(simulate(schedule, costs), costs)
        peak = max(peak_activations(schedule, costs)) / default_cap(placement, ranks, costs)
        out.append(Mark(name, placement, peak, result.bubble_ratio_span))
    return out
