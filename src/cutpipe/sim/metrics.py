"""Metrics of a timeline: makespan, idle time, the two bubble measures, memory and traffic.

Bubble, two ways (both reported; docs/formulas.md, "Bubble measures"):

- absolute: ``max over ranks of (makespan - busy) / makespan``, the idle share of the most idle
  rank over the whole step. With equal work on every rank this is ``(makespan - work) / makespan``.
- span: the same with the makespan replaced by the longest per-rank span (first op to last op),
  which assumes the next step's warm-up overlaps this step's tail (zero-bubble papers use it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.timeline import Timeline


@dataclass(frozen=True)
class Metrics:
    """What one step of a schedule costs. Times are in the timeline's unit."""

    schedule: str
    ranks: int
    stages: int
    microbatches: int
    makespan: float
    busy_per_rank: list[float]
    idle_per_rank: list[float]
    span_per_rank: list[float]
    bubble_ratio: float
    bubble_ratio_span: float
    peak_activations_per_rank: list[float]
    params_per_rank: list[float]
    p2p_sends: int
    p2p_bytes: float
    ep_alltoalls: int
    ep_alltoalls_overlapped: int
    ep_bytes: float

    def to_dict(self) -> dict:
        return asdict(self)


def p2p_sends(schedule: Schedule) -> int:
    """Tensors crossing ranks in one step: each microbatch's activation forward, gradient back."""
    placement, m = schedule.placement, schedule.num_microbatches
    return sum(
        2
        * len(placement.microbatches_of(pipe, m))
        * sum(placement.is_cross_rank(pipe, s) for s in range(schedule.num_stages - 1))
        for pipe in range(placement.num_pipes)
    )


def overlapped_pairs(schedule: Schedule) -> int:
    """How many overlapped F&B pairs the schedule runs (pairs are the negative codes)."""
    return sum(sum(map((0).__gt__, ops)) for ops in schedule.codes)


def metrics(timeline: Timeline, costs: Costs | None = None) -> Metrics:
    """Summarise a simulated or measured timeline; ``costs`` gives the memory and size model."""
    if not isinstance(timeline, Timeline):
        raise TypeError(
            f"metrics takes a Timeline (e.g. simulate(schedule)), got {type(timeline).__name__}"
        )
    if costs is not None and not isinstance(costs, Costs):
        raise TypeError(f"metrics' costs must be a Costs or None, got {costs!r}")
    costs = costs or Costs()
    schedule = timeline.schedule
    R, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    makespan = timeline.makespan
    busy = [timeline.busy(r) for r in range(R)]
    spans = [timeline.span(r) for r in range(R)]
    longest = max(spans)
    least_busy = min(busy)
    sends = p2p_sends(schedule)
    alltoalls = 2 * S * m  # one per F and one per backward
    params = costs.params and list(costs.params)
    return Metrics(
        schedule=schedule.name,
        ranks=R,
        stages=S,
        microbatches=m,
        makespan=makespan,
        busy_per_rank=busy,
        idle_per_rank=[makespan - b for b in busy],
        span_per_rank=spans,
        bubble_ratio=(makespan - least_busy) / makespan if makespan else 0.0,
        bubble_ratio_span=(longest - least_busy) / longest if longest else 0.0,
        peak_activations_per_rank=peak_activations(schedule, costs),
        params_per_rank=schedule.placement.parameter_shares(params),
        p2p_sends=sends,
        p2p_bytes=sends * costs.p2p_bytes,
        ep_alltoalls=alltoalls,
        ep_alltoalls_overlapped=2 * overlapped_pairs(schedule),
        ep_bytes=alltoalls * costs.ep_bytes,
    )
