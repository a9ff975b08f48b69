"""Metrics of a timeline: makespan, idle time, the two bubble measures, memory and traffic.

Bubble, two ways (both reported; docs/formulas.md, "Bubble measures"):

- absolute: ``max over ranks of (makespan - busy) / makespan``, the idle share of the most idle
  rank over the whole step. With equal work on every rank this is ``(makespan - work) / makespan``.
- span: the same with the makespan replaced by the longest per-rank span (first op to last op),
  which assumes the next step's warm-up overlaps this step's tail (zero-bubble papers use it).

``done_per_rank`` says when each stage a rank stores ran its last op of the step (from the
step's start): its gradients are complete then, and its data-parallel reduction can start while
the rest of the pipeline is still in its cool-down.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cutpipe.schedule.codes import KIND_BITS
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
    done_per_rank: list[list[float]]  # per rank, each stage it stores (``stages_of`` order)
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


def stages_done(timeline: Timeline, rank: int) -> list[float]:
    """When each stage ``rank`` stores (``Placement.stages_of`` order) ran its last op, from the
    timeline's start: the stage's weight gradients are complete then (its last W, full backward
    or overlapped pair). Read from the rank's last ops back, on the packed codes: a planner
    asks this of hundreds of long schedules."""
    schedule = timeline.schedule
    stages = schedule.placement.stages_of(rank)
    codec, begin = schedule.codec, timeline.begin
    last: dict[int, float] = {}
    ends = reversed(timeline.ends[rank])
    for code, end in zip(reversed(schedule.codes[rank]), ends, strict=True):
        for unit in codec.split_pair(code) if code < 0 else (code,):
            last.setdefault((unit >> KIND_BITS) % codec.num_stages, end)
        if len(last) == len(stages):
            break
    return [last.get(stage, begin) - begin for stage in stages]


def _idle(makespan: float, busy: list[float], spans: list[float]) -> dict:
    """Idle time per rank and the two bubble measures (see the module)."""
    longest, least_busy = max(spans), min(busy)
    return {
        "idle_per_rank": [makespan - b for b in busy],
        "bubble_ratio": (makespan - least_busy) / makespan if makespan else 0.0,
        "bubble_ratio_span": (longest - least_busy) / longest if longest else 0.0,
    }


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
        span_per_rank=spans,
        done_per_rank=[stages_done(timeline, r) for r in range(R)],
        **_idle(makespan, busy, spans),
        peak_activations_per_rank=peak_activations(schedule, costs),
        params_per_rank=schedule.placement.parameter_shares(params),
        p2p_sends=sends,
        p2p_bytes=sends * costs.p2p_bytes,
        ep_alltoalls=alltoalls,
        ep_alltoalls_overlapped=2 * overlapped_pairs(schedule),
        ep_bytes=alltoalls * costs.ep_bytes,
    )


def extrapolate(small: Metrics, large: Metrics, microbatches: int) -> Metrics:
    """The metrics of the same schedule with ``microbatches``, from two runs of it with fewer.

    Past its warm-up a schedule repeats one period per microbatch, so times, counts and bytes
    grow linearly with the microbatch count while the memory peaks stay: a planner that weighs
    hundreds of layouts simulates two short steps instead of one long one (checked against
    full simulations in tests/test_plan_search.py)."""
    span = large.microbatches - small.microbatches
    if span <= 0 or small.ranks != large.ranks:
        raise ValueError("extrapolate needs two runs of one schedule, the second longer")
    step = (microbatches - large.microbatches) / span

    def grow(a: float, b: float) -> float:
        return b + (b - a) * step

    def grow_all(a: list[float], b: list[float]) -> list[float]:
        return [grow(x, y) for x, y in zip(a, b, strict=True)]

    busy = grow_all(small.busy_per_rank, large.busy_per_rank)
    makespan = max(grow(small.makespan, large.makespan), *busy)  # never below the busiest
    spans = grow_all(small.span_per_rank, large.span_per_rank)
    return Metrics(
        schedule=large.schedule,
        ranks=large.ranks,
        stages=large.stages,
        microbatches=microbatches,
        makespan=makespan,
        busy_per_rank=busy,
        span_per_rank=spans,
        done_per_rank=[
            grow_all(a, b) for a, b in zip(small.done_per_rank, large.done_per_rank, strict=True)
        ],
        **_idle(makespan, busy, spans),
        peak_activations_per_rank=large.peak_activations_per_rank,
        params_per_rank=large.params_per_rank,
        p2p_sends=round(grow(small.p2p_sends, large.p2p_sends)),
        p2p_bytes=grow(small.p2p_bytes, large.p2p_bytes),
        ep_alltoalls=round(grow(small.ep_alltoalls, large.ep_alltoalls)),
        ep_alltoalls_overlapped=round(
            grow(small.ep_alltoalls_overlapped, large.ep_alltoalls_overlapped)
        ),
        ep_bytes=grow(small.ep_bytes, large.ep_bytes),
    )
