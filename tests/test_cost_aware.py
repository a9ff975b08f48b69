"""Cost-aware zero-bubble schedules (cutpipe.plan.search.tune and its passes)."""

from __future__ import annotations

import pytest
from conftest import capped_problems
from hypothesis import given, settings
from hypothesis import strategies as st

from cutpipe.plan.search.bounds import bubble_lower_bound, v_bubble_lower_bound
from cutpipe.plan.search.caps import default_cap
from cutpipe.plan.search.expedite import expedite
from cutpipe.plan.search.frontier import span_first
from cutpipe.plan.search.tune import FIXED, cost_aware
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.registry import schedule_info
from cutpipe.schedule.validate import validate
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

#: The zero-bubble paper's profiled costs (microseconds).
ZB_LINEAR = Costs(f=18522, b=18086, w=9337, comm=601)
ZB_V = Costs(f=14407, b=14380, w=9676, comm=1610)


def result(schedule, costs):
    return metrics(simulate(schedule, costs), costs)


def fixed_orders_within(placement, R, m, costs, cap):
    for name in FIXED[placement]:
        info = schedule_info(name)
        if info.accepts(R, m):
            schedule = info.generate(R, m)
            if max(peak_activations(schedule, costs)) <= cap + 1e-9:
                yield name, schedule


@settings(max_examples=25)
@given(
    placement=st.sampled_from(("linear", "v")),
    ranks=st.integers(2, 5),
    extra=st.integers(0, 8),
    f=st.integers(2, 12),
    b=st.integers(2, 12),
    w=st.integers(1, 12),
    comm=st.integers(0, 3),
    headroom=st.floats(1.0, 2.0),
)
def test_never_slower_than_a_fixed_order_that_fits(
    placement, ranks, extra, f, b, w, comm, headroom
):
    costs = Costs(f=f, b=b, w=w, comm=comm)
    m = 2 * ranks - 1 + extra
    cap = default_cap(placement, ranks, costs) * headroom
    tuned = cost_aware(
        placement, ranks, m, costs, memory_cap=cap, search_seconds=5, search_evaluations=20
    )
    validate(tuned)
    assert max(peak_activations(tuned, costs)) <= cap + 1e-9
    ours = result(tuned, costs).makespan
    for name, fixed in fixed_orders_within(placement, ranks, m, costs, cap):
        assert ours <= result(fixed, costs).makespan + 1e-9, name


def test_fills_the_room_between_zb_h1_and_zb_h2_memory():
    """ZB-H1 needs R activations, ZB-H2 about 2R; with 1.5R the fixed orders are stuck at
    ZB-H1 while the cost-aware one uses the extra memory."""
    cap = 12  # R = 8
    tuned = cost_aware("linear", 8, 24, ZB_LINEAR, memory_cap=cap, search_seconds=0)
    zbh1 = result(schedule_info("zbh1").generate(8, 24), ZB_LINEAR)
    ours = result(tuned, ZB_LINEAR)
    assert max(ours.peak_activations_per_rank) <= cap
    assert ours.bubble_ratio < 0.8 * zbh1.bubble_ratio  # 0.120 vs 0.159


def test_v_shape_at_the_zero_bubble_papers_setting():
    """R = 16, m = 48, memory capped at R x M_B: the fixed ZB-V has a span bubble of 0.0712; the
    cost-aware one reaches the lower bound of any V schedule in this cost model, 0.069724, the
    paper's 0.0697 to the four places it reports (docs/plan.md gives the argument)."""
    tuned = cost_aware("v", 16, 48, ZB_V, objective=span_first, search_seconds=0)
    ours = result(tuned, ZB_V)
    fixed = result(schedule_info("zbv").generate(16, 48), ZB_V)
    assert max(ours.peak_activations_per_rank) <= 32
    assert fixed.bubble_ratio_span == pytest.approx(0.0712, abs=5e-4)
    assert ours.bubble_ratio_span == pytest.approx(
        v_bubble_lower_bound(16, 48, ZB_V, 32), abs=1e-12
    )
    assert round(ours.bubble_ratio_span, 4) == 0.0697


def test_unequal_costs_beat_the_fixed_v_by_the_step():
    costs = Costs(f=3, b=4, w=1, comm=0.5)
    tuned = cost_aware("v", 4, 16, costs, search_seconds=0)
    assert (
        result(tuned, costs).makespan < result(schedule_info("zbv").generate(4, 16), costs).makespan
    )


def test_a_cap_below_one_activation_per_stage_is_refused():
    with pytest.raises(ValueError, match=r"below the smallest possible peak.*\(2 here, 0.5 more\)"):
        cost_aware("v", 4, 8, Costs(), memory_cap=1.5)
    with pytest.raises(ValueError, match="'linear' or 'v'"):
        cost_aware("bidirectional", 4, 8, Costs())


def test_per_stage_costs_as_the_planner_gives_them_are_searched_under_their_cap():
    """Per-stage lists (the planner's and a profile's form) used to fail on the smallest-peak
    check, which asked the costs for a one-rank placement's stage count."""
    from cutpipe.plan.search.caps import smallest_cap
    from cutpipe.schedule import Placement

    costs = Costs(f=[1] * 8, b=[1] * 8, w=[0.5] * 8, activation=[1, 1, 1, 1, 2, 2, 2, 2])
    assert smallest_cap(Placement.vshape(4), costs) == 3  # every rank: a 1 and a 2
    tuned = cost_aware("v", 4, 8, costs, memory_cap=8, search_seconds=0.1)
    validate(tuned)
    assert max(metrics(simulate(tuned, costs), costs).peak_activations_per_rank) <= 8
    with pytest.raises(ValueError, match=r"\(3 here, 0.5 more\)"):
        cost_aware("v", 4, 8, costs, memory_cap=2.5)


@settings(max_examples=20, deadline=None)
@given(capped_problems(max_extra=6))
def test_expediting_the_critical_path_never_slows_a_step_or_breaks_its_cap(problem):
    placement, ranks, m, costs, factor = problem
    cap = default_cap(placement, ranks, costs) * factor
    base = cost_aware(placement, ranks, m, costs, cap, span_first, search_evaluations=0)
    done = expedite(base, costs, cap, span_first, 40)
    validate(done)
    assert max(peak_activations(done, costs)) <= cap + 1e-9
    assert span_first(result(done, costs)) <= span_first(result(base, costs))


def test_expediting_the_zero_bubble_papers_linear_schedule_at_one_and_a_half_times():
    """R = 16, m = 48 (two-chunk stages): the chain of the last microbatches waits at ranks the
    local search never reaches, mostly behind a W that started just before its input arrived;
    moving those ops earlier and those W passes later reaches the warm-up bound (0.0632: rank 0
    idles only while its first gradient is on its way). Moving ops earlier alone gave 0.0669."""
    costs = Costs(f=2 * 14407, b=2 * 14380, w=2 * 9676, comm=1610)
    cap = 1.5 * default_cap("linear", 16, costs)
    tuned = cost_aware("linear", 16, 48, costs, cap, span_first)
    bound = bubble_lower_bound(Placement.linear(16), 48, costs, cap)
    assert round(bound, 4) == 0.0632
    assert result(tuned, costs).bubble_ratio_span == pytest.approx(bound, rel=1e-12)
