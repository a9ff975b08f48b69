"""Interleaved 1F1B (Megatron-LM): each rank holds v chunks, stages r, r+R, ..., r+(v-1)R.

Microbatches go in rounds of (about) R. Within a round a rank runs the forwards of chunk 0 for
every microbatch of the round, then chunk 1, and so on; backwards go through the chunks in
reverse. Rank r warms up with 2(R-1-r) + (v-1)g forwards (g: the first round's size), then
alternates one forward and one full backward. The bubble shrinks v-fold against 1F1B; traffic
grows v-fold. Valid for ranks >= 1, chunks >= 1 and microbatches >= 1: when R does not divide m,
the rounds are made a little longer than R instead of leaving a short last one.

This is the order of PyTorch's ``ScheduleInterleaved1F1B`` (chunk counts 1 to 4 tested)
wherever torch accepts the shape, which it does when the rounds come out even (m a multiple of
max(1, m // R)).
"""

from __future__ import annotations

from cutpipe.schedule.builder import RankBuilder
from cutpipe.schedule.codes import Codec
from cutpipe.schedule.generators._checks import check_chunked_counts
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule


def round_sizes(num_ranks: int, num_microbatches: int) -> list[int]:
    """Split the microbatches into max(1, m // R) rounds as even as possible, larger ones first.

    Every round then has at least R microbatches (or all of them, if m < R), which the warm-up
    below relies on: a short last round would leave the pipeline waiting on itself.
    """
    rounds = max(1, num_microbatches // num_ranks)
    size, extra = divmod(num_microbatches, rounds)
    return [size + (i < extra) for i in range(rounds)]


def chunk_order(sizes: list[int], chunks: int, reverse: bool) -> list[int]:
    """The chunk of every forward (or backward) step of a rank, round by round."""
    order = []
    for size in sizes:
        for chunk in reversed(range(chunks)) if reverse else range(chunks):
            order.extend([chunk] * size)
    return order


def looped_rounds(
    num_ranks: int, num_microbatches: int, chunks: int
) -> tuple[Placement, Codec, list[int], list[int], list[int]]:
    """What every looped interleaved order starts from: the placement, the codec, the rounds'
    sizes, and the chunk of each forward and each backward step of a rank."""
    placement = Placement.interleaved(num_ranks, chunks)
    codec = Codec(num_ranks * chunks, num_microbatches)
    sizes = round_sizes(num_ranks, num_microbatches)
    forwards = chunk_order(sizes, chunks, reverse=False)
    backwards = chunk_order(sizes, chunks, reverse=True)
    return placement, codec, sizes, forwards, backwards


def interleaved(num_ranks: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    check_chunked_counts("interleaved", num_ranks, num_microbatches, chunks, kinds=2)
    R, m, v = num_ranks, num_microbatches, chunks
    placement, codec, sizes, forward_chunks, backward_chunks = looped_rounds(R, m, v)
    total = v * m
    ranks = []
    for r in range(R):
        stage_of = [c * R + r for c in range(v)]
        b = RankBuilder(codec, {s: range(m) for s in stage_of})
        warmup = min(2 * (R - 1 - r) + (v - 1) * sizes[0], total)
        for step in range(warmup):
            b.forward(stage_of[forward_chunks[step]])
        for step in range(total - warmup):
            b.forward(stage_of[forward_chunks[warmup + step]])
            b.backward(stage_of[backward_chunks[step]])
        for step in range(total - warmup, total):
            b.backward(stage_of[backward_chunks[step]])
        ranks.append(tuple(b.codes))
    return Schedule("interleaved", placement, m, tuple(ranks))
