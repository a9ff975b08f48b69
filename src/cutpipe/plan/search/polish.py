"""Polish a schedule with CP-SAT: every op re-timed within a window of its start, on all ranks at once.

The local search (``plan.search.local_search``) and expediting (``plan.search.expedite``) move one op on
one rank per simulation, and stop where every such move makes the step longer: on the
zero-bubble paper's V at 1.5x 1F1B's memory, at a span bubble of 0.0069 (docs/plan.md). What
is left there needs ops on many ranks to move together. This module hands the whole step to
OR-Tools' CP-SAT solver, with the constraints of ``plan.exact`` (an op starts after the op it
reads plus ``comm`` across ranks, a rank runs one op at a time, a cumulative constraint per rank
holds the live activations under the cap), but with every start kept within ``window`` of where
the schedule has it: a neighbourhood of thousands of ops the solver searches in minutes. Each
rank's order is read back from the solver's starts and re-timed by the simulator, which starts
every op as early as it can; the result is kept only if it fits the cap and scores better, and
the next round is centred on it.
"""

from __future__ import annotations

import math

from cutpipe.plan.search import caps
from cutpipe.plan.search.exact import OBJECTIVES, plain_passes, solver_memory, solver_times
from cutpipe.records import check_count
from cutpipe.schedule.codes import B_CODE, F_CODE, KIND_BITS, KIND_MASK, Codec
from cutpipe.schedule.dataflow import ACTIVATION, Dataflow
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

#: ``polish``'s default window: this many times the longest op (the V at 1.5x needs 1.4).
WINDOW_OPS = 1.5


def _check(schedule: Schedule, costs: Costs, cap: float, objective: str) -> None:
    """Raise what to change if ``polish`` cannot model this schedule, these costs or this cap."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"polish: schedule must be a Schedule, got {schedule!r}")
    if not isinstance(costs, Costs):
        raise TypeError(f"polish: costs must be a Costs, got {costs!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"polish: objective is 'makespan' or 'span', got {objective!r}")
    if costs.has_ep() or costs.fb is not None:
        raise ValueError("polish models F, B and W alone: set ep_f, ep_b to 0, fb to None")
    if schedule.placement.num_pipes != 1:
        raise ValueError("polish follows one pipe; a bidirectional placement has two")
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap):
        raise ValueError(f"polish: memory_cap must be a finite number, got {cap!r}")
    peak = max(peak_activations(schedule, costs))
    if not caps.within(peak, cap):
        raise ValueError(f"polish: {schedule.name!r} peaks at {peak:g}, above the cap {cap:g}")


def _solve(schedule: Schedule, costs: Costs, cap: float, objective: str, window: float,
           effort: float, seed: int) -> Schedule | None:  # fmt: skip
    """One round: the solver's best order within ``window`` of ``schedule``'s starts, or None
    if it found none or kept every rank's order."""
    from ortools.sat.python import cp_model

    kind, m = schedule.placement, schedule.num_microbatches
    S, owner = kind.num_stages, kind.pipes[0]
    hops = sum(owner[s] != owner[s + 1] for s in range(S - 1))
    units, comm, scale, _ = solver_times(costs, S, m, hops)
    freed, cap_units, _ = solver_memory(costs, S, cap)
    timeline = simulate(schedule, Costs(f=units[0], b=units[1], w=units[2], comm=comm))
    codec, flow, model = Codec(S, m), Dataflow(kind, m), cp_model.CpModel()
    reach = max(1, round(window * scale))
    dur = {c: units[c & KIND_MASK][(c >> KIND_BITS) % S] for ops in schedule.codes for c in ops}
    rank = {c: r for r, ops in enumerate(schedule.codes) for c in ops}
    now, start = {}, {}
    for ops, starts in zip(schedule.codes, timeline.starts, strict=True):
        first = round(starts[0])
        for c, t in zip(ops, starts, strict=True):
            now[c] = round(t)  # a rank's first op stays: its span is measured from it
            low, high = (
                (first, first) if c == ops[0] else (max(first, now[c] - reach), now[c] + reach)
            )
            start[c] = model.NewIntVar(low, high, "")
    end = {c: start[c] + dur[c] for c in start}
    for c in start:
        key = flow.awaits(c)
        if key is not None:
            read = codec.action(F_CODE if key[0] == ACTIVATION else B_CODE, key[1], key[2])
            model.Add(start[c] >= end[read] + (comm if rank[read] != rank[c] else 0))
    goal = model.NewIntVar(0, max(now.values()) + max(dur.values()) + reach, "goal")
    for ops in schedule.codes:
        model.AddNoOverlap([model.NewFixedSizeIntervalVar(start[c], dur[c], "") for c in ops])
        held, sizes = [], []  # each F's activation: the share its B frees, then its W's
        for c in (c for c in ops if c & KIND_MASK == F_CODE):
            for freer, by in zip((c + 1, c + 2), freed, strict=True):
                length = model.NewIntVar(0, 2 * reach + now[freer] - now[c] + dur[freer], "")
                held.append(model.NewIntervalVar(start[c], length, end[freer], ""))
                sizes.append(by[(c >> KIND_BITS) % S])
        model.AddCumulative(held, sizes, cap_units)
        origin = now[ops[0]] if objective == "span" else 0
        for c in ops:
            model.Add(goal >= end[c] - origin)
    model.Minimize(goal)
    for c, t in now.items():
        model.AddHint(start[c], t)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1  # with a deterministic budget: the same on every machine
    solver.parameters.random_seed = seed
    solver.parameters.max_deterministic_time = effort
    if solver.Solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    at = {c: solver.Value(start[c]) for c in start}
    codes = tuple(tuple(sorted(ops, key=lambda c: (at[c], now[c]))) for ops in schedule.codes)
    return None if codes == schedule.codes else Schedule(schedule.name, kind, m, codes)


def polish(
    schedule: Schedule,
    costs: Costs,
    memory_cap: float,
    objective: str = "span",
    window: float | None = None,
    effort: float = 60.0,
    rounds: int = 4,
    seed: int = 0,
) -> Schedule:
    """``schedule`` with its ops re-ordered by CP-SAT, never worse, still under ``memory_cap``.

    ``objective``: "span" (the longest from a rank's first op to its last, then the step) or
    "makespan" (the step, then the longest span). ``window``: how far, in cost units, an op may
    move from its current start in one round (default ``WINDOW_OPS`` times the longest op).
    ``effort``: the solver's deterministic time per round (its own machine-independent unit,
    about a second here), on one worker with ``seed``, so the same call gives the same schedule
    on every machine with the same OR-Tools. Up to ``rounds`` rounds, each centred on the last,
    while each shortens the objective. Split F, B and W only (no overlapped pairs, no
    expert-parallel time, one pipe); OR-Tools is an optional dependency (``cutpipe[exact]``).
    """
    _check(schedule, costs, memory_cap, objective)
    check_count(rounds, "polish: rounds", least=0)
    check_count(seed, "polish: seed", least=0)
    if not (isinstance(effort, (int, float)) and math.isfinite(effort) and effort > 0):
        raise ValueError(
            f"polish: effort must be a positive number of solver seconds, got {effort!r}"
        )
    S = schedule.placement.num_stages
    longest = max(max(costs.per_stage(name, S)) for name in ("f", "b", "w"))
    window = WINDOW_OPS * longest if window is None else window
    if not (isinstance(window, (int, float)) and math.isfinite(window) and window > 0):
        raise ValueError(f"polish: window must be a positive time in cost units, got {window!r}")
    try:
        from ortools.sat.python import cp_model  # noqa: F401
    except ImportError as error:
        raise ImportError(
            'polishing needs OR-Tools: pip install "cutpipe[exact]"', name="ortools"
        ) from error
    measure = OBJECTIVES[objective]
    other = OBJECTIVES["makespan" if objective == "span" else "span"]

    def score(candidate: Schedule) -> tuple[float, float]:
        result = metrics(simulate(candidate, costs), costs)
        return (measure(result), other(result))

    def fits(candidate: Schedule) -> bool:
        return caps.within(max(peak_activations(candidate, costs)), memory_cap)

    current = plain_passes(schedule)  # what the solver models: a fused BW as B then W, a pair
    current_score = score(current)
    for _ in range(rounds):
        found = _solve(current, costs, memory_cap, objective, window, effort, seed)
        if found is None or not fits(found) or (found_score := score(found)) >= current_score:
            break
        current, current_score = found, found_score
    better = current_score < score(schedule) and fits(current)
    return current if better else schedule
