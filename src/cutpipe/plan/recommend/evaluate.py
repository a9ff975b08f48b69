"""One candidate of ``recommend`` simulated: a layout of a job, under one training setting.

The layout's stages are balanced by compute (embedding and head included, each possibly a stage
of its own), its memory checked, and its step simulated (see ``recommend``'s module for the
step time and memory measures), or it is a ``Rejected`` with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields, replace
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
from cutpipe.plan.recommend.reduction import Tail, rank_tails
from cutpipe.plan.recommend.settings import Search
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.registry import schedule_info
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import live_profile, peak_activations
from cutpipe.sim.metrics import Metrics, extrapolate, metrics
from cutpipe.sim.simulate import simulate

NEAR_MISS = 1.25  # a compute-balanced split this far over the memory gets a memory-aware one
#: ``evaluate`` simulates at most this many microbatches per rank and extrapolates beyond.
SIMULATED_PER_RANK = 8
SIMULATED_AT_LEAST = 16  # a V's warm-up settles later on few ranks
#: ``throughput_bound``'s margin over float rounding in the steps it is compared with.
BOUND_ROUNDING = 1e-9


def job_items(job: Job, ep: int, training: Training = PLAIN) -> list[ItemCost]:
    """The job's cost items (embedding, layers, head) with experts over ``ep`` ranks: from the
    analytic model, or measured (its compute as profiled; ZeRO still shards the state)."""
    hardware = job.hardware
    # EP groups sit outside TP and CP: ranks ``tp*cp`` apart
    within = ep * training.tp * training.cp <= hardware.gpus_per_node
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
    cache: dict | None = None, split_idle: bool = True, *, screened: bool = True,
) -> Plan | Rejected:  # fmt: skip
    """Simulate one candidate; a ``Rejected`` with the reason where it cannot run or fit.

    ``training``: the ZeRO stage (over the layout's DP), recompute, precision and TP (the
    layout's). ``rebalance``: whether a split within ``NEAR_MISS`` of the memory gets a
    memory-aware one; ``cache`` keeps items, schedules, compute-balanced splits, activation
    peaks and simulations between calls (settings and layouts that differ only in what the
    simulator does not read, such as ZeRO or DP at one pipeline shape, share them).
    ``split_idle``: simulate the step once more without transfer time, to split the
    busiest rank's idle time into pipeline sends and bubble (``Plan.breakdown``); without it
    the sends are estimated (``plan.recommend.breakdown``). ``screened``: the balancer weighs
    its moves in batches (``rank_balanced_sizes``); False scores each alone, the reference it
    matches."""
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
    # the training state alone, however split: the average rank's share of every copy
    placement = _memo(cache, ("placement", info.spec, pp), lambda: placement_of(info, pp))
    floor = sum(item.state_bytes for item in items) * len(placement.pipes) / pp
    if floor + buffers > capacity:
        need = floor + buffers
        reason = (
            f"needs at least {need / 1e9:.1f} GB per rank for the training state alone, "
            f"{capacity / 1e9:.1f} GB usable ({(need - capacity) / 1e9:.1f} GB over)"
        )
        return rejected(reason, need - capacity)
    # a short step peaks as high as the whole one
    schedule = _memo(
        cache, ("schedule", info.spec, pp, short_m), lambda: info.generate(pp, short_m)
    )
    comm = p2p_time(model, hardware, job.within_node, training)
    kept = job.profile.w_memory if job.profile else w_memory(model)

    def weigh(sizes: list[int]) -> tuple[Costs, list[float]]:
        costs = stage_costs(items, sizes, comm, kept)
        state = stage_state_bytes(items, sizes)
        peaks = _memo(
            cache, ("peaks", info.spec, pp, short_m, tuple(costs.activation), kept),
            lambda: peak_activations(schedule, costs),
        )  # fmt: skip
        return costs, [m + buffers for m in rank_memory(schedule, costs, state, peaks)]

    def simulated(count: int, costs: Costs) -> Metrics:
        """One step's metrics at ``count`` microbatches, once per schedule and costs."""
        run = _memo(cache, ("schedule", info.spec, pp, count), lambda: info.generate(pp, count))
        key = ("metrics", info.spec, pp, count, costs_key(costs))
        return _memo(cache, key, lambda: metrics(simulate(run, costs), costs))

    work = tuple(item.forward + item.backward + item.weight for item in items)
    sizes = _memo(
        cache, ("split", info.spec, pp, work),
        lambda: rank_balanced_sizes(items, schedule, screened=screened),
    )  # fmt: skip
    costs, memory = weigh(sizes)
    if max(memory) > capacity:
        if not rebalance or max(memory) > NEAR_MISS * capacity:
            return rejected(over_memory(memory, capacity), max(memory) - capacity)
        # move layers off the fullest ranks
        live = _memo(
            cache, ("live", info.spec, pp, short_m, kept), lambda: live_profile(schedule, kept)
        )
        sizes = rank_balanced_sizes(
            items, schedule, capacity - buffers, comm, kept, screened=screened, live=live
        )
        costs, memory = weigh(sizes)
        if max(memory) > capacity:
            return rejected(over_memory(memory, capacity), max(memory) - capacity)
    result = simulated(short_m, costs)
    if long_m is not None:
        result = extrapolate(result, simulated(long_m, costs), m)
    bandwidth, latency = hardware.link(within_node=job.within_node)
    parts = groups(items, sizes)
    experts = [sum(i.expert_parameters for i in part) for part in parts]
    dense = [sum(i.parameters for i in part) - e for part, e in zip(parts, experts, strict=True)]

    # ZeRO-1/2 reduce-scatter the gradients and all-gather the weights: an all-reduce's volume;
    # ZeRO-3 gathers its weights in every pass instead, and only reduce-scatters here
    share = 0.5 if training.zero == 3 else 1.0
    # the layout's DP: a setting's ``dp`` is only what ZeRO shards over, 1 without ZeRO
    ranks, replicas = layout.gradient_ranks
    grad = model.element_bytes

    def reduction(held: Sequence[int]) -> float:  # one collective over these stages' gradients
        return share * (
            ring_allreduce(sum(dense[s] for s in held) * grad, ranks, bandwidth, latency)
            + ring_allreduce(sum(experts[s] for s in held) * grad, replicas, bandwidth, latency)
        )

    def optimizer_on(rank: int) -> float:
        held = schedule.placement.stages_of(rank)
        routed = sum(experts[s] for s in held)
        total = sum(dense[s] for s in held) + routed
        return optimizer_time(total, hardware, training, routed, ep)

    measure = job.step_measure
    tails = rank_tails(result, schedule.placement, measure, job.reduction_start, reduction,
                       optimizer_on)  # fmt: skip
    steps = [_pipeline_of(result, measure, rank) + tail.exposed for rank, tail in enumerate(tails)]
    critical = max(range(pp), key=steps.__getitem__)
    step = steps[critical]
    allreduce = tails[critical].reduction
    rank = busiest_rank(result, schedule.placement, m, measure, tails)
    sends = result.p2p_sends / pp
    exposed_ep = (
        sum(
            costs.per_stage("ep_f", schedule.num_stages)[s]
            + costs.per_stage("ep_b", schedule.num_stages)[s]
            for s in schedule.placement.stages_of(rank.index)
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
    if split_idle and comm:
        quiet = replace(costs, comm=0.0)
        runs = [simulated(count, quiet) for count in (short_m, long_m) if count is not None]
        rank = replace(rank, quiet=_pipeline_time(runs, m, measure, rank.index))
    parts = step_breakdown(
        lambda t, variant: _items_on(job, ep, t, variant, cache), training, hardware, sizes,
        schedule.placement, m, rank, comm, step,
    )  # fmt: skip
    flops = utilisation(model, hardware, training, tokens / step, job.devices)
    return Plan(pp, dp, ep, layout.schedule, m, step, tokens / step, rank_bubble(rank),
                max(memory), min(1.0, comm_time / step), sizes, measure, training, where,
                *flops, parts, rank.index)  # fmt: skip


def costs_key(costs: Costs) -> tuple:
    """Every field of ``costs``, hashable: two costs with one key simulate alike."""
    return tuple(
        tuple(value) if isinstance(value, list) else value
        for value in (getattr(costs, field.name) for field in fields(costs))
    )


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
    of the setting's work; no bubble, no pipeline transfers, no exposed all-to-all; and, when
    steps synchronise, the average rank's optimizer step after it, and its gradient all-reduce
    (the bandwidth term) where none of it can hide (one stage per rank, or all of a rank's
    reduced after its last op).

    The busy times add up to the microbatches' F, B and W (an overlapped pair takes at least
    its two halves). A sync step is at least every rank's busy time, the reduction of its last
    stage (started after its last op) and its optimizer step (``rank_tails``), so at least the
    average rank's: both grow linearly with the parameters a rank stores. The overlap step is
    a rank's span plus its own: extrapolated spans can fall a little below the busy times they
    contain, and the all-reduce and optimizer step are the margin left for that."""
    pp, dp, ep, m = layout.pp, layout.dp, layout.ep, layout.microbatches
    info = schedule_info(layout.schedule)
    placement = _memo(cache, ("placement", info.spec, pp), lambda: placement_of(info, pp))
    copies = min(len(placement.copies(stage)) for stage in range(placement.num_stages))
    alone = all(len(placement.stages_of(rank)) == 1 for rank in range(pp))
    exposed = job.reduction_start == "rank" or alone
    bandwidth, _ = job.hardware.link(within_node=job.within_node)
    grad = job.model.element_bytes
    ranks, replicas = layout.gradient_ranks
    best = 0.0
    for group in search.settings(dp, layout.tp, pp):
        for training in group:
            items = _memo(cache, ("items", ep, training), lambda t=training: job_items(job, ep, t))
            work = sum(item.forward + item.backward + item.weight for item in items)
            stored = copies * sum(item.parameters for item in items) / pp
            routed = copies * sum(item.expert_parameters for item in items) / pp
            share = 0.5 if training.zero == 3 else 1.0
            allreduce = share * (
                ring_bandwidth_term((stored - routed) * grad, ranks, bandwidth)
                + ring_bandwidth_term(routed * grad, replicas, bandwidth)
            )
            optimizer = optimizer_time(stored, job.hardware, training, routed, ep)
            step = m * work / pp
            if job.step_measure == "makespan":
                step += allreduce * exposed + optimizer
            best = max(best, job.model.tokens * m * dp / step)
    return best * (1 + BOUND_ROUNDING)


def placement_of(info, pp: int) -> Placement:
    """Where the schedule puts its stages on ``pp`` ranks, from its shortest step: the
    placement does not depend on the microbatches."""
    return info.generate(pp, info.min_microbatches(pp)).placement


def ring_bandwidth_term(size: float, ranks: int, bandwidth: float) -> float:
    """``ring_allreduce`` without its latency: linear in ``size``, and never more than it."""
    return 2 * (ranks - 1) / ranks * size / bandwidth if ranks > 1 else 0.0


def ring_allreduce(size: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds for a ring all-reduce of ``size`` bytes over ``ranks``."""
    if ranks <= 1 or size == 0:
        return 0.0
    return ring_bandwidth_term(size, ranks, bandwidth) + 2 * (ranks - 1) * latency


def _items_on(
    job: Job, ep: int, training: Training, hardware: Hardware | None, cache: dict | None
) -> list[ItemCost]:
    """``job_items`` on a variant of the job's hardware (None: its own), kept in ``cache``."""
    if hardware is None:
        return _memo(cache, ("items", ep, training), lambda: job_items(job, ep, training))
    on = replace(job, hardware=hardware)
    return _memo(cache, ("items", ep, training, hardware), lambda: job_items(on, ep, training))


def busiest_rank(
    result: Metrics, placement: Placement, microbatches: int, measure: str, tails: list[Tail]
) -> Rank:
    """The rank with the most busy time, as ``step_breakdown`` and the bubble see it, with the
    tail the step waits for after the pipeline: when steps synchronise, that of the rank whose
    reduction and optimizer step end last; when they overlap, its own."""
    index = busiest_of(result)
    tail = tails[index] if measure == "span" else max(tails, key=lambda t: t.exposed)
    return Rank(
        index,
        busy=result.busy_per_rank[index],
        pipeline=_pipeline_of(result, measure, index),
        receives=receives(placement, index, microbatches),
        reduction=tail.exposed_reduction,
        optimizer=tail.exposed_optimizer,
    )


def _pipeline_of(result: Metrics, measure: str, rank: int) -> float:
    """The makespan, or ``rank``'s span when steps overlap."""
    return result.makespan if measure == "makespan" else result.span_per_rank[rank]


def _pipeline_time(runs: list[Metrics], microbatches: int, measure: str, rank: int) -> float:
    """The makespan (or ``rank``'s span) of the step from its simulated ``runs``: the short
    step's, or extrapolated from it and the one a period longer."""
    result = runs[0]
    if len(runs) > 1:
        result = extrapolate(result, runs[1], microbatches)
    return _pipeline_of(result, measure, rank)


def rank_bubble(rank: Rank) -> float:
    """The idle share of the rank's pipeline time: ``1 - busy / makespan`` (or ``/ span``)."""
    return max(0.0, 1 - rank.busy / rank.pipeline) if rank.pipeline else 0.0
