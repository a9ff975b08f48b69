"""The memory/bubble frontier: deterministic, monotone searches and the warm-up lower bound
(cutpipe.plan.search.frontier, cutpipe.plan.search.bounds, ``cutpipe tune --frontier``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import capped_problems
from hypothesis import given, settings

from cutpipe.cli.main import main
from cutpipe.plan.search.bounds import span_bubble, warmup_span_lower_bound
from cutpipe.plan.search.caps import default_cap
from cutpipe.plan.search.frontier import (
    FACTORS,
    frontier,
    marks,
    placement_costs,
    span_first,
    w_memory_sweep,
)
from cutpipe.plan.search.round_trips import round_trips
from cutpipe.plan.search.rounds import rounds_schedule
from cutpipe.plan.search.tune import FIXED, cost_aware
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.registry import generate, schedule_info
from cutpipe.schedule.validate import validate
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

#: The zero-bubble paper's V costs per chunk (microseconds); a linear stage is two chunks.
CHUNK = Costs(f=14407, b=14380, w=9676, comm=1610)


def bubble(schedule, costs) -> float:
    return metrics(simulate(schedule, costs), costs).bubble_ratio_span


def test_the_search_is_a_count_of_evaluations_so_the_same_call_gives_the_same_schedule():
    costs = Costs(f=3, b=3, w=2, comm=0.5)
    runs = [cost_aware("v", 4, 8, costs, search_evaluations=60, seed=1) for _ in range(2)]
    assert runs[0].codes == runs[1].codes
    other = cost_aware("v", 4, 8, costs, search_evaluations=60, seed=2)
    assert max(peak_activations(other, costs)) <= default_cap("v", 4, costs) + 1e-9


def test_a_start_schedule_that_fits_is_never_beaten_by_a_worse_result():
    costs = placement_costs(CHUNK, "linear")
    cap = 1.5 * default_cap("linear", 8, costs)
    start = cost_aware("linear", 8, 24, costs, cap, span_first, search_evaluations=0)
    again = cost_aware("linear", 8, 24, costs, 2 * cap, span_first, search_evaluations=0,
                       start=start)  # fmt: skip
    assert bubble(again, costs) <= bubble(start, costs)
    with pytest.raises(ValueError, match="start is a linear schedule of 8 ranks"):
        cost_aware("v", 8, 24, CHUNK, search_evaluations=0, start=start)


def test_the_frontier_is_monotone_beats_every_fixed_order_that_fits_and_respects_its_bound():
    R, m, costs = 4, 10, Costs(f=3, b=3, w=2, comm=0.4)
    points = frontier(R, m, costs, evaluations=20)
    assert len(points) == 2 * len(FACTORS)
    for placement in ("linear", "v"):
        line = [p for p in points if p.placement == placement]
        bubbles = [p.bubble for p in line]
        assert bubbles == sorted(bubbles, reverse=True), placement  # more memory, never worse
        stage_costs = placement_costs(costs, placement)
        base = default_cap(placement, R, stage_costs)
        for point in line:
            assert point.peak <= point.factor + 1e-9
            assert point.bound <= point.bubble + 1e-12
            for name in FIXED[placement]:
                fixed = generate(name, R, m)
                if max(peak_activations(fixed, stage_costs)) <= point.factor * base + 1e-9:
                    assert point.bubble <= bubble(fixed, stage_costs) + 1e-12, (point, name)
    names = {mark.name: mark for mark in marks(R, m, costs)}
    assert names["zbh1"].peak == 1.0 and names["zbv"].peak == 1.0
    assert 1.5 < names["zbh2"].peak <= 2.0


def test_the_zero_bubble_papers_linear_setting_at_one_and_a_half_times_1f1b_memory():
    """R = 16, m = 48: the warm-up bound is the paper's 0.0632; the search is within half a
    point of it (docs/plan.md, "The memory/bubble frontier")."""
    costs = placement_costs(CHUNK, "linear")
    cap = 1.5 * default_cap("linear", 16, costs)
    placement = Placement.linear(16)
    floor = span_bubble(warmup_span_lower_bound(placement, 48, costs, cap), placement, 48, costs)
    assert round(floor, 4) == 0.0632
    tuned = cost_aware("linear", 16, 48, costs, cap, span_first, search_evaluations=0)
    assert floor <= bubble(tuned, costs) <= floor + 0.005
    assert bubble(tuned, costs) < bubble(generate("zbh1", 16, 48), costs) - 0.08


def test_the_zero_bubble_papers_v_setting_at_one_and_a_half_times_1f1b_memory():
    """R = 16, m = 48 on the V: building it in rounds, W passes held for the cool-down, takes
    the span bubble to 0.0094 (0.0228 without; the paper's V scheduler reports 0.0065)."""
    (point,) = frontier(16, 48, CHUNK, factors=(1.5,), placements=("v",))
    assert point.bubble <= 0.0095


def test_less_memory_held_for_w_never_gives_a_worse_schedule_when_swept_down():
    """On the paper's V at 1.5x, searched alone, a B that keeps none of its activation for its W
    gives a worse span bubble (0.0017) than one that keeps a quarter (0); swept down from the
    larger share (``w_memory_sweep``), the smaller one starts from its schedule, which fits."""
    cap = 1.5 * default_cap("v", 16, CHUNK)
    alone = cost_aware("v", 16, 48, replace(CHUNK, w_memory=0.0), cap, span_first,
                       search_evaluations=0)  # fmt: skip
    swept = w_memory_sweep("v", 16, 48, CHUNK, cap, shares=(0.25, 0.0), evaluations=0)
    bubbles = [bubble(schedule, replace(CHUNK, w_memory=share)) for share, schedule in swept]
    assert bubbles[1] <= bubbles[0] == 0.0 < bubble(alone, replace(CHUNK, w_memory=0.0))
    with pytest.raises(ValueError, match="decreasing"):
        w_memory_sweep("v", 2, 4, CHUNK, cap, shares=(0.0, 0.5))


@settings(max_examples=15, deadline=None)
@given(capped_problems(max_ranks=4, max_extra=4))
def test_a_w_memory_sweep_is_monotone(problem):
    kind, ranks, m, costs, factor = problem
    cap = factor * default_cap(kind, ranks, costs)
    swept = w_memory_sweep(kind, ranks, m, costs, cap, evaluations=10)
    bubbles = [bubble(schedule, replace(costs, w_memory=share)) for share, schedule in swept]
    assert bubbles == sorted(bubbles, reverse=True)


@settings(max_examples=25, deadline=None)
@given(capped_problems(kinds=("v",)))
def test_a_v_built_in_rounds_is_valid_and_fits_its_cap(problem):
    _, ranks, m, costs, factor = problem
    cap = factor * default_cap("v", ranks, costs)
    built = rounds_schedule(Placement.vshape(ranks), m, costs, cap)
    if built is None:  # no rounds policy fits this cap: the search has other candidates
        return
    validate(built)
    assert max(peak_activations(built, costs)) <= cap * (1 + 1e-9)


def test_round_trips_follow_one_microbatch_to_the_loss_and_back():
    costs = Costs(f=2, b=3, w=1, comm=0.5)
    # linear, 3 ranks: F0 + comm + F1 + comm + F2, the last B, then B + comm per hop back
    assert round_trips(Placement.linear(3), costs) == [
        2 + 0.5 + 2 + 0.5 + 2 + 3 + 0.5 + 3 + 0.5,
        2 + 0.5 + 2 + 3 + 0.5,
        2,
    ]
    # a V on 2 ranks: rank 1 holds stages 1 and 2 (no hop between them); rank 0 holds 0 and 3
    trips = round_trips(Placement.vshape(2), costs)
    assert trips[1] == 2 + 2 + 0.5 + 2 + 3 + 0.5  # its F1, F2, then F3 on rank 0 and its B
    assert trips[0] == 2 + 0.5 + 2 + 2 + 0.5 + 2  # F0, F1, F2 on rank 1, F3 back home


@settings(max_examples=30, deadline=None)
@given(capped_problems(max_extra=6))
def test_no_schedule_beats_the_warm_up_bound(problem):
    kind, ranks, m, costs, factor = problem
    cap = factor * default_cap(kind, ranks, costs)
    placement = Placement.linear(ranks) if kind == "linear" else Placement.vshape(ranks)
    floor = warmup_span_lower_bound(placement, m, costs, cap)
    schedules = [cost_aware(kind, ranks, m, costs, cap, span_first, search_evaluations=0)]
    for name in (*FIXED[kind], "1f1b" if kind == "linear" else "dualpipev"):
        info = schedule_info(name)
        if info.accepts(ranks, m):
            fixed = info.generate(ranks, m)
            if max(peak_activations(fixed, costs)) <= cap + 1e-9:
                schedules.append(fixed)
    for schedule in schedules:
        assert max(metrics(simulate(schedule, costs), costs).span_per_rank) >= floor - 1e-9


def test_tune_frontier_prints_the_table_writes_json_and_draws(tmp_path, capsys):
    picture = tmp_path / "frontier.png"
    args = ["tune", "-r", "3", "-m", "6", "--costs", "F=2,B=2,W=1,comm=0.2", "--frontier",
            "--evaluations", "5"]  # fmt: skip
    assert main([*args, "-o", str(picture)]) == 0
    out = capsys.readouterr().out
    assert "span bubble against memory" in out and "zbh1" in out and "1.5x" in out
    assert picture.stat().st_size > 10_000
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["points"]) == 18
    assert {f["schedule"] for f in report["fixed"]} >= {"zbh1", "zbv"}


def test_tune_frontier_sweeps_one_placement_up_to_a_cap(capsys):
    """``--placement v --memory-cap-x 1.3``: the V alone, eighths below 1.3x, then 1.3x itself,
    the same figures as the whole sweep at the caps they share (each cap starts from the one
    below, and the sweeps share those)."""
    args = ["tune", "-r", "3", "-m", "6", "--costs", "F=2,B=2,W=1,comm=0.2", "--frontier",
            "--evaluations", "5", "--json"]  # fmt: skip
    assert main([*args, "--placement", "v", "--memory-cap-x", "1.3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(p["placement"], p["memory_x"]) for p in report["points"]] == [
        ("v", 1.0),
        ("v", 1.125),
        ("v", 1.25),
        ("v", 1.3),
    ]
    assert {f["placement"] for f in report["fixed"]} == {"v"}
    assert main(args) == 0
    whole = json.loads(capsys.readouterr().out)
    shared = [p for p in whole["points"] if p["placement"] == "v" and p["memory_x"] < 1.3]
    assert shared == report["points"][:3]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--frontier", "--memory-cap", "8"], "drop --memory-cap"),
        (["--frontier", "--memory-cap-x", "0.5"], "give 1 or more"),
        (["--frontier", "-o", "FILE.json"], "draws a picture"),
        (["-o", "FILE.png"], "for --frontier only"),
    ],
)
def test_tune_frontier_refuses_what_it_cannot_use(tmp_path, capsys, extra, message):
    extra = [e.replace("FILE", str(tmp_path / "out")) for e in extra]
    assert main(["tune", "-r", "2", "-m", "4", *extra]) != 0
    assert message in capsys.readouterr().err
