"""DualPipeV ("Cut-in-half"): DualPipe's eight phases on a V-shape placement.

Keep the first half of DualPipe's ranks and fold the upward pipe into the second leg of a V: rank r
holds stage r and stage 2R-1-r, parameters are stored once, and the pipeline traffic doubles. The
phases are DualPipe's with H -> R, h -> r and C -> m; the last rank runs its first phase-4 pair
apart. This is the order of PyTorch's ``ScheduleDualPipeV`` and of DeepSeek's DualPipeV.
Valid for ranks >= 1 and microbatches >= 2R-1 (DeepSeek and PyTorch assert m >= 2R).
"""

from __future__ import annotations

from cutpipe.schedule.builder import RankBuilder
from cutpipe.schedule.codes import Codec
from cutpipe.schedule.generators._checks import check_counts, require
from cutpipe.schedule.generators.dualpipe import dualpipe_rank
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    check_counts("dualpipev", num_ranks, num_microbatches, stages_per_rank=2)
    R, m = num_ranks, num_microbatches
    require(
        m >= 2 * R - 1,
        f"dualpipev needs microbatches >= 2*ranks - 1 (= {2 * R - 1} for {R} ranks), got {m}; "
        "use zbv for fewer microbatches",
    )
    codec = Codec(2 * R, m)
    ranks = []
    for r in range(R):
        stage0, stage1 = r, 2 * R - 1 - r
        b = RankBuilder(codec, {stage0: range(m), stage1: range(m)})
        dualpipe_rank(b, R, r, m, stage0, stage1)
        ranks.append(tuple(b.codes))
    return Schedule("dualpipev", Placement.vshape(R), m, tuple(ranks))
