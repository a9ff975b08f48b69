"""Placements: who holds which stage, and what that implies for parameters and traffic."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cutpipe.schedule.placement import Placement


@given(st.integers(1, 32))
def test_vshape_folds_the_second_half_back(ranks):
    p = Placement.vshape(ranks)
    assert p.num_stages == 2 * ranks
    for r in range(ranks):
        assert p.stages_of(r) == (r, 2 * ranks - 1 - r)
        assert p.parameter_share(r) == pytest.approx(1 / ranks)
    # the turn of the V stays on the last rank: no send between stage R-1 and R
    assert not p.is_cross_rank(0, ranks - 1)


@given(st.integers(1, 16).map(lambda h: 2 * h))
def test_bidirectional_stores_every_stage_twice(ranks):
    p = Placement.bidirectional(ranks)
    assert p.num_pipes == 2
    for stage in range(ranks):
        assert p.copies(stage) == (stage, ranks - 1 - stage)
    for r in range(ranks):
        assert set(p.stages_of(r)) == {r, ranks - 1 - r}
        assert p.parameter_share(r) == pytest.approx(2 / ranks)  # DualPipe's 2x


@given(st.integers(1, 12), st.integers(1, 4))
def test_interleaved_round_robin(ranks, chunks):
    p = Placement.interleaved(ranks, chunks)
    for r in range(ranks):
        assert p.stages_of(r) == tuple(c * ranks + r for c in range(chunks))


@given(st.integers(1, 200))
def test_microbatches_split_over_pipes_in_blocks(m):
    p = Placement.bidirectional(4)
    down, up = p.microbatches_of(0, m), p.microbatches_of(1, m)
    assert list(down) + list(up) == list(range(m))
    assert len(down) == (m + 1) // 2
    assert all(p.pipe_of(i, m) == (i >= down.stop) for i in range(m))
    assert p.pipe_table(m) == [p.pipe_of(i, m) for i in range(m)]


def test_bad_placements_are_rejected():
    with pytest.raises(ValueError, match="even number of ranks"):
        Placement.bidirectional(3)
    with pytest.raises(ValueError, match="outside"):
        Placement("linear", 2, ((0, 2),))
    with pytest.raises(ValueError, match="at least one stage"):
        Placement("linear", 3, ((0, 1),))


def test_round_trips_through_dict():
    p = Placement.bidirectional(6)
    assert Placement.from_dict(p.to_dict()) == p
