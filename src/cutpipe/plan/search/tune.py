"""``cutpipe tune``'s search: every pass of this package run in order, under one memory cap.

The fixed orders of ZB-H1, ZB-H2 and ZB-V are zero-bubble only when F = B = W. Given the real
costs (per stage, with communication), ``cost_aware`` gathers candidates (the list schedules of
every policy, the fixed orders that fit the cap, on a V the schedule built in rounds, a given
start), times each with the simulator and improves the best few with the passes named in this
package's docstring, in that order. So the result is never slower than the fixed orders.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from cutpipe.plan.progress import progress
from cutpipe.plan.search.caps import default_cap, smallest_cap, within
from cutpipe.plan.search.cooldown import settle_cooldown
from cutpipe.plan.search.expedite import expedite
from cutpipe.plan.search.fill import fill_weights
from cutpipe.plan.search.list_schedule import list_schedule, policies
from cutpipe.plan.search.local_search import local_search
from cutpipe.plan.search.rounds import ROUND_PASSES, rounds_schedule
from cutpipe.records import check_count
from cutpipe.schedule.limits import check_size
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.registry import schedule_info
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import PER_STAGE, Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

#: The fixed orders that join the candidates (and that ``cutpipe tune`` prints beside them).
FIXED = {"linear": ("1f1b", "zbh1", "zbh2"), "v": ("zbv", "dualpipev")}
#: The most ops a cost-aware search schedules: it simulates dozens of whole candidates, about
#: half a minute at the limit (R = 32, m = 1024 on a V is 196,608 ops).
MAX_SEARCHED_OPS = 200_000

# The budgets of the passes. Each is a count, so a search gives the same schedule everywhere.
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


def placement_for(kind: str, ranks: int) -> Placement:
    """The placement ``cost_aware`` means by ``kind``: "linear" or "v"."""
    if kind == "linear":
        return Placement.linear(ranks)
    if kind == "v":
        return Placement.vshape(ranks)
    raise ValueError(f"cost-aware schedules place stages 'linear' or 'v', got {kind!r}")


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
    (default: the makespan, then the span bubble).

    Candidates: the list schedules of every policy (``list_schedule``), the fixed orders
    (``FIXED``) that fit the cap, on a V the best built in rounds (``rounds_schedule``), and
    ``start`` if it fits (the best at a tighter cap: so a larger cap is never worse). Then, in
    this order: the best ``REFILLED`` with their W passes re-placed (``fill_weights``); the best
    three of all (the best, above ``SETTLED_OPS`` ops) with their cool-downs settled
    (``settle_cooldown``); the best two of those (the best, above ``SETTLED_OPS``)
    ``search_evaluations`` simulations of ``local_search`` each (default
    ``default_evaluations``; seeded by ``seed``; ``search_seconds`` bounds it in time if given,
    0 skips it), then settled again; up to ``SETTLED_OPS`` ops the winner's critical path
    expedited (``expedite``, until ``EXPEDITED`` simulations in a row, or
    ``search_evaluations`` if more, do not shorten the step, at most ``EXPEDITED_MOST``) and
    settled once more. Without a time bound the same call gives the same schedule on every
    machine.
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
                searched = local_search(origin, costs, cap, score, search_evaluations,
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
