"""One candidate of ``recommend`` simulated: a layout of a job, under one training setting.

The layout's stages are balanced by compute (embedding and head included, each possibly a stage
of its own), its memory checked, and its step simulated (see ``recommend``'s module for the
step time and memory measures), or it is a ``Rejected`` with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from cutpipe.plan.costs.hardware import Hardware
from cutpipe.plan.costs.model import (
    PLAIN,
    ItemCost,
    Training,
    model_items,
    optimizer_time,
    p2p_time,
    w_memory,
)
from cutpipe.plan.partition import (
    groups,
    rank_balanced_sizes,
    rank_memory,
    stage_costs,
    stage_state_bytes,
)
from cutpipe.plan.recommend.breakdown import (
    Rank,
    busiest_of,
    receives,
    step_breakdown,
    utilisation,
)
from cutpipe.plan.recommend.explain import over_memory, too_few_items
from cutpipe.plan.recommend.footprint import buffer_bytes, footprint
from cutpipe.plan.recommend.job import Job, Layout
from cutpipe.plan.recommend.plans import Plan, Rejected
from cutpipe.plan.recommend.settings import Search
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.registry import schedule_info
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs
from cutpipe.sim.metrics import Metrics, extrapolate, metrics
from cutpipe.sim.simulate import simulate

NEAR_MISS = 1.25  # a compute-balanced split this far over the memory gets a memory-aware one
#: ``evaluate`` simulates at most this many microbatches per rank and extrapolates beyond.
SIMULATED_PER_RANK = 8
SIMULATED_AT_LEAST = 16  # a V's warm-up settles later on few ranks


def job_items(job: Job, ep: int, training: Training = PLAIN) -> list[ItemCost]:
    """The job's cost items (embedding, layers, head) with experts over ``ep`` ranks: from the
    analytic model, or measured (its compute as profiled; ZeRO still shards the state)."""
    hardware = job.hardware
    within = ep * training.tp <= hardware.gpus_per_node
    if job.profile is None:
        return model_items(job.model, hardware, ep, ep_within_node=within, training=training)
    state = training.state_bytes_per_parameter
    experts = training.state_bytes_over(training.replicas(ep))
    return [
        replace(item, bytes_per_parameter=state, expert_bytes_per_parameter=experts)
        for item in job.profile.items_for(hardware, ep, ep_within_node=within)
    ]


def check_layout(job: Job, layout: Layout, training: Training) -> None:
    """A TypeError or ValueError if ``layout`` under ``training`` is not a split of ``job``'s
    devices (a setting's TP is the layout's, and ZeRO shards over its DP)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a Layout, got {layout!r}")
    if not isinstance(training, Training):
        raise TypeError(f"training must be a Training, got {training!r}")
    if training.tp != layout.tp:
        raise ValueError(f"the layout has TP={layout.tp}, its training setting TP={training.tp}")
    if training.cp != layout.cp:
        raise ValueError(f"the layout has CP={layout.cp}, its training setting CP={training.cp}")
    if training.zero and training.dp != layout.dp:
        raise ValueError(
            f"ZeRO-{training.zero} shards over the layout's DP={layout.dp}, but the training "
            f"setting says dp={training.dp}: give Training(zero={training.zero}, dp={layout.dp})"
        )
    if layout.devices != job.devices:
        raise ValueError(
            f"PP={layout.pp} x DP={layout.dp} x TP={layout.tp} x CP={layout.cp} is "
            f"{layout.devices} devices, the "
            f"job has {job.devices}: give a layout of all of them"
        )


def evaluate(
    job: Job, layout: Layout, training: Training = PLAIN, rebalance: bool = True,
    cache: dict | None = None, split_idle: bool = True,
) -> Plan | Rejected:  # fmt: skip
    """Simulate one candidate; a ``Rejected`` with the reason where it cannot run or fit.

    ``training``: the ZeRO stage (over the layout's DP), recompute, precision and TP (the
    layout's). ``rebalance``: whether a split within ``NEAR_MISS`` of the memory gets a
    memory-aware one; ``cache`` keeps items, schedules and compute-balanced splits between
    calls. ``split_idle``: simulate the step once more without transfer time, to split the
    busiest rank's idle time into pipeline sends and bubble (``Plan.breakdown``); without it
    the sends are estimated (``plan.recommend.breakdown``)."""
    check_layout(job, layout, training)
    model, hardware, capacity = job.model, job.hardware, job.capacity
    pp, dp, ep, m = layout.pp, layout.dp, layout.ep, layout.microbatches
    info = schedule_info(layout.schedule)
    items = _memo(cache, ("items", ep, training), lambda: job_items(job, ep, training))
    buffers = buffer_bytes(model, training, pp, ep)

    def rejected(reason: str, excess: float = 0.0) -> Rejected:
        return layout.refused(reason, excess, training)

    stages = pp * info.stages_per_rank
    if stages > len(items):
        return rejected(too_few_items(stages, pp, len(items)))
    short_m, long_m = simulated_counts(info, pp, m)
    # a short step peaks as high as the whole one
    schedule = _memo(
        cache, ("schedule", info.spec, pp, short_m), lambda: info.generate(pp, short_m)
    )
    # the training state alone, however split: the average rank's share of every copy
    floor = sum(item.state_bytes for item in items) * len(schedule.placement.pipes) / pp
    if floor + buffers > capacity:
        need = floor + buffers
        reason = (
            f"needs at least {need / 1e9:.1f} GB per rank for the training state alone, "
            f"{capacity / 1e9:.1f} GB usable ({(need - capacity) / 1e9:.1f} GB over)"
        )
        return rejected(reason, need - capacity)
    comm = p2p_time(model, hardware, job.within_node, training)
    kept = job.profile.w_memory if job.profile else w_memory(model)

    def weigh(sizes: list[int]) -> tuple[Costs, list[float]]:
        costs = stage_costs(items, sizes, comm, kept)
        state = stage_state_bytes(items, sizes)
        return costs, [m + buffers for m in rank_memory(schedule, costs, state)]

    work = tuple(item.forward + item.backward + item.weight for item in items)
    sizes = _memo(
        cache, ("split", info.spec, pp, work), lambda: rank_balanced_sizes(items, schedule)
    )
    costs, memory = weigh(sizes)
    if max(memory) > capacity:
        if not rebalance or max(memory) > NEAR_MISS * capacity:
            return rejected(over_memory(memory, capacity), max(memory) - capacity)
        # move layers off the fullest ranks
        sizes = rank_balanced_sizes(items, schedule, capacity - buffers, comm, kept)
        costs, memory = weigh(sizes)
        if max(memory) > capacity:
            return rejected(over_memory(memory, capacity), max(memory) - capacity)
    result = metrics(simulate(schedule, costs), costs)
    if long_m is not None:
        long = _memo(cache, ("schedule", info.spec, pp, long_m), lambda: info.generate(pp, long_m))
        longer = metrics(simulate(long, costs), costs)
        result = extrapolate(result, longer, m)
    bandwidth, latency = hardware.link(within_node=job.within_node)
    parts = groups(items, sizes)
    experts = [sum(i.expert_parameters for i in part) for part in parts]
    dense = [sum(i.parameters for i in part) - e for part, e in zip(parts, experts, strict=True)]

    # ZeRO-1/2 reduce-scatter the gradients and all-gather the weights: an all-reduce's volume;
    # ZeRO-3 gathers its weights in every pass instead, and only reduce-scatters here
    share = 0.5 if training.zero == 3 else 1.0

    def allreduce_on(rank: int) -> float:  # every stage the rank stores, DualPipe's copies too
        held = schedule.placement.stages_of(rank)
        grad = model.element_bytes
        return share * (
            ring_allreduce(sum(dense[s] for s in held) * grad, dp, bandwidth, latency)
            + ring_allreduce(sum(experts[s] for s in held) * grad, dp // ep, bandwidth, latency)
        )

    def optimizer_on(rank: int) -> float:
        held = schedule.placement.stages_of(rank)
        routed = sum(experts[s] for s in held)
        total = sum(dense[s] for s in held) + routed
        return optimizer_time(total, hardware, training, routed, ep)

    allreduces = [allreduce_on(rank) for rank in range(pp)]
    tails = [a + optimizer_on(rank) for rank, a in enumerate(allreduces)]
    measure = job.step_measure
    if measure == "makespan":  # every rank waits for the slowest all-reduce and optimizer step
        critical = max(range(pp), key=tails.__getitem__)
        step = result.makespan + tails[critical]
    else:  # each rank steps after its own span, all-reduce and optimizer; the longest sets the pace
        ends = [span + tail for span, tail in zip(result.span_per_rank, tails, strict=True)]
        critical = max(range(pp), key=ends.__getitem__)
        step = ends[critical]
    allreduce = allreduces[critical]
    busiest = max(range(pp), key=lambda r: result.busy_per_rank[r])
    sends = result.p2p_sends / pp
    exposed_ep = (
        sum(
            costs.per_stage("ep_f", schedule.num_stages)[s]
            + costs.per_stage("ep_b", schedule.num_stages)[s]
            for s in schedule.placement.stages_of(busiest)
        )
        * m
        * (1 - result.ep_alltoalls_overlapped / max(1, result.ep_alltoalls))
    )
    comm_time = sends * (comm - latency) + exposed_ep + allreduce
    tokens = model.tokens * m * dp
    fullest = max(range(pp), key=memory.__getitem__)
    stored = schedule.placement.stages_of(fullest)
    routed = sum(experts[s] for s in stored)
    held = sum(dense[s] for s in stored) + routed
    state = sum(stage_state_bytes(items, sizes)[s] for s in stored)
    where = footprint(held, memory[fullest] - state - buffers, training, buffers, routed, ep)
    rank = busiest_rank(result, schedule.placement, m, measure, allreduces, tails)
    if split_idle and comm:
        quiet = replace(costs, comm=0.0)
        runs = [schedule] + ([] if long_m is None else [long])
        rank = replace(rank, quiet=_pipeline_time(runs, quiet, m, measure, rank.index))
    parts = step_breakdown(
        lambda t, variant: _items_on(job, ep, t, variant, cache), training, hardware, sizes,
        schedule.placement, m, rank, comm, step,
    )  # fmt: skip
    flops = utilisation(model, hardware, training, tokens / step, job.devices)
    return Plan(pp, dp, ep, layout.schedule, m, step, tokens / step, rank_bubble(rank),
                max(memory), min(1.0, comm_time / step), sizes, measure, training, where,
                *flops, parts, rank.index)  # fmt: skip


def simulated_counts(info, pp: int, microbatches: int) -> tuple[int, int | None]:
    """The microbatch counts ``evaluate`` simulates: the step itself when it is short, else a
    short step and one a period longer, whose difference ``extrapolate`` carries to the whole
    (each the least count at least that long that the schedule accepts)."""

    def accepted(least: int) -> int:
        return next(k for k in range(least, least + 4 * pp + 8) if info.accepts(pp, k))

    short = accepted(max(SIMULATED_PER_RANK * pp, SIMULATED_AT_LEAST, info.min_microbatches(pp)))
    if microbatches <= 2 * short:
        return microbatches, None
    return short, accepted(2 * short)


def _memo(cache: dict | None, key: tuple, make: Callable[[], Any]) -> Any:
    """``make()``, once per ``key`` in ``cache`` (every time without one)."""
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


def throughput_bound(job: Job, layout: Layout, search: Search, cache: dict) -> float:
    """Tokens/s no setting of ``layout`` can beat: every rank busy all the time with its share
    of the least work (no recompute, no ZeRO-3 gathers), nothing else in the step."""
    pp, dp, ep, m = layout.pp, layout.dp, layout.ep, layout.microbatches
    least = search.training(0, dp, "none", layout.tp)
    items = _memo(cache, ("items", ep, least), lambda: job_items(job, ep, least))
    step = m * sum(item.forward + item.backward + item.weight for item in items) / pp
    return job.model.tokens * m * dp / step


def ring_allreduce(size: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds for a ring all-reduce of ``size`` bytes over ``ranks``."""
    if ranks <= 1 or size == 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * size / bandwidth + 2 * (ranks - 1) * latency


def _items_on(
    job: Job, ep: int, training: Training, hardware: Hardware | None, cache: dict | None
) -> list[ItemCost]:
    """``job_items`` on a variant of the job's hardware (None: its own), kept in ``cache``."""
    if hardware is None:
        return _memo(cache, ("items", ep, training), lambda: job_items(job, ep, training))
    on = replace(job, hardware=hardware)
    return _memo(cache, ("items", ep, training, hardware), lambda: job_items(on, ep, training))


def busiest_rank(
    result: Metrics, placement: Placement, microbatches: int, measure: str,
    reductions: list[float], tails: list[float],
) -> Rank:  # fmt: skip
    """The rank with the most busy time, as ``step_breakdown`` and the bubble see it."""
    index = busiest_of(result)
    return Rank(
        index,
        busy=result.busy_per_rank[index],
        pipeline=result.makespan if measure == "makespan" else result.span_per_rank[index],
        receives=receives(placement, index, microbatches),
        reduction=reductions[index],
        optimizer=tails[index] - reductions[index],
    )


def _pipeline_time(
    schedules: list[Schedule], costs: Costs, microbatches: int, measure: str, rank: int
) -> float:
    """The makespan (or ``rank``'s span) of the step under ``costs``: the short schedule's, or
    extrapolated from it and the one a period longer."""
    result = metrics(simulate(schedules[0], costs), costs)
    if len(schedules) > 1:
        result = extrapolate(result, metrics(simulate(schedules[1], costs), costs), microbatches)
    return result.makespan if measure == "makespan" else result.span_per_rank[rank]


def rank_bubble(rank: Rank) -> float:
    """The idle share of the rank's pipeline time: ``1 - busy / makespan`` (or ``/ span``)."""
    return max(0.0, 1 - rank.busy / rank.pipeline) if rank.pipeline else 0.0
