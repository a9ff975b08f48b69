"""Looped BFS (breadth-first pipeline parallelism): one wave per chunk, forward then backward.

Each rank holds v chunks, stages r, r+R, ..., r+(v-1)R (the interleaved placement). Rank r runs
the forwards of every microbatch on its first chunk, then on its second, and so on; then the
full backwards chunk by chunk in reverse, each chunk's microbatches last first, so the newest
activation is freed first and the first backward needs no wait for the last forward's peers.
Every rank holds all v·m stage activations at its peak (GPipe's memory, v-fold smaller bubble
per chunk than GPipe on the same stages). This is the order of PyTorch's
``ScheduleLoopedBFS``. Valid for ranks >= 1, chunks >= 1 and microbatches >= 1.
"""

from __future__ import annotations

from cutpipe.schedule.builder import RankBuilder
from cutpipe.schedule.codes import Codec
from cutpipe.schedule.generators._checks import check_chunked_counts
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule


def looped_bfs(num_ranks: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    check_chunked_counts("loopedbfs", num_ranks, num_microbatches, chunks, kinds=2)
    R, m = num_ranks, num_microbatches
    placement = Placement.interleaved(R, chunks)
    codec = Codec(R * chunks, m)
    ranks = []
    for r in range(R):
        stages = placement.stages_of(r)
        b = RankBuilder(codec, {s: range(m) for s in stages}, reverse_backwards=True)
        for stage in stages:
            for _ in range(m):
                b.forward(stage)
        for stage in reversed(stages):
            for _ in range(m):
                b.backward(stage)
        ranks.append(tuple(b.codes))
    return Schedule("loopedbfs", placement, m, tuple(ranks))
