"""The validator: valid schedules pass (see test_generators); every mutation is caught, and the
error names the rank, the action and the missing dependency."""

import pytest
from conftest import named_shapes
from hypothesis import assume, given
from hypothesis import strategies as st

from cutpipe.schedule import (
    Action,
    Kind,
    Overlap,
    Placement,
    Schedule,
    ScheduleError,
    generate,
    units,
    validate,
)
from cutpipe.schedule.cut_in_half import cut_in_half

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW


def rebuild(schedule: Schedule, actions) -> Schedule:
    return Schedule.from_actions(
        schedule.name, schedule.placement, schedule.num_microbatches, actions
    )


def mutable(schedule: Schedule) -> list[list]:
    return [list(ops) for ops in schedule.actions]


@given(named_shapes(max_ranks=6, extra_microbatches=10), st.data())
def test_dropping_any_op_is_caught(shape, data):
    schedule = generate(*shape)
    actions = mutable(schedule)
    rank = data.draw(st.integers(0, schedule.num_ranks - 1))
    index = data.draw(st.integers(0, len(actions[rank]) - 1))
    dropped = actions[rank].pop(index)
    with pytest.raises(ScheduleError) as error:
        validate(rebuild(schedule, actions))
    named = {str(a) for a in units(dropped)}
    message = str(error.value)
    assert error.value.rank is not None and error.value.action is not None
    # the error points at the dropped op, or at an op that needed it
    assert any(text in message for text in named) or error.value.dependency is not None


@given(named_shapes(max_ranks=6, extra_microbatches=10), st.data())
def test_duplicating_any_op_is_caught(shape, data):
    schedule = generate(*shape)
    actions = mutable(schedule)
    rank = data.draw(st.integers(0, schedule.num_ranks - 1))
    index = data.draw(st.integers(0, len(actions[rank]) - 1))
    target = data.draw(st.integers(0, schedule.num_ranks - 1))
    position = data.draw(st.integers(0, len(actions[target])))
    actions[target].insert(position, actions[rank][index])
    with pytest.raises(ScheduleError):
        validate(rebuild(schedule, actions))


def depends_on(later, earlier) -> bool:
    """Whether single action ``later`` needs ``earlier``'s output (both on one rank)."""
    same_slot = (later.stage, later.microbatch) == (earlier.stage, earlier.microbatch)
    if later.kind in (B, BW, W) and earlier.kind is F and same_slot:
        return True
    if later.kind is W and earlier.kind is B and same_slot:
        return True
    if later.microbatch != earlier.microbatch:
        return False
    if later.kind is F and earlier.kind is F:
        return later.stage == earlier.stage + 1
    return later.kind in (B, BW) and earlier.kind in (B, BW) and later.stage == earlier.stage - 1


@given(named_shapes(max_ranks=6, extra_microbatches=10), st.data())
def test_swapping_two_ops_across_a_dependency_is_caught(shape, data):
    schedule = generate(*shape)
    actions = mutable(schedule)
    candidates = [
        (rank, p, q)
        for rank, ops in enumerate(actions)
        for q in range(len(ops))
        for p in range(q)
        if any(depends_on(x, y) for x in units(ops[q]) for y in units(ops[p]))
    ]
    assume(candidates)
    rank, p, q = data.draw(st.sampled_from(candidates))
    ops = actions[rank]
    ops[p], ops[q] = ops[q], ops[p]
    with pytest.raises(ScheduleError) as error:
        validate(rebuild(schedule, actions))
    assert error.value.rank == rank


# -- the messages ---------------------------------------------------------------------------


def linear(ranks, microbatches, actions):
    return Schedule.from_actions("custom", Placement.linear(ranks), microbatches, actions)


def test_a_cross_rank_cycle_is_reported_as_a_deadlock_naming_both_ranks():
    schedule = linear(
        2,
        2,
        [
            [Action(F, 0, 0), Action(BW, 0, 0), Action(F, 0, 1), Action(BW, 0, 1)],
            [Action(F, 1, 1), Action(BW, 1, 1), Action(F, 1, 0), Action(BW, 1, 0)],
        ],
    )
    with pytest.raises(ScheduleError, match="deadlock") as error:
        validate(schedule)
    message = str(error.value)
    assert "rank 0 waits at 0B0 for 1I0/1B0 from rank 1" in message
    assert "rank 1 waits at 1F1 for 0F1 from rank 0" in message
    assert (error.value.rank, error.value.action, error.value.dependency) == (0, "0B0", "1I0/1B0")


def test_an_op_on_a_rank_without_its_stage_is_named():
    schedule = linear(
        2, 1, [[Action(F, 0, 0), Action(F, 1, 0)], [Action(BW, 1, 0), Action(BW, 0, 0)]]
    )
    with pytest.raises(
        ScheduleError, match="rank 0 runs 1F0 .* held by rank 1; rank 0 holds stages 0"
    ):
        validate(schedule)


def test_a_backward_before_its_forward_on_the_same_rank_is_named():
    schedule = linear(1, 1, [[Action(BW, 0, 0), Action(F, 0, 0)]])
    with pytest.raises(ScheduleError, match="rank 0 runs 0B0 .* before 0F0") as error:
        validate(schedule)
    assert error.value.dependency == "0F0"


def test_a_weight_pass_without_its_input_backward_is_named():
    schedule = linear(1, 1, [[Action(F, 0, 0), Action(W, 0, 0), Action(B, 0, 0)]])
    with pytest.raises(ScheduleError, match="needs 0I0") as error:
        validate(schedule)
    assert error.value.dependency == "0I0"


def test_a_missing_op_is_named_with_the_rank_that_should_run_it():
    schedule = linear(2, 1, [[Action(F, 0, 0), Action(BW, 0, 0)], [Action(F, 1, 0)]])
    with pytest.raises(
        ScheduleError, match=r"waits at 0B0 for 1I0/1B0 .* missing it \(rank 1 should"
    ):
        validate(schedule)
    schedule = linear(1, 1, [[Action(F, 0, 0)]])
    with pytest.raises(ScheduleError, match="never gets its backward .* rank 0 should run 0B0"):
        validate(schedule)
    schedule = linear(2, 1, [[Action(BW, 0, 0)], [Action(F, 1, 0), Action(BW, 1, 0)]])
    with pytest.raises(ScheduleError, match="0F0"):
        validate(schedule)


def test_waiting_on_an_op_the_same_rank_runs_later_is_named():
    v = Placement.vshape(1)  # one rank holds stages 0 and 1
    schedule = Schedule.from_actions(
        "custom", v, 1, [[Action(F, 1, 0), Action(F, 0, 0), Action(BW, 1, 0), Action(BW, 0, 0)]]
    )
    with pytest.raises(
        ScheduleError, match="before 0F0, which it needs and which the same rank runs later"
    ):
        validate(schedule)


def test_duplicate_forward_is_named():
    schedule = linear(1, 1, [[Action(F, 0, 0), Action(F, 0, 0), Action(BW, 0, 0)]])
    with pytest.raises(ScheduleError, match="already ran"):
        validate(schedule)


def test_pairs_must_be_a_forward_and_a_backward():
    schedule = linear(
        1, 2, [[Action(F, 0, 0), Overlap(Action(W, 0, 0), Action(BW, 0, 1)), Action(BW, 0, 0)]]
    )
    with pytest.raises(ScheduleError, match="overlapped pair must be a forward"):
        validate(schedule)


def test_a_pair_cannot_differentiate_its_own_forward():
    schedule = linear(1, 1, [[Overlap(Action(F, 0, 0), Action(BW, 0, 0))]])
    with pytest.raises(ScheduleError, match="before 0F0"):
        validate(schedule)


def test_cut_in_half_of_dualpipe_is_valid_and_rejects_other_inputs():
    validate(cut_in_half(generate("dualpipe", 8, 20)))
    with pytest.raises(ValueError, match="bidirectional"):
        cut_in_half(generate("zbv", 4, 8))
    with pytest.raises(ValueError, match="even count"):
        cut_in_half(generate("dualpipe", 4, 9))
