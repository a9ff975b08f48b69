"""Exact memory-capped schedules for small pipelines, by constraint programming (OR-Tools CP-SAT).

Every F, B and W of every (stage, microbatch) is an interval on its stage's rank. An op starts
after the op whose value it reads (``dataflow.awaited``) ends, plus ``comm`` across ranks; a rank
runs one op at a time. An F's activation is live from its start: the ``1 - w_memory`` share until
its B ends, the rest until its W ends; a cumulative constraint per rank caps the sum, whose
highest point is the peak ``peak_activations`` counts (a rank's ops never overlap). The
simulator starts each op as early as it can: a later start never helps the makespan but could
shorten a rank's span, so for "span" each rank's order is a circuit and each op starts exactly
when its input has arrived and its predecessor has ended. CP-SAT needs integers: costs that are
fractions with small denominators scale exactly; otherwise times are rounded (the bound gives the
rounding back) and memory sizes rounded up against the cap (``optimal`` is then False).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from itertools import pairwise

from cutpipe.plan.search import caps
from cutpipe.plan.search.tune import cost_aware
from cutpipe.records import check_count
from cutpipe.schedule.codes import B_CODE, BW_CODE, F_CODE, KIND_BITS, KIND_MASK, W_CODE, Codec
from cutpipe.schedule.dataflow import ACTIVATION, Dataflow
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

#: What each objective reads off the simulator's ``Metrics``.
OBJECTIVES = {"makespan": lambda r: r.makespan, "span": lambda r: max(r.span_per_rank)}
TIME_STEPS = 10_000  # the longest op in solver units, when times do not scale exactly
MEMORY_STEPS = 1_000_000  # the largest activation in solver units, when sizes do not


@dataclass(frozen=True)
class Exact:
    """A schedule, its objective as simulated, the solver's proven lower bound on the objective
    (both in cost units) and whether they are equal."""

    schedule: Schedule
    value: float
    bound: float
    optimal: bool


def _scaled(values: list[float], steps: int, rounding, exact: bool = True) -> tuple[list[int], Fraction | float, bool]:  # fmt: skip
    """Integers for ``values``, the factor and whether exact: exact multiples if ``exact`` and the
    values are fractions with small denominators (3, 0.5, 1e9, 1/3), else rounded, the largest to
    ``steps``."""
    ratios = [Fraction(v).limit_denominator(10**6) for v in values]
    if exact and all(float(q) == v for q, v in zip(ratios, values, strict=True)):
        unit = math.lcm(*(q.denominator for q in ratios))
        common = math.gcd(*(int(q * unit) for q in ratios)) or 1
        if max(ratios) * unit <= 10**12 * common:  # far inside CP-SAT's 64-bit integers
            return [int(q * unit) // common for q in ratios], Fraction(unit, common), True
    factor = steps / (max(values) or 1.0)
    return [rounding(v * factor) for v in values], factor, False


def solver_times(
    costs: Costs, S: int, m: int, hops: int
) -> tuple[list[list[int]], int, float, float]:
    """F, B and W durations per stage in solver units (at least 1: no two ops of a rank start
    together), the comm, units per cost unit, and the most the rounding of every op and every
    crossing (``hops`` stage boundaries cross ranks) can lengthen an objective."""
    flat = [*(t for n in "fbw" for t in costs.per_stage(n, S)), costs.comm]
    # a zero duration becomes 1 unit, so then the others are scaled to TIME_STEPS
    ints, scale, _ = _scaled(flat, TIME_STEPS, round, exact=min(flat[:-1]) > 0)
    durations, comm = [max(1, u) for u in ints[: 3 * S]], ints[3 * S]
    error = [abs(u - v * scale) for u, v in zip([*durations, comm], flat, strict=True)]
    slack = m * sum(error[:-1]) + 2 * m * hops * error[-1]
    return [durations[k * S : k * S + S] for k in range(3)], comm, float(scale), slack


def solver_memory(costs: Costs, S: int, cap: float) -> tuple[list[list[int]], int, bool]:
    """Per stage, the memory its B frees and its W frees in solver units; the cap; whether exact
    (else an F's activation and its W's share are rounded up, and the cap down)."""
    act = costs.per_stage("activation", S)
    up = lambda v: math.ceil(v - 1e-6)  # noqa: E731  (but not past float noise)
    sizes, scale, exact = _scaled([*act, *(a * costs.w_memory for a in act)], MEMORY_STEPS, up)
    limit = cap + caps.CAP_SLACK / 2 * max(1.0, abs(cap))  # what ``within`` lets through
    by_b = [t - w for t, w in zip(sizes[:S], sizes[S:], strict=True)]
    return [by_b, sizes[S:]], math.floor(Fraction(limit) * scale), exact


def _check(placement: str, ranks: int, m: int, costs: Costs, cap: float | None, objective: str,
           max_ops: int) -> tuple[Placement, float]:  # fmt: skip
    """The placement and the cap, or an error that says what to change."""
    if placement not in ("linear", "v"):
        raise ValueError(f"exact_schedule: placement is 'linear' or 'v', got {placement!r}")
    check_count(ranks, "exact_schedule: ranks")
    check_count(m, "exact_schedule: microbatches")
    kind = Placement.linear(ranks) if placement == "linear" else Placement.vshape(ranks)
    if objective not in OBJECTIVES:
        raise ValueError(f"exact_schedule: objective is 'makespan' or 'span', got {objective!r}")
    if not isinstance(costs, Costs):
        raise TypeError(f"exact_schedule: costs must be a Costs, got {costs!r}")
    if costs.has_ep() or costs.fb is not None:
        raise ValueError("exact_schedule models F, B and W alone: set ep_f, ep_b to 0, fb to None")
    if (ops := 3 * kind.num_stages * m) > max_ops:
        raise ValueError(f"exact_schedule: {ops} ops (F, B, W x {kind.num_stages} stages x {m} "
                         f"microbatches) is above max_ops={max_ops}: use fewer microbatches or "
                         "ranks")  # fmt: skip
    cap = caps.default_cap(placement, ranks, costs) if cap is None else cap
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap):
        raise ValueError(f"exact_schedule: memory_cap must be a finite number, got {cap!r}")
    if not caps.within(smallest := caps.smallest_cap(kind, costs), cap):
        raise ValueError(f"memory cap {cap:g} is below the smallest possible peak {smallest:g}: "
                         "a rank must hold one activation of each stage it runs")  # fmt: skip
    return kind, cap


def _circuit(model, mine: list[int], start: dict, end: dict, arrival: dict, before: dict,
             horizon: int) -> dict:  # fmt: skip
    """Order one rank's ops as a circuit, each starting as early as the simulator would start it:
    at the later of its input's arrival and its predecessor's end. The arcs' literals."""
    arcs = {}
    for c in mine:
        previous = model.NewIntVar(0, horizon, "")
        arcs[(-1, c)], arcs[(c, -1)] = model.NewBoolVar(""), model.NewBoolVar("")
        model.Add(previous == 0).OnlyEnforceIf(arcs[(-1, c)])
        for d in mine:
            if d != c and c not in before[d]:  # d right before c, unless c must precede d
                arcs[(d, c)] = model.NewBoolVar("")
                model.Add(previous == end[d]).OnlyEnforceIf(arcs[(d, c)])
        model.AddMaxEquality(start[c], [arrival[c], previous])
    node = {c: i for i, c in enumerate(mine, 1)} | {-1: 0}
    model.AddCircuit([(node[a], node[b], lit) for (a, b), lit in arcs.items()])
    return arcs


def plain_passes(schedule: Schedule) -> Schedule:
    """``schedule`` with each fused BW run as its B then its W and each overlapped pair as its F
    then its B: what the solver models."""
    split = {BW_CODE: (B_CODE - BW_CODE, W_CODE - BW_CODE)}  # a BW's B and W: the kind differs
    orders = []
    for ops in schedule.codes:
        halves = [h for c in ops for h in (schedule.codec.split_pair(c) if c < 0 else (c,))]
        orders.append(tuple(h + d for h in halves for d in split.get(h & KIND_MASK, (0,))))
    return Schedule(schedule.name, schedule.placement, schedule.num_microbatches, tuple(orders))


def _hint(model, found: Schedule, units: list[list[int]], comm: int, start: dict, arcs: dict):
    """Start the search from ``found`` (the cost-aware list schedule) with each BW run as its B
    then its W and each overlapped pair as its F then its B, simulated in solver units."""
    plain = plain_passes(found)
    orders = plain.codes
    timeline = simulate(plain, Costs(f=units[0], b=units[1], w=units[2], comm=comm))
    for ops, starts in zip(orders, timeline.starts, strict=True):
        for c, t in zip(ops, starts, strict=True):
            model.AddHint(start[c], round(t))
    pairs = {pair for ops in orders for pair in pairwise((-1, *ops, -1))}
    for pair, lit in arcs.items():
        model.AddHint(lit, pair in pairs)


def exact_schedule(
    placement: str, ranks: int, microbatches: int, costs: Costs,
    memory_cap: float | None = None, objective: str = "makespan",
    time_limit: float = 60.0, max_ops: int = 600, seed: int = 0,
) -> Exact:  # fmt: skip
    """The schedule with the least ``objective`` whose activation peak stays under the cap.

    ``objective``: "makespan" (the step) or "span" (the longest from a rank's first op to its
    last, the zero-bubble papers' measure); split backwards only. ``memory_cap``: per rank, in
    units of ``costs.activation`` (default ``default_cap``). One worker and a fixed ``seed``
    repeat a solve that ends before ``time_limit`` s. ``max_ops`` keeps instances small.
    """
    try:
        from ortools.sat.python import cp_model
    except ImportError as error:
        raise ImportError(
            'exact schedules need OR-Tools: pip install "cutpipe[exact]"', name="ortools"
        ) from error
    kind, cap = _check(placement, ranks, microbatches, costs, memory_cap, objective, max_ops)
    S, m, owner = kind.num_stages, microbatches, kind.pipes[0]
    hops = sum(owner[s] != owner[s + 1] for s in range(S - 1))
    units, comm, scale, slack = solver_times(costs, S, m, hops)
    freed, cap_units, exact_memory = solver_memory(costs, S, cap)

    codec, flow, model = Codec(S, m), Dataflow(kind, m), cp_model.CpModel()
    order = [(F_CODE, s) for s in range(S)] + [(B_CODE, s) for s in reversed(range(S))]
    order += [(W_CODE, s) for s in range(S)]  # so that each op comes after the op it reads
    ops = [codec.action(k, s, j) for j in range(m) for k, s in order]
    dur = {c: units[c & KIND_MASK][(c >> KIND_BITS) % S] for c in ops}
    rank = {c: owner[(c >> KIND_BITS) % S] for c in ops}
    horizon = sum(dur.values()) + 2 * m * hops * comm
    start = {c: model.NewIntVar(0, horizon, f"start{c}") for c in ops}
    end = {c: start[c] + dur[c] for c in ops}
    arrival, before, earliest = {}, {}, {}  # input there; ops that must end first; lower bound
    for c in ops:
        key = flow.awaits(c)
        if key is None:
            arrival[c], before[c], earliest[c] = 0, set(), 0
            continue
        read = codec.action(F_CODE if key[0] == ACTIVATION else B_CODE, key[1], key[2])
        delay = comm if rank[read] != rank[c] else 0
        arrival[c], before[c] = end[read] + delay, before[read] | {read}
        earliest[c] = earliest[read] + dur[read] + delay
        model.Add(start[c] >= arrival[c])
    for j in range(m - 1):  # microbatches are interchangeable: number them by first forward
        model.Add(start[codec.action(F_CODE, 0, j)] < start[codec.action(F_CODE, 0, j + 1)])
    goal, arcs = model.NewIntVar(0, horizon, "goal"), {}
    per_rank = [[c for c in ops if rank[c] == r] for r in range(ranks)]
    for mine in per_rank:
        model.AddNoOverlap([model.NewFixedSizeIntervalVar(start[c], dur[c], "") for c in mine])
        held, sizes = [], []  # each F's activation: the share its B frees, then its W's
        for c in (c for c in mine if c & KIND_MASK == F_CODE):
            for freer, by in zip((c + 1, c + 2), freed, strict=True):  # its B, its W
                length = model.NewIntVar(0, horizon, "")
                held.append(model.NewIntervalVar(start[c], length, end[freer], ""))
                sizes.append(by[(c >> KIND_BITS) % S])
        model.AddCumulative(held, sizes, cap_units)
        head = min(earliest[c] for c in mine) if objective == "makespan" else 0
        model.Add(goal >= head + sum(dur[c] for c in mine))  # redundant: a quicker bound
        if objective == "span":
            arcs |= _circuit(model, mine, start, end, arrival, before, horizon)
            first = model.NewIntVar(0, horizon, "")
            model.AddMinEquality(first, [start[c] for c in mine])
            for c in mine:
                model.Add(goal >= end[c] - first)
    if objective == "makespan":
        model.AddMaxEquality(goal, [end[c] for c in ops])
    model.Minimize(goal)
    try:
        found = cost_aware(placement, ranks, m, costs, cap, OBJECTIVES[objective], 0.0)
        _hint(model, found, units, comm, start, arcs)
    except ValueError:  # no greedy order fits the cap: the search starts from nothing
        pass

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    status = solver.Solve(model)
    if status == cp_model.INFEASIBLE:
        raise ValueError(f"no schedule fits the activation memory cap {cap:g}: raise the cap")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise TimeoutError(f"no schedule found in {time_limit:g} s: raise time_limit")
    codes = tuple(tuple(sorted(mine, key=lambda c: solver.Value(start[c]))) for mine in per_rank)
    schedule = Schedule("exact" if placement == "linear" else "exact-v", kind, m, codes)
    if not caps.within(max(peak_activations(schedule, costs)), cap):
        raise RuntimeError(f"exact_schedule broke the memory cap {cap:g}: a bug, please report")
    value = OBJECTIVES[objective](metrics(simulate(schedule, costs), costs))
    bound = min(value, (solver.BestObjectiveBound() - slack) / scale)
    proved = status == cp_model.OPTIMAL and exact_memory
    return Exact(schedule, value, bound, proved and value <= bound + 1e-9 * max(1.0, value))
