"""ZB-H1 (zero bubble, "handcrafted 1"): 1F1B's order with each BW split into B then W.

Rank r postpones its first r W passes to the end of the step, which fills the tail bubble while
keeping 1F1B's peak memory. Bubble (R-1)(F+B-W) when W <= min(F, B). Valid for any ranks >= 1
and microbatches >= 1.
"""

from __future__ import annotations

from cutpipe.schedule.builder import RankBuilder
from cutpipe.schedule.codes import Codec
from cutpipe.schedule.generators._checks import check_counts
from cutpipe.schedule.generators.one_f_one_b import one_f_one_b_rank
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    check_counts("zbh1", num_ranks, num_microbatches)
    codec = Codec(num_ranks, num_microbatches)
    ranks = []
    for rank in range(num_ranks):
        b = RankBuilder(codec, {rank: range(num_microbatches)})
        warmup = min(num_ranks - 1 - rank, num_microbatches)
        one_f_one_b_rank(
            b, rank, warmup, num_microbatches, split_backward=True, postponed_weights=rank
        )
        ranks.append(tuple(b.codes))
    return Schedule("zbh1", Placement.linear(num_ranks), num_microbatches, tuple(ranks))
