"""The closed forms: the simulator equals each exactly inside its stated conditions (checked with
==, on costs that add up exactly in binary), and reproduces the published figures of
docs/formulas.md to 4 decimals."""

import pytest
from conftest import dyadic
from hypothesis import given
from hypothesis import strategies as st

from cutpipe import formulas
from cutpipe.schedule import generate
from cutpipe.schedule.registry import SCHEDULES
from cutpipe.sim import Costs, metrics, simulate


def simulated(name, ranks, m, costs):
    return metrics(simulate(generate(name, ranks, m), costs), costs)


@st.composite
def exact_cases(draw):
    """A (schedule, ranks, microbatches, costs) inside the closed form's stated conditions."""
    name = draw(st.sampled_from(list(formulas.CLOSED_FORMS)))
    info = SCHEDULES[name]
    ranks = draw(st.integers(1, 10).filter(lambda r: not (info.even_ranks and r % 2)))
    m = draw(
        st.integers(info.min_microbatches(ranks), info.min_microbatches(ranks) + 3 * ranks + 4)
    )
    if name in ("zbv", "dualpipe", "dualpipev"):
        x = draw(dyadic)
        f = b = w = x
    else:
        f, b, w = draw(dyadic), draw(dyadic), draw(dyadic)
    fb = draw(st.integers(0, 4).map(lambda k: 2 * f + k * f / 4))  # B+W .. F+B+W
    return name, ranks, m, Costs(f=f, b=b, w=w, fb=fb)


@given(exact_cases())
def test_simulation_equals_the_closed_form_inside_its_conditions(case):
    name, ranks, m, costs = case
    form = formulas.CLOSED_FORMS[name]
    stages = generate(name, ranks, m).num_stages
    value, exact = formulas.predicted_bubble(name, ranks, stages, m, costs)
    if not exact:
        return  # e.g. an odd DualPipe count or m below the form's minimum
    assert formulas.simulated_bubble(simulated(name, ranks, m, costs), form.measure) == value


@given(st.integers(1, 12), st.integers(1, 40), dyadic, dyadic, dyadic)
def test_1f1b_every_rank_idles_r_minus_1_full_stages(ranks, m, f, b, w):
    result = simulated("1f1b", ranks, m, Costs(f=f, b=b, w=w))
    assert set(result.idle_per_rank) == {formulas.bubble_1f1b(ranks, f, b, w)}


def test_forms_are_not_exact_outside_their_conditions():
    # ZB-H1 below m = R: the general form overstates the bubble
    assert simulated("zbh1", 4, 2, Costs()).idle_per_rank[0] != formulas.bubble_zbh1(4, 1, 1, 1)
    # DualPipe with an F&B pair slower than F and B back to back idles more than the form says
    slow = Costs(fb=4.0)
    assert max(simulated("dualpipe", 8, 20, slow).idle_per_rank) > formulas.bubble_dualpipe(
        8, 1, 1, 1, 4
    )
    assert not formulas.predicted_bubble("dualpipe", 8, 8, 20, slow)[1]


UNIT_RATIOS = [  # docs/formulas.md: R, m, 1F1B, ZB-H1, ZB-H2 (span), ZB-V (span)
    (4, 8, 0.2727, 0.1111, 0, 0),
    (4, 12, 0.2000, 0.0769, 0, 0),
    (8, 24, 0.2258, 0.0886, 0, 0),
    (16, 48, 0.2381, 0.0943, 0, 0),
]


@pytest.mark.parametrize(("ranks", "m", "one", "h1", "h2", "v"), UNIT_RATIOS)
def test_unit_cost_bubble_ratios(ranks, m, one, h1, h2, v):
    costs = Costs()
    assert round(simulated("1f1b", ranks, m, costs).bubble_ratio, 4) == one
    assert round(simulated("zbh1", ranks, m, costs).bubble_ratio, 4) == h1
    assert round(simulated("zbh2", ranks, m, costs).bubble_ratio_span, 4) == h2
    assert round(simulated("zbv", ranks, m, costs.scaled(0.5)).bubble_ratio_span, 4) == v
    assert simulated("1f1b", ranks, m, costs).bubble_ratio == pytest.approx(
        formulas.bubble_ratio_1f1b(ranks, m)
    )
    assert simulated("zbh1", ranks, m, costs).bubble_ratio == pytest.approx(
        formulas.bubble_ratio_zbh1(ranks, m)
    )


PAPER = [  # zero-bubble paper, microseconds: R, m, F, B, W, comm, 1F1B, ZB-H1, ZB-H2 (span)
    (8, 24, 18522, 18086, 9337, 601, 0.2431, 0.1585, 0.1083),
    (16, 64, 11307, 11254, 8101, 379, 0.2082, 0.1088, 0.0516),
]


@pytest.mark.parametrize(("ranks", "m", "f", "b", "w", "comm", "one", "h1", "h2"), PAPER)
def test_zero_bubble_paper_figures_with_communication(ranks, m, f, b, w, comm, one, h1, h2):
    costs = Costs(f=f, b=b, w=w, comm=comm)
    assert round(simulated("1f1b", ranks, m, costs).bubble_ratio, 4) == one
    assert round(simulated("zbh1", ranks, m, costs).bubble_ratio, 4) == h1
    assert round(simulated("zbh2", ranks, m, costs).bubble_ratio_span, 4) == h2


@pytest.mark.parametrize(("fb", "makespan"), [(3, 66), (2, 52)])
def test_dualpipe_and_its_cut_in_half_take_the_same_time(fb, makespan):
    costs = Costs(f=1, b=1, w=1, fb=fb)
    dual = simulated("dualpipe", 8, 20, costs)
    cut = simulated("dualpipev", 4, 10, costs)
    assert dual.makespan == cut.makespan == makespan
    if fb == 3:
        assert set(dual.busy_per_rank) == {60}  # 60 work + 6 idle
        assert max(dual.idle_per_rank) == 6 == formulas.bubble_dualpipe(8, 1, 1, 1, 3)


def test_dualpipev_max_idle_on_8_ranks():
    result = simulated("dualpipev", 8, 20, Costs(fb=3))
    assert max(result.idle_per_rank) == 14 == formulas.bubble_dualpipe(16, 1, 1, 1, 3)
