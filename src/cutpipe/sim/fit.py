"""A cost model read off a measured timeline: per stage, the median time of each kind of op.

Simulating a schedule with these costs predicts its step with the measured op times and no
communication or runtime overhead; the gap to the measured timeline is what those add.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from cutpipe.schedule.actions import Kind, Overlap
from cutpipe.sim.costs import Costs
from cutpipe.sim.timeline import Timeline


def fitted_costs(timeline: Timeline, base: Costs | None = None) -> Costs:
    """Costs whose per-stage F, B, W and F&B times are the medians measured in ``timeline``.

    A stage that only ran full backwards gets its BW time as B and no W (the simulator charges
    B + W for a BW). Memory and size fields come from ``base``.
    """
    base = base or Costs()
    S = timeline.schedule.num_stages
    times: dict[tuple[Kind, int], list[float]] = defaultdict(list)
    pairs: list[float] = []
    for rank in range(timeline.num_ranks):
        for op, start, end in timeline.events(rank):
            if type(op) is Overlap:
                pairs.append(end - start)
            else:
                times[op.kind, op.stage].append(end - start)

    def median(kind: Kind, stage: int) -> float | None:
        values = times.get((kind, stage))
        return statistics.median(values) if values else None

    f, b, w = [], [], []
    for stage in range(S):
        f.append(median(Kind.F, stage) or 0.0)
        split_b, split_w, full = (
            median(Kind.B, stage),
            median(Kind.W, stage),
            median(Kind.BW, stage),
        )
        if split_b is not None:
            b.append(split_b)
            w.append(split_w or 0.0)
        else:
            b.append(full or 0.0)
            w.append(0.0)
    return Costs(
        f=f, b=b, w=w, fb=statistics.median(pairs) if pairs else None, comm=0.0,
        activation=base.activation, w_memory=base.w_memory, params=base.params,
        p2p_bytes=base.p2p_bytes, ep_bytes=base.ep_bytes,
    )  # fmt: skip
