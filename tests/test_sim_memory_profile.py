"""``live_profile``: the peak of any per-stage activations from one pass over the op order."""

from __future__ import annotations

import random

import pytest

from cutpipe.schedule.registry import generate
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import live_profile, peak_activations, peak_from_profile


@pytest.mark.parametrize(
    "name", ["1f1b", "zbh1", "zbh2", "interleaved", "zbv", "dualpipe", "dualpipev"]
)
@pytest.mark.parametrize("kept", [0.0, 0.3, 0.5, 1.0])
def test_profile_peaks_equal_the_simulated_peaks(name, kept):
    rng = random.Random(f"{name}{kept}")
    schedule = generate(name, 4, 12)
    profile = live_profile(schedule, kept)
    for _ in range(5):
        activation = [rng.uniform(0.1, 10.0) for _ in range(schedule.num_stages)]
        costs = Costs(f=1, b=1, w=1, activation=activation, w_memory=kept)
        assert peak_from_profile(profile, activation) == pytest.approx(
            peak_activations(schedule, costs), rel=1e-9
        )
