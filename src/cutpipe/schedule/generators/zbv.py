"""ZB-V: the zero-bubble schedule on a V-shape placement (2 half-size stages per rank).

Rank r holds chunk 0 = stage r and chunk 1 = stage 2R-1-r. With n = max(2R-1, m) and every op of a
microbatch >= m dropped:

- warm-up: (2(R-r)-1) x F0; then r x [F1, F0]; then (R-r) x [F1, B1, W1]
- steady, while forwards remain: [F0 if any left], B0, W0, F1, B1, W1
- cool-down: r x [B0, B1]; then (R-r) x [B0, W0]; then the remaining W1, then the remaining W0

Zero bubble (span measure) when F = B = W; peak activations 2R half-stage units (R full ones).
This is the order of PyTorch's ``ScheduleZBVZeroBubble``. Valid for any ranks >= 1 and
microbatches >= 1.
"""

from __future__ import annotations

from cutpipe.schedule.builder import RankBuilder
from cutpipe.schedule.codes import Codec
from cutpipe.schedule.generators._checks import check_counts
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule


def zbv(num_ranks: int, num_microbatches: int) -> Schedule:
    check_counts("zbv", num_ranks, num_microbatches, stages_per_rank=2, steps=lambda r: 2 * r - 1)
    R = num_ranks
    padded = max(2 * R - 1, num_microbatches)  # the structure needs 2R-1; extra ones are dropped
    codec = Codec(2 * R, num_microbatches)
    ranks = []
    for r in range(R):
        c0, c1 = r, 2 * R - 1 - r
        mbs = range(num_microbatches)
        b = RankBuilder(codec, {c0: mbs, c1: mbs}, steps=padded)
        for _ in range(2 * (R - r) - 1):
            b.forward(c0)
        for _ in range(r):
            b.forward(c1)
            b.forward(c0)
        for _ in range(R - r):
            b.forward(c1)
            b.backward(c1, split=True)
            b.weight(c1)
        while b.forwards_left(c0) or b.forwards_left(c1):
            if b.forwards_left(c0):
                b.forward(c0)
            b.backward(c0, split=True)
            b.weight(c0)
            b.forward(c1)
            b.backward(c1, split=True)
            b.weight(c1)
        for _ in range(r):
            b.backward(c0, split=True)
            b.backward(c1, split=True)
        for _ in range(R - r):
            b.backward(c0, split=True)
            b.weight(c0)
        b.weights(c1)
        b.weights(c0)
        ranks.append(tuple(b.codes))
    return Schedule("zbv", Placement.vshape(R), num_microbatches, tuple(ranks))
