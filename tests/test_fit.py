"""Simulations read off measured timelines: a replay keeps every op's own duration."""

import random

import pytest

from cutpipe import generate
from cutpipe.schedule.validate import Timing, walk
from cutpipe.sim import Timeline
from cutpipe.sim.fit import Delays, measured_delays, replayed


@pytest.mark.parametrize("name", ["dualpipev", "zbv", "1f1b", "dualpipe"])
def test_a_replay_of_a_timeline_with_every_op_its_own_length_reproduces_it(name):
    schedule = generate(name, 4, 10)
    rng = random.Random(7)
    slots = schedule.num_stages * schedule.num_microbatches
    tables = [[rng.uniform(0.5, 2.0) for _ in range(slots)] for _ in range(4)]
    pairs: dict[tuple[int, int], float] = {}

    def pair(forward: int, backward: int) -> float:  # every pair its own time
        return pairs.setdefault((forward, backward), rng.uniform(2.0, 4.0))

    timing = Timing(*tables, pair, latency=0.25, pairs_vary=True)
    result = walk(schedule, timing)
    measured = Timeline(schedule, result.starts, result.ends, unit="s", source="measured")
    replay = replayed(measured, Delays(latency=0.25))
    for mine, theirs in zip(replay.ends, measured.ends, strict=True):
        assert mine == pytest.approx(theirs)
    delays = measured_delays(measured)
    assert delays.overhead == pytest.approx(0.0, abs=1e-12)
    assert delays.latency >= 0.25 - 1e-9  # the waits for crossing inputs include the latency
