"""The V lower bound (cutpipe.plan.search.bounds) and the cool-down settling that reaches it."""

from __future__ import annotations

import json
from collections import Counter
from contextlib import suppress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cutpipe.cli.main import main
from cutpipe.plan.search.bounds import v_bubble_lower_bound, v_span_lower_bound
from cutpipe.plan.search.cooldown import critical_path_tail, settle_cooldown
from cutpipe.plan.search.tune import cost_aware
from cutpipe.schedule.registry import schedule_info
from cutpipe.schedule.validate import validate
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

ZB_V = Costs(f=14407, b=14380, w=9676, comm=1610)


def span_score(result):
    return (result.bubble_ratio_span, result.makespan)


def longest_span(schedule, costs):
    return max(metrics(simulate(schedule, costs), costs).span_per_rank)


def test_the_bound_at_the_zero_bubble_papers_setting():
    """R = 16, m = 48, cap R x M_B: the tip starts after 15 (F + comm), idles 47,895 us waiting
    for its first gradient, needs 63 more F and 64 B + W before its last forward, and that
    microbatch's trip up and down the V takes 772,798 us more."""
    span = v_span_lower_bound(16, 48, ZB_V, 32)
    assert span == 240_255 + 47_895 + 95 * 14407 + 64 * (14380 + 9676) + 772_798
    assert span == 3_969_197
    assert v_bubble_lower_bound(16, 48, ZB_V, 32) == pytest.approx(0.069724, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    ranks=st.integers(1, 4),
    m=st.integers(1, 10),
    f=st.integers(1, 9),
    b=st.integers(1, 9),
    w=st.integers(1, 9),
    comm=st.integers(0, 3),
    kept=st.sampled_from((0.0, 0.25, 0.5, 0.75, 1.0)),
    extra=st.integers(0, 8),
)
def test_no_v_schedule_beats_the_bound(ranks, m, f, b, w, comm, kept, extra):
    costs = Costs(f=f, b=b, w=w, comm=comm, w_memory=kept)
    cap = 2 + extra * ranks / 2
    bound = v_span_lower_bound(ranks, m, costs, cap)
    schedules = [
        schedule_info(name).generate(ranks, m)
        for name in ("zbv", "dualpipev")
        if schedule_info(name).accepts(ranks, m)
    ]
    with suppress(ValueError):  # the cap can starve every greedy order while no fixed one fits
        schedules.append(cost_aware("v", ranks, m, costs, memory_cap=cap, search_seconds=0))
    for schedule in schedules:
        if max(peak_activations(schedule, costs)) <= cap + 1e-9:
            assert longest_span(schedule, costs) >= bound - 1e-9, schedule.name


def test_the_bound_refuses_costs_it_does_not_cover():
    with pytest.raises(ValueError, match="one f for every stage"):
        v_span_lower_bound(2, 4, Costs(f=[1, 2, 1, 1]), 4)
    with pytest.raises(ValueError, match="expert-parallel"):
        v_span_lower_bound(2, 4, Costs(ep_f=1.0), 4)
    with pytest.raises(ValueError, match="F&B pair takes F \\+ B"):
        v_span_lower_bound(2, 4, Costs(fb=1.5), 4)


def test_settling_the_cool_down_takes_zbv_to_the_bound():
    zbv = schedule_info("zbv").generate(16, 48)
    settled = settle_cooldown(zbv, ZB_V, span_score)
    validate(settled)
    assert max(peak_activations(settled, ZB_V)) <= 32
    assert longest_span(zbv, ZB_V) == 3_975_626  # the fixed order: 0.0712
    assert longest_span(settled, ZB_V) == v_span_lower_bound(16, 48, ZB_V, 32)


def test_the_tail_keeps_each_ranks_order_up_to_its_last_forward():
    zbv = schedule_info("zbv").generate(6, 14)
    costs = Costs(f=3, b=4, w=2, comm=1)
    tail = critical_path_tail(zbv, costs)
    validate(tail)
    for before, after in zip(zbv.codes, tail.codes, strict=True):
        cut = max(i for i, code in enumerate(before) if code & 3 == 0) + 1
        assert after[:cut] == before[:cut]
        assert Counter(after) == Counter(before)
    assert peak_activations(tail, costs) == peak_activations(zbv, costs)


def test_overlapped_pairs_are_left_alone():
    dualpipev = schedule_info("dualpipev").generate(4, 10)
    assert critical_path_tail(dualpipev, Costs()) is dualpipev


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(("zbv", "zbh1", "zbh2", "1f1b")),
    ranks=st.integers(2, 5),
    extra=st.integers(0, 6),
    f=st.integers(1, 9),
    b=st.integers(1, 9),
    w=st.integers(1, 9),
    comm=st.integers(0, 3),
)
def test_settling_never_hurts_and_keeps_the_peak(name, ranks, extra, f, b, w, comm):
    costs = Costs(f=f, b=b, w=w, comm=comm)
    schedule = schedule_info(name).generate(ranks, 2 * ranks - 1 + extra)
    settled = settle_cooldown(schedule, costs, span_score)
    validate(settled)
    before = metrics(simulate(schedule, costs), costs)
    after = metrics(simulate(settled, costs), costs)
    assert span_score(after) <= span_score(before)
    assert max(after.peak_activations_per_rank) <= max(before.peak_activations_per_rank) + 1e-9


def test_tune_reports_the_bound_beside_the_schedules(capsys):
    args = ["tune", "--placement", "v", "--ranks", "16", "--microbatches", "48", "--costs",
            "F=14407,B=14380,W=9676,comm=1610", "--objective", "span", "--seconds", "0"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    floor = report["lower_bound"]["bubble_ratio_span"]
    assert floor == pytest.approx(0.069724, abs=1e-6)
    assert report["cost-aware-v"]["bubble_ratio_span"] == pytest.approx(floor, abs=1e-12)
    assert report["zbv"]["bubble_ratio_span"] > floor + 1e-3
    assert main(args) == 0
    assert "No V schedule has a span bubble below 0.069724" in capsys.readouterr().out
