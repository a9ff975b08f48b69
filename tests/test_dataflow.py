"""The dependency rule: its statement, its ranks and pipes, its tables, and that the walk, the
runtime's sends and the planners' event loop all follow it, for every generator."""

from collections import Counter

from conftest import dyadic, named_shapes
from hypothesis import given
from hypothesis import strategies as st

from cutpipe.plan.search.events import Ranks
from cutpipe.schedule import Kind, Placement, generate, units
from cutpipe.schedule.codes import B_CODE, BW_CODE, F_CODE, W_CODE
from cutpipe.schedule.dataflow import (
    ACTIVATION,
    GRADIENT,
    Dataflow,
    awaited,
    forward_input,
    produced,
)
from cutpipe.sim import Costs, simulate

KINDS = (F_CODE, B_CODE, W_CODE, BW_CODE)


def single_ops(schedule):
    """(rank, op code) of every single op and every half of a pair."""
    split = schedule.codec.split_pair
    for rank, ops in enumerate(schedule.codes):
        for code in ops:
            for half in split(code) if code < 0 else (code,):
                yield rank, half


def test_the_rule_as_written():
    S = 4
    for mb in (0, 5):
        assert awaited(F_CODE, 0, mb, S) is None
        assert awaited(F_CODE, 2, mb, S) == (ACTIVATION, 1, mb) == forward_input(2, mb)
        for backward in (B_CODE, BW_CODE):
            assert awaited(backward, 1, mb, S) == (GRADIENT, 2, mb)
            assert awaited(backward, S - 1, mb, S) == (ACTIVATION, S - 1, mb)  # the loss
            assert produced(backward, 1, mb) == (GRADIENT, 1, mb)
        assert awaited(W_CODE, 1, mb, S) == (GRADIENT, 1, mb)  # its own B
        assert produced(F_CODE, 3, mb) == (ACTIVATION, 3, mb)
        assert produced(W_CODE, 3, mb) is None


def test_readers_ranks_and_pipes_of_dualpipe():
    flow = Dataflow(Placement.bidirectional(4), 6)  # pipe 0: microbatches 0-2, pipe 1: 3-5
    assert [flow.pipe(mb) for mb in range(6)] == [0, 0, 0, 1, 1, 1]
    assert flow.rank(0, 1) == 0 and flow.rank(0, 4) == 3
    assert flow.reader((ACTIVATION, 1, 0)) == (F_CODE, 2)
    assert flow.reader((ACTIVATION, 3, 0)) == (B_CODE, 3)
    assert flow.reader((GRADIENT, 2, 0)) == (B_CODE, 1)
    assert flow.reader((GRADIENT, 0, 0)) == (W_CODE, 0)
    assert flow.producer((ACTIVATION, 1, 4)) == 2 and flow.consumer((ACTIVATION, 1, 4)) == 1
    assert flow.source(F_CODE, 2, 4) == 2 and flow.destination(F_CODE, 2, 4) == 0
    assert flow.source(B_CODE, 3, 0) is None  # the last stage starts from its own loss
    assert flow.destination(B_CODE, 0, 4) is None  # the first stage's gradient leaves the model
    assert flow.source(W_CODE, 1, 1) is None and flow.destination(W_CODE, 1, 1) is None


def test_a_v_turn_stays_on_its_rank():
    flow = Dataflow(Placement.vshape(2), 1)  # stages 0 1 2 3 on ranks 0 1 1 0
    assert flow.source(F_CODE, 2, 0) is None and flow.destination(F_CODE, 1, 0) is None
    assert flow.source(B_CODE, 1, 0) is None and flow.destination(B_CODE, 2, 0) is None
    assert flow.source(F_CODE, 1, 0) == 0 and flow.destination(B_CODE, 1, 0) == 0


@given(named_shapes(max_ranks=5, extra_microbatches=6))
def test_every_value_is_made_once_and_read_where_the_rule_says(shape):
    schedule = generate(*shape)
    flow = schedule.dataflow
    made: dict = {}
    waits: Counter = Counter()
    split = set()
    for rank, code in single_ops(schedule):
        kind, stage, mb = flow.unpack(code)
        assert flow.rank(stage, mb) == rank == schedule.placement.pipes[flow.pipe(mb)][stage]
        key = flow.makes(code)
        if key is not None:
            assert key not in made, f"{key} made twice"
            made[key] = rank
            assert flow.producer(key) == rank
        need = flow.awaits(code)
        if need is not None:
            waits[need] += 1
            if need[1] != stage:  # from another stage: the reader the rule names
                assert flow.reader(need) == (F_CODE if kind == F_CODE else B_CODE, stage)
                assert flow.consumer(need) == rank
        if kind == B_CODE:
            split.add((stage, mb))
        sender = None if need is None else flow.producer(need)
        assert flow.source(kind, stage, mb) == (None if sender == rank else sender)
        receiver = None if key is None else flow.consumer(key)
        assert flow.destination(kind, stage, mb) == (None if receiver == rank else receiver)
    S, m = schedule.num_stages, schedule.num_microbatches
    assert len(made) == 2 * S * m  # every activation and every input gradient
    for what, stage, mb in made:
        # an activation: the next stage's forward, or the loss's backward; a gradient: the
        # previous stage's backward, and its own W when the backward was split
        expected = 1 if what == ACTIVATION else (stage > 0) + ((stage, mb) in split)
        assert waits[what, stage, mb] == expected, (what, stage, mb)
    assert set(waits) <= set(made)


@given(named_shapes(max_ranks=5, extra_microbatches=6), dyadic, st.sampled_from([0.0, 0.5]))
def test_the_walk_starts_every_op_after_what_it_waits_for(shape, f, comm):
    schedule = generate(*shape)
    flow = schedule.dataflow
    costs = Costs(f=f, b=f * 2, w=0.5, comm=comm)
    timeline = simulate(schedule, costs)
    done = {}
    for rank in range(timeline.num_ranks):
        for op, _, end in timeline.events(rank):
            for action in units(op):
                key = produced(*action)
                if key is not None:
                    done[key] = (rank, end)
    for rank in range(timeline.num_ranks):
        for op, start, _ in timeline.events(rank):
            for action in units(op):
                need = awaited(*action, schedule.num_stages)
                if need is None:
                    continue
                source, end = done[need]
                assert source == flow.producer(need)
                latency = comm if source != rank else 0.0
                assert start >= end + latency, (str(op), need)
                assert schedule.source(action) == (None if source == rank else source)


@given(named_shapes(max_ranks=5, extra_microbatches=6), st.sampled_from([0.0, 1.5]))
def test_the_tables_say_what_the_rule_says(shape, latency):
    schedule = generate(*shape)
    flow = schedule.dataflow
    inputs, readers = flow.inputs(latency), flow.readers(latency)
    owner = flow.owners
    reading: dict = {}
    codes = [code for _, code in single_ops(schedule)]
    for code in codes:
        reading.setdefault(flow.awaits(code), set()).add(code)
    for code in codes:
        _, stage, mb = flow.unpack(code)
        step, delay = inputs[code % len(inputs)]
        need = flow.awaits(code)
        if need is None:
            assert step is None
        else:
            slot = mb * schedule.num_stages + stage
            assert slot + step == flow.value(need)
            assert delay == (latency if flow.producer(need) != owner[slot] else 0.0)
        key = flow.makes(code)
        named = {code + s for s, _ in readers[code % len(readers)]}
        assert all(flow.awaits(reader) == key for reader in named)
        assert reading.get(key, set()) <= named if key is not None else not named


@given(named_shapes(max_ranks=4, extra_microbatches=4))
def test_the_planners_event_loop_knows_each_input_once_its_maker_is_placed(shape):
    schedule = generate(*shape)
    timeline = simulate(schedule)  # F = B = W = 1: a maker ends before its readers start
    ranks = Ranks(schedule.dataflow, latency=1.0)
    split = schedule.codec.split_pair
    started = sorted(
        (start, rank, code)
        for rank, ops in enumerate(schedule.codes)
        for code, start in zip(ops, timeline.starts[rank], strict=True)
    )
    for start, rank, code in started:
        for half in split(code) if code < 0 else (code,):
            assert ranks.ready[half] is not None, schedule.codec.decode(half)
            assert ranks.ready[half] <= start + 1.0  # made by then, plus at most the latency
        ranks.place(rank, code, start + 1.0)


def test_kinds_line_up_with_the_action_kinds():
    assert [int(k) for k in (Kind.F, Kind.B, Kind.W, Kind.BW)] == list(KINDS)
