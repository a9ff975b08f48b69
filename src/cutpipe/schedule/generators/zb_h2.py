"""ZB-H2 (zero bubble, "handcrafted 2"): more warm-up forwards, W passes moved to the tail.

Rank r runs 2(R-1-r) warm-up forwards, then F, B, W steps, and postpones its first 2r W passes to
the end, turning 1F1B's trapezoid into a parallelogram. Zero bubble by the span measure when
F = B = W; in general (R-1) max(F+B-2W, B-F, 0). Peak activations (2R-1) on rank 0. Valid for
any ranks >= 1 and microbatches >= 1.
"""

from __future__ import annotations

from cutpipe.schedule.builder import RankBuilder
from cutpipe.schedule.codes import Codec
from cutpipe.schedule.generators._checks import check_counts
from cutpipe.schedule.generators.one_f_one_b import one_f_one_b_rank
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule


def zb_h2(num_ranks: int, num_microbatches: int) -> Schedule:
    check_counts("zbh2", num_ranks, num_microbatches)
    codec = Codec(num_ranks, num_microbatches)
    ranks = []
    for rank in range(num_ranks):
        b = RankBuilder(codec, {rank: range(num_microbatches)})
        warmup = min(2 * (num_ranks - 1 - rank), num_microbatches)
        one_f_one_b_rank(
            b, rank, warmup, num_microbatches, split_backward=True, postponed_weights=2 * rank
        )
        ranks.append(tuple(b.codes))
    return Schedule("zbh2", Placement.linear(num_ranks), num_microbatches, tuple(ranks))
