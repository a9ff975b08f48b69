"""Which schedule and parallel layout to use: every fitting choice simulated, the best few ranked.

For ``devices`` GPUs it tries every factoring into pipeline x data parallel ranks (PP x DP),
with expert parallelism inside the data-parallel group for an MoE (EP divides both DP and the
experts), every schedule that accepts the pipeline shape (a schedule with chunks named without
them, ``interleaved``, is tried with 2 and with 4), and the microbatch count the global batch
gives. Each candidate's stages are balanced by compute (embedding and head included, each
possibly a stage of its own), its memory checked, and its step simulated:

- step time, by the measure that matches the step boundary:

  - ``step_boundary="sync"`` (the default): every rank waits for the gradient all-reduce and the
    optimizer before the next step, so the step is the simulated makespan + the all-reduce;
  - ``"overlap"``: consecutive steps overlap (rank 0 starts the next step's forwards while the
    last ranks finish this step's W), each rank stepping when its own gradients are reduced, so
    the step is the longest per-rank span (first op to last op, the zero-bubble papers' measure)
    plus that rank's all-reduce;

  the simulated ops include any exposed expert all-to-all; the all-reduces are rings,
  ``2*(n-1)/n * bytes / bandwidth`` for a group of ``n``: dense parameters over the DP ranks,
  routed experts over the DP/EP ranks that share them, for every stage the rank stores
  (DualPipe's two copies both). The bubble reported is the same measure's.
- memory per device = training state of the stages it stores (16 bytes per parameter, less
  what ZeRO shards; DualPipe stores two stages) + its simulated peak activations + its
  communication buffers (``plan.footprint``), at most ``usable_memory`` (default 95 %) of the
  GPU's memory; plus, in the step, the optimizer's pass over the rank's parameters

For each layout and schedule the training settings are searched too (``plan.settings``): TP
inside a node, activation recompute and ZeRO over the data-parallel ranks, in bf16 or FP8.

Every candidate not kept is a ``Rejected`` with its reason: a batch that does not split over the
layout, more stages than the model has items, a shape the schedule does not run, or memory over
the usable share.

Pipeline neighbours use NVLink when all devices fit in one node and the network otherwise;
expert all-to-alls use NVLink when the EP group fits in one node.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from cutpipe.plan.costs.model import (
    PLAIN,
    Hardware,
    ItemCost,
    Training,
    model_items,
    optimizer_time,
    p2p_time,
    w_memory,
)
from cutpipe.plan.costs.profile import Profile
from cutpipe.plan.partition import (
    groups,
    rank_balanced_sizes,
    rank_memory,
    stage_costs,
    stage_state_bytes,
)
from cutpipe.plan.progress import progress
from cutpipe.plan.recommend.explain import does_not_fit, over_memory, reason, too_few_items
from cutpipe.plan.recommend.footprint import buffer_bytes, footprint
from cutpipe.plan.recommend.plans import (
    CHUNK_CHOICES,
    OVERLAPPING,
    SINGLE_RANK,
    Plan,
    Rejected,
    expand,
    label,
    title,
)
from cutpipe.plan.recommend.settings import Search, best_setting, divisors
from cutpipe.records import check_count
from cutpipe.schedule.limits import MAX_OPS
from cutpipe.schedule.registry import schedule_info
from cutpipe.sim.costs import Costs
from cutpipe.sim.metrics import extrapolate, metrics
from cutpipe.sim.simulate import simulate
from cutpipe.spec import ModelSpec

__all__ = [  # the planner's public names, wherever they live
    "CHUNK_CHOICES", "DEFAULT_SCHEDULES", "OVERLAPPING", "SINGLE_RANK", "USABLE_MEMORY", "Plan",
    "Rejected", "Search", "best_setting", "divisors", "evaluate", "expand", "label", "reason",
    "recommend", "ring_allreduce", "simulated_counts", "throughput_bound", "title",
]  # fmt: skip

#: The share of a GPU's memory a plan may fill (``usable_memory``). The zero-bubble paper's runs
#: peaked at up to 74 GB on 80 GB GPUs (92.5 %); the remaining 5 % covers the CUDA context and
#: the allocator's fragmentation. At 90 % layouts the paper ran were refused.
USABLE_MEMORY = 0.95
#: ``step_boundary`` -> the step measure it ranks by.
STEP_MEASURES = {"sync": "makespan", "overlap": "span"}
#: What the measures say in titles.
MEASURE_WORDS = {"makespan": "makespan (steps synchronised)", "span": "span (steps overlap)"}
#: The most ops ``recommend`` simulates over all layouts (about a minute of work).
MAX_SIMULATED_OPS = 20_000_000
#: More devices than any cluster; ``recommend`` enumerates the divisors of the count.
MAX_DEVICES = 1_000_000
NEAR_MISS = 1.25  # a compute-balanced split this far over the memory gets a memory-aware one
DEFAULT_SCHEDULES = ("1f1b", "zbh1", "zbh2", "interleaved", "zbv", "dualpipe", "dualpipev")


def _items(
    model: ModelSpec, hardware: Hardware, ep: int, profile: Profile | None,
    training: Training = PLAIN,
) -> list[ItemCost]:  # fmt: skip
    within = ep * training.tp <= hardware.gpus_per_node
    if profile is None:
        return model_items(model, hardware, ep, ep_within_node=within, training=training)
    state = training.state_bytes_per_parameter  # measured compute; ZeRO still shards the state
    experts = training.state_bytes_over(training.replicas(ep))
    return [
        replace(item, bytes_per_parameter=state, expert_bytes_per_parameter=experts)
        for item in profile.items_for(hardware, ep, ep_within_node=within)
    ]


def evaluate(
    model: ModelSpec, hardware: Hardware, devices: int, pp: int, ep: int, name: str, microbatches: int,
    capacity: float, profile: Profile | None = None, step_boundary: str = "sync",
    training: Training = PLAIN, rebalance: bool = True, cache: dict | None = None,
) -> Plan | Rejected:  # fmt: skip
    """Simulate one candidate; a ``Rejected`` with the reason where it cannot run or fit.

    ``capacity`` is the usable bytes per device; ``step_boundary`` picks the step measure
    (``STEP_MEASURES``); ``training`` the ZeRO stage (over its ``dp``), recompute, precision and
    TP (``devices = PP x DP x TP``). ``rebalance``: whether a split within ``NEAR_MISS`` of the
    memory gets a memory-aware one; ``cache`` keeps compute-balanced splits between calls."""
    dp = devices // (pp * training.tp)
    info = schedule_info(name)
    items = _memo(cache, ("items", ep, training),
                  lambda: _items(model, hardware, ep, profile, training))  # fmt: skip
    buffers = buffer_bytes(model, training, pp, ep)

    def rejected(reason: str, excess: float = 0.0) -> Rejected:
        return Rejected(pp, dp, ep, name, microbatches, reason, training.tp, excess, training)

    stages = pp * info.stages_per_rank
    if stages > len(items):
        return rejected(too_few_items(stages, pp, len(items)))
    short_m, long_m = simulated_counts(info, pp, microbatches)
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
    comm = p2p_time(model, hardware, devices <= hardware.gpus_per_node, training)
    kept = profile.w_memory if profile else w_memory(model)

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
        result = extrapolate(result, longer, microbatches)
    bandwidth, latency = hardware.link(within_node=devices <= hardware.gpus_per_node)
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
    measure = STEP_MEASURES[step_boundary]
    if measure == "makespan":  # every rank waits for the slowest all-reduce and optimizer step
        critical = max(range(pp), key=tails.__getitem__)
        step = result.makespan + tails[critical]
        bubble = result.bubble_ratio
    else:  # each rank steps after its own span, all-reduce and optimizer; the longest sets the pace
        ends = [span + tail for span, tail in zip(result.span_per_rank, tails, strict=True)]
        critical = max(range(pp), key=ends.__getitem__)
        step = ends[critical]
        bubble = result.bubble_ratio_span
    allreduce = allreduces[critical]
    busiest = max(range(pp), key=lambda r: result.busy_per_rank[r])
    sends = result.p2p_sends / pp
    exposed_ep = (
        sum(
            costs.per_stage("ep_f", schedule.num_stages)[s]
            + costs.per_stage("ep_b", schedule.num_stages)[s]
            for s in schedule.placement.stages_of(busiest)
        )
        * microbatches
        * (1 - result.ep_alltoalls_overlapped / max(1, result.ep_alltoalls))
    )
    comm_time = sends * (comm - latency) + exposed_ep + allreduce
    tokens = model.tokens * microbatches * dp
    bubble = max(0.0, bubble)  # not -1e-15
    fullest = max(range(pp), key=memory.__getitem__)
    stored = schedule.placement.stages_of(fullest)
    routed = sum(experts[s] for s in stored)
    held = sum(dense[s] for s in stored) + routed
    state = sum(stage_state_bytes(items, sizes)[s] for s in stored)
    where = footprint(held, memory[fullest] - state - buffers, training, buffers, routed, ep)
    return Plan(pp, dp, ep, name, microbatches, step, tokens / step, bubble, max(memory),
                min(1.0, comm_time / step), sizes, measure, training, where)  # fmt: skip


#: ``evaluate`` simulates at most this many microbatches per rank and extrapolates beyond.
SIMULATED_PER_RANK = 8
SIMULATED_AT_LEAST = 16  # a V's warm-up settles later on few ranks


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


def throughput_bound(
    model: ModelSpec, hardware: Hardware, devices: int, layout: tuple, profile: Profile | None,
    search: Search, cache: dict,
) -> float:  # fmt: skip
    """Tokens/s no setting of ``layout`` can beat: every rank busy all the time with its share
    of the least work (no recompute, no ZeRO-3 gathers), nothing else in the step."""
    pp, tp, ep, _, m = layout
    dp = devices // (pp * tp)
    least = Training(0, dp, "none", search.fp8, tp)
    items = _memo(cache, ("items", ep, least), lambda: _items(model, hardware, ep, profile, least))
    step = m * sum(item.forward + item.backward + item.weight for item in items) / pp
    return model.tokens * m * dp / step


def ring_allreduce(size: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds for a ring all-reduce of ``size`` bytes over ``ranks``."""
    if ranks <= 1 or size == 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * size / bandwidth + 2 * (ranks - 1) * latency


def recommend(
    model: ModelSpec,
    hardware: Hardware,
    devices: int,
    global_batch: int | None = None,
    memory: float | None = None,
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
    profile: Profile | None = None,
    *,
    step_boundary: str = "sync",
    usable_memory: float = USABLE_MEMORY,
    rejected: list[Rejected] | None = None,
    zero: int | None = None,
    recompute: str | None = None,
    precision: str = "bf16",
    tp: int | None = None,
    keep: int | None = None,
) -> list[Plan]:
    """Every fitting plan, fastest first. ``global_batch`` counts sequences (default 8 per
    device); ``memory`` is bytes per device (default the GPU's), of which ``usable_memory``
    (0 < F <= 1) may be filled; ``profile``: measured costs (``cutpipe profile``) instead of the
    analytic model. ``step_boundary``: "sync" ranks by makespan + all-reduce, "overlap" by span
    + all-reduce (see the module's docstring). Every candidate not kept is appended to
    ``rejected``, when given, as a ``Rejected`` with its reason. ``zero`` (0-3), ``recompute``
    (none, selective, full) and ``tp`` fix a training setting that is otherwise searched;
    ``precision`` is "bf16" or "fp8" (on a GPU with FP8). ``keep``: simulate only what may be
    among the ``keep`` fastest (a candidate whose bound on tokens/s, every rank busy with its
    least work, is below them is rejected unsimulated); None simulates everything."""
    check_inputs(model, hardware, devices, global_batch, memory, schedules, profile)
    check_options(step_boundary, usable_memory, rejected)
    search = Search.checked(zero, recompute, precision, tp, hardware, model, profile)
    dropped: list[Rejected] = []
    try:
        return _recommend(
            model, hardware, devices, global_batch, memory, schedules, profile, step_boundary,
            usable_memory, dropped, search, keep,
        )  # fmt: skip
    finally:  # the reasons are there for the caller even when nothing fits
        if rejected is not None:
            rejected.extend(dropped)


def _recommend(
    model: ModelSpec, hardware: Hardware, devices: int, global_batch: int | None,
    memory: float | None, schedules: Sequence[str], profile: Profile | None, step_boundary: str,
    usable_memory: float, dropped: list[Rejected], search: Search, keep: int | None,
) -> list[Plan]:  # fmt: skip
    batch = 8 * devices if global_batch is None else global_batch
    capacity = (hardware.memory if memory is None else memory) * usable_memory
    names = expand(schedules)
    items = len(_items(model, hardware, 1, profile))
    layouts = []
    for pp, tp in search.shapes(devices, model, hardware):
        dp = devices // (pp * tp)
        size = model.microbatch_size
        if batch % dp or (batch // dp) % size:
            shares = f"DP={dp} equal shares" + (
                f" of whole microbatches of {size} sequences" if size > 1 else ""
            )
            reason = f"global batch {batch} does not split into {shares}"
            dropped.append(Rejected(pp, dp, 1, "", 0, reason, tp))
            continue
        m = batch // dp // size
        eps = [e for e in divisors(dp) if model.experts % e == 0] if model.moe else [1]
        tried = names if pp > 1 else [n for n in SINGLE_RANK if n in names] or names[:1]
        for ep in eps:
            for name in tried:
                info = schedule_info(name)
                stages = pp * info.stages_per_rank
                if stages > items:
                    reason = too_few_items(stages, pp, items)
                    dropped.append(Rejected(pp, dp, ep, name, m, reason, tp))
                    continue
                check_size(name, pp, m, batch)
                if not info.accepts(pp, m):
                    reason = (
                        f"{title(name)} runs on {info.valid}, not PP={pp} with {m} microbatches"
                    )
                    dropped.append(Rejected(pp, dp, ep, name, m, reason, tp))
                    continue
                layouts.append((pp, tp, ep, name, m))
    simulated = sum(schedule_info(name).ops_bound(pp, m) for pp, _, _, name, m in layouts)
    if simulated > MAX_SIMULATED_OPS:
        raise ValueError(
            f"recommend would simulate {len(layouts)} layouts of about {simulated:,} ops in all, "
            f"over its limit of {MAX_SIMULATED_OPS:,}: use a smaller global batch, fewer "
            "schedules or fewer devices"
        )
    if not layouts:
        if all(not r.schedule for r in dropped):
            raise ValueError(
                f"no layout of {devices} devices splits a global batch of {batch} sequences into "
                f"whole microbatches of {model.microbatch_size}: pick a global batch divisible by "
                "the data-parallel sizes"
            )
        first = next(r for r in dropped if r.schedule)
        raise ValueError(
            f"none of {', '.join(names)} runs on any layout of {devices} devices (e.g. "
            f"{first.schedule} on {first.layout()}: {first.reason}): use other schedules, "
            "another device count or another global batch"
        )
    plans: list[Plan] = []
    cache: dict = {}
    bounds = {
        layout: throughput_bound(model, hardware, devices, layout, profile, search, cache)
        for layout in layouts
    }
    layouts.sort(key=bounds.__getitem__, reverse=True)  # the promising first: a higher bar
    leaders: list[float] = []  # a min-heap of the ``keep`` best tokens/s so far
    with progress("simulating layouts", total=len(layouts)) as tick:
        for layout in layouts:
            pp, tp, ep, name, m = layout
            dp = devices // (pp * tp)
            if keep is not None and len(leaders) >= keep and bounds[layout] < leaders[0]:
                reason = (
                    f"at most {bounds[layout]:,.0f} tokens/s even with no bubble and no "
                    f"communication, below the {keep} best ({leaders[0]:,.0f} and up)"
                )
                dropped.append(Rejected(pp, dp, ep, name, m, reason, tp))
                tick(status=f"{len(plans)} fit")
                continue
            outcome = best_setting(
                search.settings(dp, tp, pp),
                lambda training, rebalance, pp=pp, ep=ep, name=name, m=m: evaluate(
                    model, hardware, devices, pp, ep, name, m, capacity, profile, step_boundary,
                    training, rebalance, cache,
                ),
            )  # fmt: skip
            if isinstance(outcome, Plan):
                plans.append(outcome)
                heapq.heappush(leaders, outcome.tokens_per_second)
                if keep is not None and len(leaders) > keep:
                    heapq.heappop(leaders)
            else:
                dropped.append(outcome)
            tick(status=f"{len(plans)} fit")
    if not plans:
        closest = min((r for r in dropped if r.excess > 0), key=lambda r: r.excess, default=None)
        if closest is not None:
            raise ValueError(
                does_not_fit(model, hardware, devices, closest, capacity, usable_memory)
            )
        raise ValueError(f"no layout of {model.name} on {devices} x {hardware.name} runs")
    return sorted(plans, key=lambda p: -p.tokens_per_second)


def check_options(step_boundary: str, usable_memory: float, rejected: list | None) -> None:
    """A TypeError or ValueError naming the keyword argument ``recommend`` cannot use."""
    if not isinstance(step_boundary, str) or step_boundary not in STEP_MEASURES:
        raise ValueError(
            f"step_boundary must be one of {', '.join(map(repr, STEP_MEASURES))}, got {step_boundary!r}"
        )
    if isinstance(usable_memory, bool) or not isinstance(usable_memory, numbers.Real):
        raise TypeError(f"usable_memory must be a fraction of the memory, got {usable_memory!r}")
    if not (math.isfinite(usable_memory) and 0 < usable_memory <= 1):
        raise ValueError(f"usable_memory must be > 0 and <= 1, got {usable_memory}")
    if rejected is not None and not isinstance(rejected, list):
        raise TypeError(f"rejected must be a list to append to, or None, got {rejected!r}")


def check_inputs(
    model: ModelSpec, hardware: Hardware, devices: int, global_batch: int | None,
    memory: float | None, schedules: Sequence[str], profile: Profile | None,
) -> None:  # fmt: skip
    """A TypeError or ValueError naming the argument that ``recommend`` cannot use."""
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model must be a ModelSpec, got {type(model).__name__}")
    if not isinstance(hardware, Hardware):
        raise TypeError(f"hardware must be a Hardware (e.g. gpu('H100')), got {hardware!r}")
    check_count(devices, "devices")
    if global_batch is not None:
        check_count(global_batch, "global_batch")
    if devices > MAX_DEVICES:
        raise ValueError(f"devices must be at most {MAX_DEVICES:,}, got {devices:,}")
    if memory is not None:
        if isinstance(memory, bool) or not isinstance(memory, numbers.Real):
            raise TypeError(f"memory must be a number of bytes per device, got {memory!r}")
        if not (math.isfinite(memory) and memory > 0):
            raise ValueError(
                f"memory must be a positive finite number of bytes per device, got {memory}"
            )
    if isinstance(schedules, str) or not all(isinstance(name, str) for name in schedules):
        raise TypeError(f"schedules must be a list of schedule names, got {schedules!r}")
    if not schedules:
        raise ValueError(f"give at least one schedule, e.g. {', '.join(DEFAULT_SCHEDULES)}")
    if profile is not None and not isinstance(profile, Profile):
        raise TypeError(f"profile must be a Profile (Profile.load(path)), got {profile!r}")


def check_size(name: str, pp: int, microbatches: int, batch: int) -> None:
    """A ValueError if one layout's schedule is over ``MAX_OPS`` (a global batch too large)."""
    ops = schedule_info(name).ops_bound(pp, microbatches)
    if ops > MAX_OPS:
        raise ValueError(
            f"a global batch of {batch:,} sequences makes {microbatches:,} microbatches per "
            f"pipeline at PP={pp}, and {name} would hold about {ops:,} ops, over the limit of "
            f"{MAX_OPS:,}: use a smaller global batch"
        )
