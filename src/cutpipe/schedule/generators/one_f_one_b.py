"""1F1B: warm up with forwards, then alternate one forward and one full backward.

Rank r runs min(R-1-r, m) warm-up forwards, then F/BW pairs, then the remaining BW. Valid for any
ranks >= 1 and microbatches >= 1. Peak activations on rank r: min(R-r, m) stage-microbatches.
"""

from __future__ import annotations

from cutpipe.schedule.builder import RankBuilder
from cutpipe.schedule.codes import Codec
from cutpipe.schedule.generators._checks import check_counts
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule


def one_f_one_b_rank(
    b: RankBuilder,
    stage: int,
    warmup: int,
    num_microbatches: int,
    split_backward: bool = False,
    postponed_weights: int = 0,
) -> None:
    """The 1F1B order on one stage; with ``split_backward`` each BW becomes B then W.

    ``postponed_weights``: the first that many W are held back and run, oldest first, at the end
    (ZB-H1 and ZB-H2 fill the pipeline's tail with them).
    """
    backwards = 0

    def backward() -> None:
        nonlocal backwards
        b.backward(stage, split=split_backward)
        backwards += 1
        if split_backward and backwards > postponed_weights:
            b.weight(stage)

    for _ in range(warmup):
        b.forward(stage)
    for _ in range(num_microbatches - warmup):
        b.forward(stage)
        backward()
    for _ in range(warmup):
        backward()
    b.weights(stage)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    check_counts("1f1b", num_ranks, num_microbatches, kinds=2)
    codec = Codec(num_ranks, num_microbatches)
    ranks = []
    for rank in range(num_ranks):
        b = RankBuilder(codec, {rank: range(num_microbatches)})
        one_f_one_b_rank(b, rank, min(num_ranks - 1 - rank, num_microbatches), num_microbatches)
        ranks.append(tuple(b.codes))
    return Schedule("1f1b", Placement.linear(num_ranks), num_microbatches, tuple(ranks))
