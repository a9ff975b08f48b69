"""GPipe: every forward, then every backward.

Valid for any ranks >= 1 and microbatches >= 1. Peak activations: m on every rank.
"""

from __future__ import annotations

from cutpipe.schedule.builder import RankBuilder
from cutpipe.schedule.codes import Codec
from cutpipe.schedule.generators._checks import check_counts
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    check_counts("gpipe", num_ranks, num_microbatches, kinds=2)
    placement = Placement.linear(num_ranks)
    codec = Codec(num_ranks, num_microbatches)
    ranks = []
    for rank in range(num_ranks):
        b = RankBuilder(codec, {rank: range(num_microbatches)})
        for _ in range(num_microbatches):
            b.forward(rank)
        for _ in range(num_microbatches):
            b.backward(rank)
        ranks.append(tuple(b.codes))
    return Schedule("gpipe", placement, num_microbatches, tuple(ranks))
