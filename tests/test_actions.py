"""Actions, their text notation (PyTorch's), and the packed codes schedules store."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cutpipe.schedule.actions import Action, Kind, Overlap, parse_op, units
from cutpipe.schedule.codes import Codec


def test_text_uses_pytorch_letters():
    assert str(Action(Kind.F, 0, 1)) == "0F1"
    assert str(Action(Kind.B, 3, 0)) == "3I0"  # input-only backward is torch's I
    assert str(Action(Kind.W, 2, 5)) == "2W5"
    assert str(Action(Kind.BW, 1, 2)) == "1B2"  # torch's B is the full backward
    pair = Overlap(Action(Kind.F, 0, 7), Action(Kind.BW, 7, 3))
    assert str(pair) == "(0F7;7B3)OVERLAP_F_B"
    assert pair.kind is Kind.FB
    assert units(pair) == (pair.forward, pair.backward)


kinds = st.sampled_from([Kind.F, Kind.B, Kind.W, Kind.BW])
actions = st.builds(Action, kinds, st.integers(0, 99), st.integers(0, 999))


@given(actions)
def test_text_round_trips(action):
    assert parse_op(str(action)) == action


@given(st.integers(0, 9), st.integers(0, 99), st.sampled_from([Kind.B, Kind.BW]), st.integers(0, 9))
def test_pair_text_round_trips(f_stage, mb, backward_kind, b_stage):
    pair = Overlap(Action(Kind.F, f_stage, mb), Action(backward_kind, b_stage, mb + 1))
    assert parse_op(str(pair)) == pair


@pytest.mark.parametrize(
    "text", ["", "F1", "0X1", "0F", "(0F1;1W2)OVERLAP_F_B", "(0F1)OVERLAP_F_B"]
)
def test_bad_text_is_rejected_with_the_expected_form(text):
    with pytest.raises(ValueError, match="expected|must be"):
        parse_op(text)


@given(st.integers(1, 40), st.integers(1, 60), st.data())
def test_codes_round_trip(stages, microbatches, data):
    codec = Codec(stages, microbatches)
    stage = st.integers(0, stages - 1)
    mb = st.integers(0, microbatches - 1)
    action = Action(data.draw(kinds), data.draw(stage), data.draw(mb))
    assert codec.decode(codec.encode(action)) == action
    pair = Overlap(
        Action(Kind.F, data.draw(stage), data.draw(mb)),
        Action(Kind.BW, data.draw(stage), data.draw(mb)),
    )
    assert codec.encode(pair) < 0
    assert codec.decode(codec.encode(pair)) == pair


def test_codec_rejects_actions_outside_the_schedule():
    with pytest.raises(ValueError, match="outside the schedule"):
        Codec(4, 8).encode(Action(Kind.F, 4, 0))
    with pytest.raises(ValueError, match="outside the schedule"):
        Codec(4, 8).encode(Action(Kind.F, 0, 8))
