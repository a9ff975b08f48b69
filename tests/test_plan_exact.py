"""The exact CP-SAT schedules: equal to brute force on tiny pipelines, never worse than the fixed
orders or the cost-aware search, their bounds below their values and their peaks under the cap."""

from __future__ import annotations

import math
import sys
from functools import cache
from itertools import product

import pytest

pytest.importorskip("ortools")

from cutpipe.plan.search.caps import default_cap, within
from cutpipe.plan.search.exact import exact_schedule
from cutpipe.plan.search.tune import cost_aware
from cutpipe.schedule.codes import B_CODE, F_CODE, W_CODE, Codec
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.registry import schedule_info
from cutpipe.schedule.schedule import Schedule
from cutpipe.schedule.validate import ScheduleError
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

LIMIT = 10.0  # seconds per solve: every instance here is proved optimal far sooner
UNIT = Costs(f=1, b=1, w=1)
UNEVEN = Costs(f=2, b=3, w=1, comm=0.5)


def objective(schedule: Schedule, costs: Costs, name: str) -> float:
    timeline = simulate(schedule, costs)
    if name == "makespan":
        return timeline.makespan
    return max(timeline.span(r) for r in range(schedule.num_ranks))


def orders(ops: list[int], first: dict[int, int]) -> list[tuple[int, ...]]:
    """Every order of one rank's ops that runs each op after the same-rank op it needs."""
    if not ops:
        return [()]
    found = []
    for op in ops:
        if first.get(op) not in ops:
            rest = [o for o in ops if o != op]
            found += [(op, *tail) for tail in orders(rest, first)]
    return found


@cache
def brute_force(kind: str, ranks: int, m: int, costs: Costs) -> list[tuple[float, float, float]]:
    """(makespan, span, peak) of every schedule that runs, split backwards only."""
    placement = Placement.linear(ranks) if kind == "linear" else Placement.vshape(ranks)
    S, owner, codec = placement.num_stages, placement.pipes[0], Codec(placement.num_stages, m)
    first = {}  # an op's input made on its own rank
    for j, s in product(range(m), range(S)):
        f, b, w = (codec.action(k, s, j) for k in (F_CODE, B_CODE, W_CODE))
        first[w], first[b] = b, f
        if s and owner[s - 1] == owner[s]:
            first[f] = codec.action(F_CODE, s - 1, j)
        if s < S - 1 and owner[s + 1] == owner[s]:
            first[b] = codec.action(B_CODE, s + 1, j)
    per_rank = [
        orders([codec.action(k, s, j) for s in placement.stages_of(r) for j in range(m)
                for k in (F_CODE, B_CODE, W_CODE)], first)
        for r in range(ranks)
    ]  # fmt: skip
    results = []
    for codes in product(*per_rank):
        schedule = Schedule("brute", placement, m, codes)
        try:
            spans = (objective(schedule, costs, "makespan"), objective(schedule, costs, "span"))
        except ScheduleError:  # the ranks wait on each other
            continue
        results.append((*spans, max(peak_activations(schedule, costs))))
    return results


@pytest.mark.parametrize("name", ["makespan", "span"])
@pytest.mark.parametrize(
    ("kind", "ranks", "m", "costs", "cap"),
    [
        ("linear", 2, 2, UNIT, 4.0),
        ("linear", 2, 2, UNIT, 1.0),
        ("linear", 2, 2, UNEVEN, 1.5),
        ("linear", 3, 2, UNEVEN, 2.0),
        ("linear", 3, 2, UNEVEN, 1.0),
        ("v", 1, 2, UNEVEN, 2.0),
        ("v", 1, 2, UNEVEN, 3.0),
        ("v", 2, 1, UNEVEN, 2.0),
    ],
)
def test_equals_brute_force(kind, ranks, m, costs, cap, name):
    best = min(
        result[name == "span"] for result in brute_force(kind, ranks, m, costs)
        if within(result[2], cap)
    )  # fmt: skip
    found = exact_schedule(kind, ranks, m, costs, cap, name, time_limit=LIMIT)
    assert found.optimal
    assert found.value == pytest.approx(best)
    assert found.bound <= found.value
    assert found.value == pytest.approx(objective(found.schedule, costs, name))
    assert within(max(peak_activations(found.schedule, costs)), cap)


def fixed_orders(kind: str, ranks: int, m: int) -> list[Schedule]:
    names = ("1f1b", "zbh1", "zbh2") if kind == "linear" else ("zbv",)
    infos = [schedule_info(name) for name in names]
    return [info.generate(ranks, m) for info in infos if info.accepts(ranks, m)]


@pytest.mark.parametrize("name", ["makespan", "span"])
@pytest.mark.parametrize(
    ("kind", "ranks", "m", "costs", "times"),
    [
        ("linear", 3, 4, UNIT, 1.0),
        ("linear", 3, 4, Costs(f=3, b=3, w=2, comm=0.5), 1.5),
        ("linear", 2, 4, Costs(f=1, b=2, w=1, activation=[1.0, 2.0], w_memory=0.25), 1.0),
        ("v", 2, 4, Costs(f=0.5, b=0.5, w=0.5, activation=0.5), 1.0),
    ],
)
def test_no_worse_than_fixed_orders_and_the_search(kind, ranks, m, costs, times, name):
    cap = times * default_cap(kind, ranks, costs)
    found = exact_schedule(kind, ranks, m, costs, cap, name, time_limit=LIMIT)
    assert found.optimal and found.bound <= found.value
    assert within(max(peak_activations(found.schedule, costs)), cap)
    result = metrics(simulate(found.schedule, costs), costs)
    assert found.value == (result.makespan if name == "makespan" else max(result.span_per_rank))
    rivals = [
        s for s in fixed_orders(kind, ranks, m) if within(max(peak_activations(s, costs)), cap)
    ]
    assert rivals or kind == "v"
    score = {"makespan": lambda r: r.makespan, "span": lambda r: max(r.span_per_rank)}[name]
    rivals.append(cost_aware(kind, ranks, m, costs, cap, score, search_seconds=0))
    for rival in rivals:
        assert found.value <= objective(rival, costs, name) + 1e-9, rival.name


def test_costs_that_do_not_scale_exactly():
    """Rounded times and memory: still under the cap, the bound still below the value."""
    costs = Costs(f=math.pi, b=math.e, w=math.sqrt(2), comm=0.1 * math.pi, w_memory=1 / math.pi)
    cap = default_cap("linear", 2, costs)
    found = exact_schedule("linear", 2, 3, costs, cap, "makespan", time_limit=LIMIT)
    assert found.bound <= found.value
    assert found.value >= found.bound > 0.999 * found.value  # the rounding costs little
    assert not found.optimal  # a rounded model proves nothing exactly
    assert within(max(peak_activations(found.schedule, costs)), cap)
    greedy = cost_aware("linear", 2, 3, costs, cap, search_seconds=0)
    assert found.value <= objective(greedy, costs, "makespan") + 1e-9


def test_same_call_same_schedule():
    calls = [
        exact_schedule("linear", 3, 4, UNEVEN, None, "span", time_limit=LIMIT) for _ in range(2)
    ]
    assert calls[0].schedule.codes == calls[1].schedule.codes
    assert calls[0].schedule.name == "exact"


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("linear", 4, 64, UNIT), ValueError, "max_ops=600: use fewer microbatches"),
        (("linear", 2, 2, UNIT, 0.5), ValueError, "below the smallest possible peak 1"),
        (("ring", 2, 2, UNIT), ValueError, "'linear' or 'v'"),
        (("linear", 2, 2, UNIT, None, "bubble"), ValueError, "'makespan' or 'span'"),
        (("linear", 2, 2, Costs(ep_f=0.5)), ValueError, "ep_f, ep_b to 0"),
        (("linear", 2, 2, Costs(fb=1.5)), ValueError, "fb to None"),
        (("linear", 0, 2, UNIT), ValueError, "ranks must be >= 1"),
        (("linear", 2, 2, "F=1"), TypeError, "costs must be a Costs"),
    ],
)
def test_errors_say_what_to_change(args, error, match):
    with pytest.raises(error, match=match):
        exact_schedule(*args)


def test_without_ortools_says_what_to_install(monkeypatch, capsys):
    from cutpipe.cli.main import USAGE_ERROR, main

    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    with pytest.raises(ImportError, match=r'pip install "cutpipe\[exact\]"'):
        exact_schedule("linear", 2, 2, UNIT)
    assert main(["tune", "--placement", "linear", "-r", "2", "-m", "2", "--exact"]) == USAGE_ERROR
    assert 'pip install "cutpipe[exact]"' in capsys.readouterr().err


def _grid() -> list[tuple]:
    """Small shapes with uneven integer costs, every cap and objective the search is for."""
    shapes = [("linear", 2, 4, Costs(f=3, b=5, w=2, comm=1)),
              ("linear", 3, 4, Costs(f=3, b=8, w=3, comm=1)),
              ("linear", 3, 5, Costs(f=2, b=4, w=3, comm=0.5)),
              ("v", 2, 3, Costs(f=4, b=6, w=3, comm=0.5))]  # fmt: skip
    return [(*shape, factor, name) for shape in shapes for factor in (1.0, 1.5)
            for name in ("makespan", "span")]  # fmt: skip


@pytest.mark.parametrize(("placement", "ranks", "m", "costs", "factor", "name"), _grid())
def test_the_search_is_within_one_percent_of_the_optimum(placement, ranks, m, costs, factor, name):
    """benchmarks/exact_gap.py runs forty random instances (docs/plan.md gives the figure)."""
    cap = factor * default_cap(placement, ranks, costs)
    exact = exact_schedule(placement, ranks, m, costs, cap, name, time_limit=LIMIT)
    assert exact.optimal
    first = (lambda r: (r.makespan,)) if name == "makespan" else (lambda r: (max(r.span_per_rank),))
    tuned = cost_aware(placement, ranks, m, costs, cap, first)
    assert objective(tuned, costs, name) <= exact.value * 1.01


def test_tune_exact_prints_the_optimum_beside_the_search(capsys):
    from cutpipe.cli.main import main

    args = ["tune", "--placement", "linear", "-r", "3", "-m", "4", "--costs", "F=3,B=8,W=3,comm=1",
            "--memory-cap-x", "1.5", "--objective", "span", "--exact"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "exact (optimal)" in out and "cost-aware" in out
