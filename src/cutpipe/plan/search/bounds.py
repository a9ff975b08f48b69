"""How short any V-shape step can be under a memory cap: a yardstick for the cost-aware search.

The argument follows the tip rank (R-1, which holds stages R-1 and R). Its first forward cannot
start before R-1 forwards and hops, and its first gradient cannot arrive before one microbatch
has gone around the whole V, so until then it can run only forwards, as many as the cap holds.
Before its last forward of stage R it must have run the other 2m-1 forwards and, to keep that
forward under the cap, freed enough memory with backwards and weight passes. That last
forward's microbatch must then still travel up the V and back down to rank 0, whose span
(first forward to last op) is therefore at least the sum. With F = 14407, B = 14380, W = 9676,
comm = 1610 us, R = 16, m = 48 and R x M_B memory this gives a span bubble of 0.069724.
"""

from __future__ import annotations

import math
from contextlib import suppress

from cutpipe.plan.search.round_trips import round_trips
from cutpipe.records import check_count
from cutpipe.schedule.placement import Placement
from cutpipe.sim.costs import Costs


def _uniform(costs: Costs, name: str, stages: int) -> float:
    values = set(costs.per_stage(name, stages))
    if len(values) != 1:
        raise ValueError(
            f"the V lower bound needs one {name} for every stage, got {sorted(values)}"
        )
    return values.pop()


def v_span_lower_bound(ranks: int, microbatches: int, costs: Costs, cap: float) -> float:
    """The least possible longest per-rank span of a V-shape schedule (2 chunks per rank).

    ``cap`` is the activation memory per rank, in the units of ``costs.activation``. Costs must
    be the same for every stage, with no expert-parallel time and no F&B overlap faster than
    F + B (the bound counts an overlapped pair as F then B).
    """
    if ranks < 1 or microbatches < 1:
        raise ValueError(f"need ranks >= 1 and microbatches >= 1, got {ranks} and {microbatches}")
    if not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0):
        raise ValueError(f"cap must be a positive finite number of activations, got {cap!r}")
    S = 2 * ranks
    f, b, w = (_uniform(costs, name, S) for name in ("f", "b", "w"))
    activation = _uniform(costs, "activation", S)
    if any(costs.per_stage(name, S) != [0.0] * S for name in ("ep_f", "ep_b")):
        raise ValueError("the V lower bound assumes no expert-parallel all-to-all time")
    if costs.fb is not None and costs.fb < f + b:
        raise ValueError(f"the V lower bound assumes an F&B pair takes F + B; fb={costs.fb}")
    c, k, m, R = costs.comm, costs.w_memory, microbatches, ranks
    work = 2 * m * (f + b + w)
    if R == 1:
        return work
    units = cap / activation if activation else math.inf  # activations the cap holds
    others = 2 * m - 1  # forwards the tip runs before its last forward of stage R
    tip_start = (R - 1) * (f + c)
    first_gradient = tip_start + 2 * f + (R - 1) * (f + b + 2 * c)
    to_free = 2 * m - units  # activation units to free before that last forward
    if to_free <= 0:
        last_forward = tip_start + others * f
    else:
        per_unit = b + w if k >= 1 else min(b / (1 - k), b + w)  # B alone, or B with its W
        freeing = to_free * per_unit
        before_gradient = min(others, math.floor(units + 1e-9))
        last_forward = max(
            tip_start + others * f + freeing,
            first_gradient + (others - before_gradient) * f + freeing,
        )
    up_and_down = f + (R - 1) * (f + c) + b + 2 * (R - 1) * (b + c) + b + w
    return max(work, last_forward + up_and_down)


def v_bubble_lower_bound(ranks: int, microbatches: int, costs: Costs, cap: float) -> float:
    """The least possible span bubble ratio of a V-shape schedule, from ``v_span_lower_bound``."""
    span = v_span_lower_bound(ranks, microbatches, costs, cap)
    return span_bubble(span, Placement.vshape(ranks), microbatches, costs)


def warmup_span_lower_bound(placement: Placement, microbatches: int, costs: Costs,
                            cap: float) -> float:  # fmt: skip
    """The least possible longest per-rank span of any schedule on ``placement``.

    A rank's span is its work plus its idle time, and its idle time is at least its warm-up
    gap: from its first op (a forward) until its first gradient can arrive (``round_trips``)
    it can run only forwards (no W before a B), at most as many as the cap holds, since nothing
    is freed before that gradient. On the zero-bubble paper's linear setting (R = 16, m = 48,
    two-chunk stages) at 1.5 times 1F1B's memory it gives a span bubble of 0.0632, the figure
    of the paper's automatic scheduler there.
    """
    check_count(microbatches, "warm-up bound: microbatches")
    if not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0):
        raise ValueError(f"cap must be a positive finite number of activations, got {cap!r}")
    if placement.num_pipes != 1:
        raise ValueError("the warm-up bound follows one pipe; a bidirectional placement has two")
    if costs.fb is not None:
        raise ValueError(f"the warm-up bound counts an F&B pair as F then B; fb={costs.fb}")
    S = placement.num_stages
    f, b, w, ep_f, ep_b, activation = (
        costs.per_stage(name, S) for name in ("f", "b", "w", "ep_f", "ep_b", "activation")
    )
    trips = round_trips(placement, costs)
    longest = 0.0
    for rank in range(placement.num_ranks):
        stages = placement.stages_of(rank)
        work = microbatches * sum(f[s] + b[s] + w[s] + ep_f[s] + ep_b[s] for s in stages)
        lightest = min(activation[s] for s in stages)
        room = math.floor(cap / lightest + 1e-9) if lightest > 0 else math.inf
        forwards = min(microbatches * len(stages), room)
        gap = trips[rank] - forwards * min(f[s] + ep_f[s] for s in stages)
        longest = max(longest, work + max(0.0, gap))
    return longest


def span_bubble(span: float, placement: Placement, microbatches: int, costs: Costs) -> float:
    """The span bubble ratio of a longest span ``span``: (span - least busy rank's work) / span."""
    S = placement.num_stages
    per_stage = [
        sum(v)
        for v in zip(*(costs.per_stage(n, S) for n in ("f", "b", "w", "ep_f", "ep_b")), strict=True)
    ]
    least = min(
        microbatches * sum(per_stage[s] for s in placement.stages_of(r))
        for r in range(placement.num_ranks)
    )
    return (span - least) / span if span else 0.0


def bubble_lower_bound(placement: Placement, microbatches: int, costs: Costs,
                       cap: float) -> float:  # fmt: skip
    """The best span bubble bound this module proves for ``placement`` under ``cap``: the
    warm-up bound, and on a V also the V bound, whichever is larger; 0.0 where neither holds
    (overlapped pairs that may beat F then B, two pipes)."""
    if costs.fb is not None or placement.num_pipes != 1:
        return 0.0
    span = warmup_span_lower_bound(placement, microbatches, costs, cap)
    bound = span_bubble(span, placement, microbatches, costs)
    if placement.kind == "v":
        with suppress(ValueError):  # per-stage or expert-parallel costs: no V bound
            bound = max(bound, v_bubble_lower_bound(placement.num_ranks, microbatches, costs, cap))
    return bound
