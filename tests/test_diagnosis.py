"""Who is everybody waiting for: the wait-chain diagnosis and the step agreement, in one process."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cutpipe.runtime.failure.agreement import MismatchError, check_step, failed_ranks, step_word
from cutpipe.runtime.failure.diagnosis import find_stall
from cutpipe.runtime.failure.heartbeat import Beat, process_state, this_host


def beat(state="step", step=2, op="1F3", peer=None, what=None, stalled=0.0) -> Beat:
    return Beat(1, state, step, op, peer, what, stalled, "host", 1)


def test_a_chain_of_waits_ends_at_the_rank_whose_op_does_not_return():
    beats = {
        0: beat(op="0B1", peer=1, what="the input gradient of stage 1, microbatch 1 from rank 1",
                stalled=40),
        1: beat(op="1B1", peer=2, what="the input gradient of stage 2, microbatch 1 from rank 2",
                stalled=40),
        2: beat(op="2F3", stalled=41),
    }  # fmt: skip
    stall = find_stall(0, beats, timeout=30)
    assert stall.root == 2
    assert stall.message.startswith(
        "rank 2 made no progress for 41 s: it is running 2F3 of step 2, which has not returned; "
        "rank 0 waits for the input gradient of stage 1, microbatch 1 from rank 1 in step 2 at 0B1"
        "; rank 1 waits for the input gradient of stage 2"
    ), stall.message


def test_a_rank_waiting_for_a_peer_that_still_works_is_not_stalled():
    beats = {0: beat(op="0B7", peer=1, what="x", stalled=50), 1: beat(op="1W2", stalled=0.5)}
    assert find_stall(0, beats, timeout=30) is None


def test_a_collective_is_waited_for_by_the_ranks_not_in_it():
    waiting = {"what": "the loss all-reduce of step 2", "stalled": 35}
    beats = {
        0: beat(op="0W3", **waiting),
        1: beat(state="idle", step=1, op="between steps"),
        2: beat(op="2W3", **waiting),
    }
    stall = find_stall(2, beats, timeout=30)
    assert stall.root == 1
    assert stall.message.startswith("rank 1 is not in a step: it is between steps (after step 1)")
    everyone = {r: beat(op=f"{r}W3", **waiting) for r in range(3)}
    stall = find_stall(0, everyone, timeout=30)
    assert stall.message.startswith(
        "every rank has waited 35 s for the loss all-reduce of step 2 and it does not complete"
    )


def test_ranks_waiting_on_each_other_are_a_cycle():
    beats = {
        0: beat(op="0F1", peer=1, what="a from rank 1", stalled=40),
        1: beat(op="1F0", peer=0, what="b from rank 0", stalled=40),
    }
    stall = find_stall(0, beats, timeout=30)
    assert stall.message.startswith("ranks 0, 1 wait for each other")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.data())
def test_diagnosis_always_ends_and_names_a_rank_of_the_group(data):
    world = data.draw(st.integers(1, 6))
    beats = {}
    for rank in range(world):
        kind = data.draw(st.sampled_from(["compute", "peer", "collective", "idle", "closed"]))
        stalled = data.draw(st.floats(0, 100))
        if kind == "compute":
            beats[rank] = beat(stalled=stalled)
        elif kind == "peer":
            peer = data.draw(st.integers(0, world - 1))
            beats[rank] = beat(peer=peer, what=f"x from rank {peer}", stalled=stalled)
        elif kind == "collective":
            beats[rank] = beat(what="the agreement on step 2", stalled=stalled)
        else:
            beats[rank] = beat(state=kind, op="between steps")
    start = data.draw(st.integers(0, world - 1))
    stall = find_stall(start, beats, timeout=30)
    if stall is not None:
        assert 0 <= stall.root < world
        assert f"rank {stall.root}" in stall.message or stall.message.startswith(
            ("ranks ", "every rank")
        )


def test_the_os_tells_a_running_process_from_a_gone_one():
    import os

    assert process_state(this_host(), os.getpid()) == "running"
    assert process_state(this_host(), 2**22 + 12345) in ("gone", "unknown")
    assert process_state("another-host", os.getpid()) == "unknown"


def words(*rows):
    signature = torch.zeros(4, dtype=torch.int64)
    return torch.stack([step_word(*row, signature) for row in rows])


def test_the_step_agreement_names_who_differs():
    assert check_step(words((True, 3, 8, -1, False), (True, 3, -1, 8, False))) == [0, 0, 0, 0]
    with pytest.raises(MismatchError, match="rank 0 a training step, rank 1 a forward-only step"):
        check_step(words((True, 3, 8, -1, False), (False, 3, -1, 8, False)))
    with pytest.raises(MismatchError, match="rank 0 at step 3, rank 1 at step 2"):
        check_step(words((True, 3, 8, -1, False), (True, 2, -1, 8, False)))
    with pytest.raises(MismatchError, match="rank 0 inputs of 8, rank 1 targets of 12"):
        check_step(words((True, 3, 8, -1, False), (True, 3, -1, 12, False)))
    assert failed_ranks(words((True, 1, 8, -1, True), (True, 1, -1, 8, False))) == [0]
