"""CP-SAT polishing (plan.polish): never worse, under the cap, the same on every call, and
shorter than the local search where ops on several ranks must move together."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("ortools")

from cutpipe.plan.search.caps import default_cap, within
from cutpipe.plan.search.frontier import frontier, span_first
from cutpipe.plan.search.polish import polish
from cutpipe.plan.search.tune import cost_aware
from cutpipe.schedule.registry import generate
from cutpipe.schedule.validate import validate
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

SMALL = Costs(f=3, b=4, w=2, comm=1)
EFFORT = 5.0  # solver seconds per round: each instance here takes well under one


def span_bubble(schedule, costs: Costs) -> float:
    return metrics(simulate(schedule, costs), costs).bubble_ratio_span


def test_polish_shortens_what_the_search_left_stays_under_the_cap_and_repeats():
    """V, R = 4, m = 8 at 1.5x 1F1B's peak: the search stops at 0.0588, the solver, moving ops
    on every rank at once, takes it to 0.0336; the same call gives the same schedule."""
    cap = 1.5 * default_cap("v", 4, SMALL)
    searched = cost_aware("v", 4, 8, SMALL, cap, span_first)
    polished = polish(searched, SMALL, cap, effort=EFFORT)
    validate(polished)
    assert within(max(peak_activations(polished, SMALL)), cap)
    assert round(span_bubble(searched, SMALL), 4) == 0.0588
    assert round(span_bubble(polished, SMALL), 4) == 0.0336
    again = polish(searched, SMALL, cap, effort=EFFORT)
    assert again.codes == polished.codes and polished.name == searched.name


@settings(max_examples=12, deadline=None)
@given(
    kind=st.sampled_from(["linear", "v"]),
    ranks=st.integers(2, 3),
    m=st.integers(2, 5),
    times=st.tuples(*(st.integers(1, 6) for _ in range(3))),
    comm=st.sampled_from([0, 0.5, 1]),
    factor=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
    objective=st.sampled_from(["span", "makespan"]),
)
def test_polish_is_never_worse_and_never_over_the_cap(kind, ranks, m, times, comm, factor,
                                                      objective):  # fmt: skip
    costs = Costs(f=times[0], b=times[1], w=times[2], comm=comm)
    cap = factor * default_cap(kind, ranks, costs)
    measure = {"span": lambda r: max(r.span_per_rank), "makespan": lambda r: r.makespan}[objective]
    start = cost_aware(kind, ranks, m, costs, cap, search_evaluations=0)
    polished = polish(start, costs, cap, objective, effort=1.0)
    validate(polished)
    assert within(max(peak_activations(polished, costs)), cap)
    before, after = (measure(metrics(simulate(s, costs), costs)) for s in (start, polished))
    assert after <= before + 1e-9


def test_a_fused_schedule_is_polished_as_split_passes():
    """1F1B runs fused BW passes: polish splits each into its B and W and may move the Ws."""
    costs = Costs(f=2, b=3, w=2, comm=0.5)
    fused = generate("1f1b", 4, 8)
    cap = 1.5 * default_cap("linear", 4, costs)
    polished = polish(fused, costs, cap, "makespan", effort=EFFORT)
    validate(polished)
    assert within(max(peak_activations(polished, costs)), cap)
    assert metrics(simulate(polished, costs), costs).makespan < simulate(fused, costs).makespan


def test_the_frontier_polished_is_monotone_and_no_worse_than_searched_alone():
    factors = (1.0, 1.25, 1.5)
    alone = frontier(4, 8, SMALL, factors, ("v",))
    polished = frontier(4, 8, SMALL, factors, ("v",), polish_effort=EFFORT)
    bubbles = [point.bubble for point in polished]
    assert bubbles == sorted(bubbles, reverse=True)
    assert all(p.bubble <= a.bubble + 1e-12 for p, a in zip(polished, alone, strict=True))
    assert polished[-1].bubble < alone[-1].bubble
    assert all(p.bound <= p.bubble + 1e-12 for p in polished)


def test_tune_polish_prints_the_polished_row(capsys):
    from cutpipe.cli.main import main

    args = ["tune", "-r", "4", "-m", "8", "--costs", "F=3,B=4,W=2,comm=1", "--memory-cap-x",
            "1.5", "--objective", "span", "--polish", "5", "--json"]  # fmt: skip
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    searched, polished = report["cost-aware-v"], report["cost-aware-v, polished"]
    assert polished["bubble_ratio_span"] < searched["bubble_ratio_span"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"objective": "bubble"}, ValueError, "'makespan' or 'span'"),
        ({"effort": 0}, ValueError, "effort must be a positive number"),
        ({"window": -1.0}, ValueError, "window must be a positive time"),
        ({"rounds": -1}, ValueError, "rounds must be >= 0"),
        ({"memory_cap": 1.0}, ValueError, "above the cap 1"),
        ({"costs": Costs(fb=1.5)}, ValueError, "fb to None"),
        ({"costs": "F=1"}, TypeError, "costs must be a Costs"),
        ({"schedule": "zbv"}, TypeError, "schedule must be a Schedule"),
    ],
)
def test_errors_say_what_to_change(kwargs, error, match):
    args = {"schedule": generate("zbv", 2, 4), "costs": SMALL, "memory_cap": 4.0} | kwargs
    with pytest.raises(error, match=match):
        polish(**args)


def test_without_ortools_says_what_to_install(monkeypatch, capsys):
    from cutpipe.cli.main import USAGE_ERROR, main

    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    with pytest.raises(ImportError, match=r'pip install "cutpipe\[exact\]"'):
        polish(generate("zbv", 2, 4), SMALL, 4.0)
    assert main(["tune", "-r", "2", "-m", "4", "--polish", "1"]) == USAGE_ERROR
    assert 'pip install "cutpipe[exact]"' in capsys.readouterr().err
