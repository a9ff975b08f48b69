"""Every generator, over grids of (ranks, microbatches): valid inside its range, a named error
outside it, and the structure the papers describe."""

import pytest
from conftest import NAMES, named_shapes, valid_shapes
from hypothesis import given
from hypothesis import strategies as st

from cutpipe.schedule import SCHEDULES, Kind, Overlap, generate, units, validate
from cutpipe.schedule.generators import dualpipe, interleaved, one_f_one_b, zb_h1, zb_h2


def singles(schedule, rank):
    return [a for op in schedule.actions[rank] for a in units(op)]


@given(named_shapes())
def test_every_generator_is_valid_inside_its_range(shape):
    name, ranks, m = shape
    schedule = generate(name, ranks, m)
    validate(schedule)
    assert schedule.name == name
    assert schedule.num_ranks == ranks and schedule.num_microbatches == m
    S = schedule.num_stages
    ops = [a for r in range(ranks) for a in singles(schedule, r)]
    assert sum(a.kind is Kind.F for a in ops) == S * m
    backward_slots = [(a.stage, a.microbatch) for a in ops if a.kind in (Kind.B, Kind.BW)]
    assert sorted(backward_slots) == sorted((s, i) for s in range(S) for i in range(m))
    assert sum(a.kind is Kind.W for a in ops) == sum(a.kind is Kind.B for a in ops)


@given(st.sampled_from(NAMES), st.integers(-2, 14), st.integers(-2, 40))
def test_generators_accept_exactly_their_documented_range(name, ranks, m):
    info = SCHEDULES[name]
    if ranks >= 1 and m >= 1 and info.accepts(ranks, m):
        validate(generate(name, ranks, m))
    else:
        with pytest.raises(ValueError, match="ranks|microbatches") as error:
            generate(name, ranks, m)
        assert name in str(error.value)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [1.5, "4", True, None])
def test_non_integer_arguments_are_rejected(name, bad):
    with pytest.raises(TypeError, match="ranks must be an int"):
        generate(name, bad, 8)
    with pytest.raises(TypeError, match="microbatches must be an int"):
        generate(name, 4, bad)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="known schedules: gpipe, 1f1b, .*dualpipev"):
        generate("zb-h3", 4, 8)


def test_dualpipev_minimum_is_2r_minus_1_not_deepseeks_2r():
    validate(generate("dualpipev", 4, 7))
    with pytest.raises(
        ValueError, match=r"microbatches >= 2\*ranks - 1 \(= 7 for 4 ranks\), got 6"
    ):
        generate("dualpipev", 4, 6)


def test_dualpipe_minimum_is_2r_minus_2_and_odd_counts_work():
    validate(generate("dualpipe", 8, 14))  # DeepSeek asserts >= 16
    validate(generate("dualpipe", 8, 13))  # odd: pipe 1 carries one microbatch fewer
    with pytest.raises(ValueError, match="even number of ranks"):
        generate("dualpipe", 5, 20)


# -- structure ----------------------------------------------------------------------------


@given(valid_shapes("1f1b"))
def test_1f1b_warms_up_then_alternates(shape):
    ranks, m = shape
    schedule = one_f_one_b(ranks, m)
    for r in range(ranks):
        kinds = [a.kind for a in schedule.actions[r]]
        warmup = min(ranks - 1 - r, m)
        assert kinds[:warmup] == [Kind.F] * warmup
        steady = kinds[warmup : warmup + 2 * (m - warmup)]
        assert steady == [Kind.F, Kind.BW] * (m - warmup)
        assert [a.microbatch for a in schedule.actions[r] if a.kind is Kind.BW] == list(range(m))


@given(valid_shapes("zbh1"))
def test_zbh1_is_1f1b_split_with_r_weights_postponed(shape):
    ranks, m = shape
    base, zb = one_f_one_b(ranks, m), zb_h1(ranks, m)
    for r in range(ranks):
        ops = singles(zb, r)
        without_w = [(a.kind, a.microbatch) for a in ops if a.kind is not Kind.W]
        expected = [
            (Kind.B if a.kind is Kind.BW else a.kind, a.microbatch) for a in base.actions[r]
        ]
        assert without_w == expected
        weights = [a.microbatch for a in ops if a.kind is Kind.W]
        assert weights == list(range(m))  # first in, first out
        postponed = min(r, m)
        tail = [a.kind for a in ops[-postponed:]] if postponed else []
        assert tail == [Kind.W] * postponed


@given(valid_shapes("zbh2"))
def test_zbh2_warms_up_twice_as_long(shape):
    ranks, m = shape
    schedule = zb_h2(ranks, m)
    for r in range(ranks):
        kinds = [a.kind for a in schedule.actions[r]]
        forwards = min(2 * (ranks - 1 - r) + 1, m)  # warm-up, then the first steady F
        assert kinds[: forwards + 1] == [Kind.F] * forwards + [Kind.B]


@given(valid_shapes("interleaved"), st.integers(1, 4))
def test_interleaved_runs_every_chunk(shape, chunks):
    ranks, m = shape
    schedule = interleaved(ranks, m, chunks)
    validate(schedule)
    assert schedule.num_stages == ranks * chunks
    for r in range(ranks):
        assert {a.stage for a in schedule.actions[r]} == {c * ranks + r for c in range(chunks)}


@given(valid_shapes("dualpipe"))
def test_dualpipe_has_two_mirrored_pipes_and_overlapped_pairs(shape):
    ranks, m = shape
    schedule = dualpipe(ranks, m)
    placement = schedule.placement
    assert placement.kind == "bidirectional"
    assert all(len(placement.copies(s)) == 2 for s in range(ranks))
    half, steps = ranks // 2, -(-m // 2)
    for r in range(ranks):
        h = min(r, ranks - 1 - r)
        pairs = sum(type(op) is Overlap for op in schedule.actions[r])
        main_phase = steps - ranks + h + 1
        expected = 2 * main_phase + (half - h - 1) - (h == half - 1 and main_phase > 0)
        if m % 2 == 0:  # odd counts drop pipe 1's last microbatch, which can unpair an op
            assert pairs == expected
        for op in schedule.actions[r]:
            if type(op) is Overlap:
                assert op.forward.kind is Kind.F and op.backward.kind is Kind.BW
