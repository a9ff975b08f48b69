"""How soon each rank's first gradient can come back: what the list scheduler's warm-up rule and
the warm-up lower bound (``bounds.warmup_span_lower_bound``) both measure a rank's warm-up by."""

from __future__ import annotations

import math

from cutpipe.schedule.placement import Placement
from cutpipe.sim.costs import Costs


def round_trips(placement: Placement, costs: Costs) -> list[float]:
    """Per rank: from the start of its first forward to the earliest its first gradient can
    arrive, if nothing else holds up that microbatch on its way to the loss and back."""
    S, c = placement.num_stages, costs.comm
    f = [x + e for x, e in zip(costs.per_stage("f", S), costs.per_stage("ep_f", S), strict=True)]
    b = [x + e for x, e in zip(costs.per_stage("b", S), costs.per_stage("ep_b", S), strict=True)]
    owner = placement.pipes[0]
    starts, ready = [0.0] * S, [0.0] * S
    for s in range(1, S):
        starts[s] = starts[s - 1] + f[s - 1] + (c if owner[s] != owner[s - 1] else 0.0)
    ready[S - 1] = starts[S - 1] + f[S - 1]
    for s in range(S - 2, -1, -1):
        ready[s] = ready[s + 1] + b[s + 1] + (c if owner[s] != owner[s + 1] else 0.0)
    trips = [math.inf] * placement.num_ranks
    first = [math.inf] * placement.num_ranks
    for s in range(S):
        first[owner[s]] = min(first[owner[s]], starts[s])
        trips[owner[s]] = min(trips[owner[s]], ready[s])
    return [t - a for t, a in zip(trips, first, strict=True)]
