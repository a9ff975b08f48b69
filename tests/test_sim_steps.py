"""Several steps back to back: hand-computed timelines, the closed forms of the steady state
(sync: makespan + reduction + optimizer; overlap: the longest span + optimizer, and where and
why DualPipe falls below it), overlap never slower than sync, and errors that say what to do."""

import math

import pytest
from conftest import cost_models, dyadic, named_shapes
from hypothesis import given
from hypothesis import strategies as st

from cutpipe import Costs, generate, metrics, simulate
from cutpipe.schedule.validate import walk
from cutpipe.sim.steps import MAX_STEP_OPS, simulate_steps
from cutpipe.viz.scene import steps_scene

#: One step alone at R = 4, m = 8, F = B = W = 1: (makespan, longest span).
UNIT = {
    "1f1b": (33, 33),
    "zbh1": (27, 27),
    "zbh2": (27, 24),
    "zbv": (51, 48),
    "dualpipev": (54, 54),
    "dualpipe": (26, 26),
    "interleaved": (57, 57),
}


def both(schedule, costs=None, **options):
    return tuple(
        simulate_steps(schedule, costs, boundary=boundary, **options)
        for boundary in ("sync", "overlap")
    )


def test_1f1b_on_two_ranks_by_hand():
    # One step (F = 1, BW = B + W = 2): rank 0 runs 0F0 [0,1] 0F1 [1,2], then waits for the
    # gradients: 0B0 [4,6], 0B1 [7,9]; rank 1 runs 1F0 [1,2] 1B0 [2,4] 1F1 [4,5] 1B1 [5,7].
    sync, overlap = both(generate("1f1b", 2, 2), steps=3, optimizer=1, reduction=0.5)
    for run in (sync, overlap):
        assert [list(s) for s in run.steps[0].starts] == [[0, 1, 4, 7], [1, 2, 4, 5]]
        assert [list(e) for e in run.steps[0].ends] == [[1, 2, 6, 9], [2, 4, 5, 7]]
        assert (run.makespan, run.span) == (9, 9)
    # sync: everyone waits for rank 0 (9) and the all-reduce (0.5), steps (1) and restarts
    assert sync.ready[0] == (9.5, 9.5)
    assert [list(s) for s in sync.steps[1].starts] == [
        [10.5, 11.5, 14.5, 17.5],
        [11.5, 12.5, 14.5, 15.5],
    ]
    assert sync.per_step == (10.5, 10.5, 10.5) and sync.steady == 10.5 and sync.settled == 0
    # overlap: rank 1 steps at 7 and waits at 8 for rank 0's next forward, which starts at 10
    assert overlap.ready[0] == (9, 7)
    assert [list(s) for s in overlap.steps[1].starts] == [[10, 11, 14, 17], [11, 12, 14, 15]]
    assert overlap.ready[1] == (19, 17)
    assert overlap.per_step == (10, 10, 10) and overlap.steady == 10 == overlap.span + 1


def test_a_long_reduction_binds_in_overlap_and_the_steps_pair_up():
    # Step k+1 may not end before step k's check arrives (its end + 20): every other step waits.
    sync, overlap = both(generate("1f1b", 2, 2), steps=5, reduction=20)
    assert sync.steady == 29 and sync.per_step == (29,) * 5
    assert overlap.ready[:3] == ((9, 7), (29, 29), (38, 38))
    assert overlap.per_step == (9, 20, 9, 20, 9)
    assert (overlap.steady, overlap.period, overlap.settled) == (14.5, 2, 0)


@pytest.mark.parametrize("name", sorted(UNIT))
def test_unit_costs_overlap_is_the_span_and_sync_the_makespan(name):
    schedule = generate(name, 4, 8)
    lone = metrics(simulate(schedule))
    makespan, span = UNIT[name]
    assert (lone.makespan, max(lone.span_per_rank)) == (makespan, span)
    sync, overlap = both(schedule, steps=2)
    assert (sync.makespan, sync.span) == (makespan, span)
    assert (sync.steady, overlap.steady) == (makespan, span)
    sync, overlap = both(schedule, steps=3, optimizer=2, reduction=1)
    assert sync.steady == makespan + 3 and overlap.steady == span + 2
    assert overlap.period == sync.period == 1 and overlap.settled <= 1


@pytest.mark.parametrize("name", ["zbv", "zbh2", "dualpipe"])
def test_large_shape_with_measured_costs(name):
    costs = Costs(f=14407, b=14380, w=9676, comm=1610)
    sync, overlap = both(generate(name, 16, 48), costs, steps=10)
    assert sync.steady == sync.makespan and overlap.steady == overlap.span
    assert overlap.steady <= sync.steady and len(overlap.steps) == 10


def test_dualpipe_with_odd_microbatches_repeats_faster_than_its_span():
    # The lone step: rank 0 waits at 1.5 for 0F2, which rank 1 (the other direction's first rank)
    # sends at 1 + comm. In back-to-back steps rank 1, whose direction carries one microbatch
    # fewer, ends its step first and has sent it before rank 0 is free: no wait, 0.5 saved.
    schedule = generate("dualpipe", 2, 3)
    costs = Costs(comm=0.5)
    _, overlap = both(schedule, costs, steps=3)
    assert (overlap.span, overlap.steady) == (13.5, 13)
    assert overlap.steps[0].starts[0][1] == 1.5  # 1F2 waits for the activation from rank 1
    assert overlap.steps[1].starts[0][1] - overlap.steps[1].starts[0][0] == 1  # and now does not
    _, even = both(generate("dualpipe", 2, 4), costs, steps=3)  # the directions mirror
    assert even.steady == even.span


@given(
    named_shapes(max_ranks=5, extra_microbatches=6),
    cost_models(),
    dyadic | st.just(0.0),
    dyadic | st.sampled_from([0.0, 100.0]),
)
def test_overlap_never_takes_longer_than_sync(shape, costs, optimizer, reduction):
    schedule = generate(*shape)
    sync, overlap = both(schedule, costs, steps=3, optimizer=optimizer, reduction=reduction)
    assert sync.steady == sync.makespan + reduction + optimizer and sync.settled == 0
    assert overlap.steady <= sync.steady
    for late, early in zip(sync.steps, overlap.steps, strict=True):
        for rank in range(schedule.num_ranks):
            assert all(e <= s for e, s in zip(early.starts[rank], late.starts[rank], strict=True))
    # each rank runs its steps in order, each after its optimizer step
    for later, ready in zip(overlap.steps[1:], overlap.ready, strict=False):
        for rank, at in enumerate(ready):
            if later.starts[rank]:
                assert later.starts[rank][0] >= at + optimizer


@given(named_shapes(max_ranks=5, extra_microbatches=6), cost_models(), dyadic | st.just(0.0))
def test_overlap_is_at_most_the_span_and_exactly_it_in_one_direction(shape, costs, optimizer):
    schedule = generate(*shape)
    _, overlap = both(schedule, costs, steps=2, optimizer=optimizer)
    lone = metrics(simulate(schedule, costs), costs)
    assert overlap.span == max(lone.span_per_rank) and overlap.makespan == lone.makespan
    assert overlap.steady <= overlap.span + optimizer
    if schedule.placement.num_pipes == 1:  # DualPipe: see the test above
        assert overlap.steady == overlap.span + optimizer


def test_steps_scene_holds_every_step_and_what_runs_between():
    schedule = generate("zbv", 2, 4)
    runs = list(both(schedule, steps=3, optimizer=1, reduction=0.5))
    drawing = steps_scene(runs)
    sync, overlap = drawing.panels
    kinds = [box.kind for box in sync.boxes]
    assert kinds.count("AR") == kinds.count("OPT") == 3 * 2
    assert "AR" not in {box.kind for box in overlap.boxes}  # overlap: no one waits for it
    assert sorted({box.step for box in overlap.boxes}) == [0, 1, 2]
    assert len([b for b in overlap.boxes if b.kind != "OPT"]) == 3 * schedule.num_ops
    assert overlap.step_ends[0] == tuple(t + 1 for t in runs[1].ready[0])
    assert sync.display == "ZB-V (sync)" and "per step once the steps repeat" in overlap.title


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"steps": 0}, ValueError, "steps must be at least 1"),
        ({"steps": True}, TypeError, "steps must be a whole number"),
        ({"steps": 2, "boundary": "both"}, ValueError, "boundary must be one of 'sync', 'overlap'"),
        ({"steps": 2, "optimizer": -1}, ValueError, "optimizer must be a time between 0"),
        ({"steps": 2, "reduction": math.nan}, ValueError, "reduction must be a time between 0"),
        ({"steps": 2, "reduction": "1"}, TypeError, "reduction must be a number"),
        ({"steps": MAX_STEP_OPS}, ValueError, "simulate at most"),
    ],
)
def test_bad_input_says_what_to_change(options, error, message):
    with pytest.raises(error, match=message):
        simulate_steps(generate("1f1b", 2, 2), **options)


def test_bad_schedule_or_costs_are_named():
    with pytest.raises(TypeError, match="takes a Schedule"):
        simulate_steps("1f1b", steps=2)
    with pytest.raises(TypeError, match="costs must be a Costs"):
        simulate_steps(generate("1f1b", 2, 2), {"f": 1}, steps=2)


def test_walk_takes_one_release_per_rank():
    schedule = generate("1f1b", 2, 2)
    assert walk(schedule, Costs().timing(schedule), [5.0, 0.0]).starts[0][0] == 5.0
    with pytest.raises(ValueError, match="release lists 1 times for 2 ranks"):
        walk(schedule, None, [0.0])
