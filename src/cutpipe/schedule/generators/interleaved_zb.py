"""Interleaved zero bubble (ZB1P on the interleaved placement): Interleaved 1F1B, B and W split.

Each rank holds v chunks, stages r, r+R, ..., r+(v-1)R, and walks its chunks in the rounds of
Interleaved 1F1B (``interleaved.round_sizes``: forwards chunk 0 for the round's microbatches,
then chunk 1, ...; backwards the chunks in reverse). Rank r warms up with (v-1)·g + R-1-r
forwards (g: the first round's size; half Interleaved 1F1B's extra 2 per hop, since a B is
quicker than a full backward), then runs F, B steps, then the remaining B. Every B's W is queued
(first in, first out across the rank) and run right after the B once r W are pending, so rank r
holds r W back to fill its cool-down, as ZB-H1 does; the pending W run at the end.

This is the order of PyTorch's ``ScheduleInterleavedZeroBubble`` wherever torch accepts the
shape (microbatches a multiple of max(1, m // R)); elsewhere the rounds are uneven, as in
``interleaved``. Valid for ranks >= 1, chunks >= 1 and microbatches >= 1.
"""

from __future__ import annotations

from cutpipe.schedule.builder import RankBuilder
from cutpipe.schedule.generators._checks import check_chunked_counts
from cutpipe.schedule.generators.interleaved import looped_rounds
from cutpipe.schedule.schedule import Schedule


def interleaved_zb(num_ranks: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    check_chunked_counts("interleavedzb", num_ranks, num_microbatches, chunks)
    R, m, v = num_ranks, num_microbatches, chunks
    placement, codec, sizes, forward_chunks, backward_chunks = looped_rounds(R, m, v)
    total = v * m
    ranks = []
    for r in range(R):
        stage_of = placement.stages_of(r)
        b = RankBuilder(codec, {s: range(m) for s in stage_of})
        warmup = min((v - 1) * sizes[0] + R - 1 - r, total)
        for step in range(warmup):
            b.forward(stage_of[forward_chunks[step]])
        for step in range(total):
            if step < total - warmup:
                b.forward(stage_of[forward_chunks[warmup + step]])
            b.backward(stage_of[backward_chunks[step]], split=True)
            if step >= r:
                b.weight()
        b.weights()
        ranks.append(tuple(b.codes))
    return Schedule("interleavedzb", placement, m, tuple(ranks))
