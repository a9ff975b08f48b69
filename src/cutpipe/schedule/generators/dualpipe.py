"""DualPipe (DeepSeek-V3): two pipelines in opposite directions over mirrored copies of the stages.

Pipe 0 enters at rank 0, pipe 1 at rank R-1; each stage lives on two ranks, so parameters are
stored twice. Each rank plays two roles, "0" (the pipe entering at its end of the line) and "1";
on the second half of the ranks the roles swap. With h = min(r, R-1-r), H = R/2 and C microbatch
steps per direction, every rank runs eight phases:

====  ======================================================  ==============
 1    F0                                                      2(H-h-1)
 2    F0, F1                                                  h+1
 3    B1 (W split off and run at once), W, F1                 H-h-1
 4    F0&B1, F1&B0 (overlapped pairs; middle ranks run the    C-2H+h+1
      first F0 and B1 apart)
 5    B1, F1&B0                                               H-h-1
 6    B1, B0 (W split off from the middle of the phase on)    h+1
 7    W, B0 (W split off)                                     H-h-1
 8    W                                                       h+1
====  ======================================================  ==============

Here B is the full backward unless split, and W always runs the oldest pending weight pass.
Valid for even ranks >= 2 and microbatches >= 2R-2 (DeepSeek asserts an even count >= 2R); an odd
count m >= 2R-3 runs as m+1 with pipe 1's last microbatch left out.
"""

from __future__ import annotations

from cutpipe.schedule.builder import RankBuilder
from cutpipe.schedule.codes import Codec
from cutpipe.schedule.generators._checks import check_counts, require
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule


def dualpipe_rank(b: RankBuilder, half: int, h: int, steps: int, stage0: int, stage1: int) -> None:
    """The eight phases of one rank; ``half`` is H, ``steps`` is C (microbatches per direction)."""
    for _ in range(2 * (half - h - 1)):
        b.forward(stage0)
    for _ in range(h + 1):
        b.forward(stage0)
        b.forward(stage1)
    for _ in range(half - h - 1):
        b.backward(stage1, split=True)
        b.weight()
        b.forward(stage1)
    for i in range(steps - 2 * half + h + 1):
        if i == 0 and h == half - 1:
            b.forward(stage0)  # the middle ranks do not overlap these two: a smaller bubble
            b.backward(stage1)
        else:
            b.overlap(stage0, stage1)
        b.overlap(stage1, stage0)
    for _ in range(half - h - 1):
        b.backward(stage1)
        b.overlap(stage1, stage0)
    split = False
    middle = (h + 1) // 2
    for i in range(h + 1):
        if i == middle and h % 2 == 1:
            split = True
        b.backward(stage1, split=split)
        if i == middle and h % 2 == 0:
            split = True
        b.backward(stage0, split=split)
    for _ in range(half - h - 1):
        b.weight()
        b.backward(stage0, split=True)
    b.weights()


def dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    check_counts("dualpipe", num_ranks, num_microbatches)
    R, m = num_ranks, num_microbatches
    require(R % 2 == 0, f"dualpipe needs an even number of ranks (the two halves mirror), got {R}")
    require(
        m >= max(2, 2 * R - 3),
        f"dualpipe needs microbatches >= 2*ranks - 2 (odd: >= 2*ranks - 3), i.e. >= "
        f"{max(2, 2 * R - 3)} for {R} ranks, got {m}",
    )
    placement = Placement.bidirectional(R)
    codec = Codec(R, m)
    steps = -(-m // 2)
    down, up = placement.microbatches_of(0, m), placement.microbatches_of(1, m)
    ranks = []
    for r in range(R):
        first_half = r < R // 2
        stage0, stage1 = (r, R - 1 - r) if first_half else (R - 1 - r, r)
        ids0, ids1 = (down, up) if first_half else (up, down)
        b = RankBuilder(codec, {stage0: ids0, stage1: ids1}, steps=steps)
        dualpipe_rank(b, R // 2, min(r, R - 1 - r), steps, stage0, stage1)
        ranks.append(tuple(b.codes))
    return Schedule("dualpipe", placement, m, tuple(ranks))
