"""Shared hypothesis settings and strategies."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from cutpipe.schedule.registry import SCHEDULES

settings.register_profile(
    "default", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

NAMES = tuple(SCHEDULES)


@st.composite
def valid_shapes(draw, name: str, max_ranks: int = 10, extra_microbatches: int = 24):
    """(ranks, microbatches) inside ``name``'s documented valid range."""
    info = SCHEDULES[name]
    ranks = draw(st.integers(1, max_ranks).filter(lambda r: not (info.even_ranks and r % 2)))
    low = info.min_microbatches(ranks)
    return ranks, draw(st.integers(low, low + extra_microbatches))


@st.composite
def named_shapes(draw, max_ranks: int = 10, extra_microbatches: int = 24):
    """(name, ranks, microbatches) for any generator, inside its valid range."""
    name = draw(st.sampled_from(NAMES))
    return (name, *draw(valid_shapes(name, max_ranks, extra_microbatches)))


#: Costs that add up exactly in binary floating point, so closed forms can be checked with ==.
dyadic = st.integers(1, 16).map(lambda k: k / 4)
