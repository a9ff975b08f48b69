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
- memory per device = training state of the stages it stores (16 bytes per parameter; DualPipe
  stores two stages) + its simulated peak activations, at most ``usable_memory`` (default 95 %)
  of the GPU's memory
- communication share = (pipeline transfers on the most loaded rank + exposed expert
  all-to-alls + the gradient all-reduce) / step time

Every candidate not kept is a ``Rejected`` with its reason: a batch that does not split over the
layout, more stages than the model has items, a shape the schedule does not run, or memory over
the usable share.

Pipeline neighbours use NVLink when all devices fit in one node and the network otherwise;
expert all-to-alls use NVLink when the EP group fits in one node.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from cutpipe.plan.costs import Hardware, ItemCost, model_items, p2p_time, w_memory
from cutpipe.plan.partition import (
    groups,
    rank_balanced_sizes,
    rank_memory,
    stage_costs,
    stage_state_bytes,
)
from cutpipe.plan.profile import Profile
from cutpipe.plan.progress import progress
from cutpipe.records import count
from cutpipe.schedule.limits import MAX_OPS
from cutpipe.schedule.registry import schedule_info
from cutpipe.sim.costs import Costs
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate
from cutpipe.spec import ModelSpec

#: The share of a GPU's memory a plan may fill (``usable_memory``). The zero-bubble paper's runs
#: peaked at up to 74 GB on 80 GB GPUs (92.5 %); the remaining 5 % covers the CUDA context and
#: the allocator's fragmentation. At 90 % layouts the paper ran were refused.
USABLE_MEMORY = 0.95
#: ``step_boundary`` -> the step measure it ranks by.
STEP_MEASURES = {"sync": "makespan", "overlap": "span"}
#: What the measures say in titles.
MEASURE_WORDS = {"makespan": "makespan (steps synchronised)", "span": "span (steps overlap)"}
#: The chunks tried for a schedule that takes them and is named without them (``interleaved``).
CHUNK_CHOICES = (2, 4)
#: The most ops ``recommend`` simulates over all layouts (about a minute of work).
MAX_SIMULATED_OPS = 20_000_000
#: More devices than any cluster; ``recommend`` enumerates the divisors of the count.
MAX_DEVICES = 1_000_000
NEAR_MISS = 1.25  # a compute-balanced split this far over the memory gets a memory-aware one
DEFAULT_SCHEDULES = ("1f1b", "zbh1", "zbh2", "interleaved", "zbv", "dualpipe", "dualpipev")


@dataclass(frozen=True)
class Plan:
    """One simulated way to train the model on the devices."""

    pp: int
    dp: int
    ep: int
    schedule: str
    microbatches: int
    step_time: float  # seconds
    tokens_per_second: float
    bubble: float  # the pipeline's bubble ratio (absolute measure)
    peak_memory: float  # bytes on the fullest device
    comm_share: float
    stage_sizes: list[int]
    #: what ``step_time`` and ``bubble`` measure: "makespan" (steps synchronised) or "span"
    step_measure: str = "makespan"

    def layout(self) -> str:
        return _layout(self.pp, self.dp, self.ep)

    def schedule_label(self) -> str:
        """Short: the registry name with its chunks, or what a single rank does."""
        if self.pp > 1:
            return self.schedule
        return "none+overlap" if self.schedule in OVERLAPPING else "none"

    def schedule_title(self) -> str:
        if self.pp > 1:
            return title(self.schedule)
        if self.schedule in OVERLAPPING:
            return "no pipeline, F&B overlap"
        return "no pipeline"


@dataclass(frozen=True)
class Rejected:
    """A candidate ``recommend`` did not keep, and why."""

    pp: int
    dp: int
    ep: int
    schedule: str  # "" when the layout is refused for every schedule
    microbatches: int  # 0 where the global batch does not split into whole microbatches
    reason: str

    def layout(self) -> str:
        return _layout(self.pp, self.dp, self.ep)

    def schedule_label(self) -> str:
        return self.schedule or "every schedule"


def _layout(pp: int, dp: int, ep: int) -> str:
    return f"PP={pp} DP={dp}" + (f" EP={ep}" if ep > 1 else "")


def label(name: str) -> str:
    """The registry name with every parameter written out: ``interleaved:chunks=2``."""
    info = schedule_info(name)
    settings = info.settings
    return ":".join([info.name, *(f"{p.name}={settings[p.name]}" for p in info.params)])


def title(name: str) -> str:
    """``Interleaved 1F1B (chunks=2)``: the title with every parameter, defaults included."""
    info = schedule_info(name)
    if not info.params:
        return info.title
    settings = info.settings
    return f"{info.base_title} ({', '.join(f'{p.name}={settings[p.name]}' for p in info.params)})"


def expand(schedules: Sequence[str]) -> list[str]:
    """The schedules to try, as ``label``s in the order given: one named without its chunks
    (``interleaved``) becomes one per ``CHUNK_CHOICES``; an explicit ``interleaved:chunks=8``
    stays as given."""
    out: list[str] = []
    for name in schedules:
        info = schedule_info(name)
        chunks = [p.name for p in info.params if p.stages_per_rank]
        if chunks and chunks[0] not in dict(info.values):  # bound only when given
            names = [label(info.bind(**{chunks[0]: k}).spec) for k in CHUNK_CHOICES]
        else:
            names = [label(name)]
        out.extend(n for n in names if n not in out)
    return out


#: On one rank (PP = 1) every schedule is plain data parallelism, except that DualPipeV's order
#: overlaps one microbatch's forward with another's backward, hiding expert all-to-alls.
SINGLE_RANK = ("1f1b", "dualpipev")
OVERLAPPING = ("dualpipev",)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _items(
    model: ModelSpec, hardware: Hardware, ep: int, profile: Profile | None
) -> list[ItemCost]:
    within = ep <= hardware.gpus_per_node
    if profile is None:
        return model_items(model, hardware, ep, ep_within_node=within)
    return profile.items_for(hardware, ep, ep_within_node=within)


def evaluate(
    model: ModelSpec, hardware: Hardware, devices: int, pp: int, ep: int, name: str, microbatches: int,
    capacity: float, profile: Profile | None = None, step_boundary: str = "sync",
) -> Plan | Rejected:  # fmt: skip
    """Simulate one candidate; a ``Rejected`` with the reason where it cannot run or fit.

    ``capacity`` is the usable bytes per device; ``step_boundary`` picks the step measure
    (``STEP_MEASURES``)."""
    dp = devices // pp
    info = schedule_info(name)
    items = _items(model, hardware, ep, profile)

    def rejected(reason: str) -> Rejected:
        return Rejected(pp, dp, ep, name, microbatches, reason)

    stages = pp * info.stages_per_rank
    if stages > len(items):
        return rejected(too_few_items(stages, pp, len(items)))
    schedule = info.generate(pp, microbatches)
    comm = p2p_time(model, hardware, within_node=devices <= hardware.gpus_per_node)
    kept = profile.w_memory if profile else w_memory(model)

    def weigh(sizes: list[int]) -> tuple[Costs, list[float]]:
        costs = stage_costs(items, sizes, comm, kept)
        return costs, rank_memory(schedule, costs, stage_state_bytes(items, sizes))

    sizes = rank_balanced_sizes(items, schedule)
    costs, memory = weigh(sizes)
    if max(memory) > capacity:
        if max(memory) > NEAR_MISS * capacity:
            return rejected(over_memory(memory, capacity))
        # move layers off the fullest ranks; on a short step (4 microbatches per rank),
        # which peaks as high as a long one but is quicker to weigh
        short = info.generate(pp, min(microbatches, max(4 * pp, info.min_microbatches(pp))))
        sizes = rank_balanced_sizes(items, short, capacity, comm, kept)
        costs, memory = weigh(sizes)
        if max(memory) > capacity:
            return rejected(over_memory(memory, capacity))
    result = metrics(simulate(schedule, costs), costs)
    bandwidth, latency = hardware.link(within_node=devices <= hardware.gpus_per_node)
    parts = groups(items, sizes)
    experts = [sum(i.expert_parameters for i in part) for part in parts]
    dense = [sum(i.parameters for i in part) - e for part, e in zip(parts, experts, strict=True)]

    def allreduce_on(rank: int) -> float:  # every stage the rank stores, DualPipe's copies too
        held = schedule.placement.stages_of(rank)
        grad = model.element_bytes
        return ring_allreduce(sum(dense[s] for s in held) * grad, dp, bandwidth, latency) + (
            ring_allreduce(sum(experts[s] for s in held) * grad, dp // ep, bandwidth, latency)
        )

    allreduces = [allreduce_on(rank) for rank in range(pp)]
    measure = STEP_MEASURES[step_boundary]
    if measure == "makespan":  # every rank waits for the slowest all-reduce
        allreduce = max(allreduces)
        step = result.makespan + allreduce
        bubble = result.bubble_ratio
    else:  # each rank steps after its own span and its own all-reduce; the longest sets the pace
        ends = [span + a for span, a in zip(result.span_per_rank, allreduces, strict=True)]
        critical = max(range(pp), key=ends.__getitem__)
        allreduce, step = allreduces[critical], ends[critical]
        bubble = result.bubble_ratio_span
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
    return Plan(pp, dp, ep, name, microbatches, step, tokens / step, bubble, max(memory),
                min(1.0, comm_time / step), sizes, measure)  # fmt: skip


def too_few_items(stages: int, pp: int, items: int) -> str:
    """Why a schedule with more stages than cost items cannot run."""
    per_rank = stages // pp
    need = f"{per_rank}*PP={stages}" if per_rank > 1 else f"PP={stages}"
    return (
        f"needs {need} stages, the model has {items - 2} layers + embedding + head = {items} items"
    )


def over_memory(memory: Sequence[float], capacity: float) -> str:
    """Why a candidate does not fit: the fullest rank's need against the usable bytes."""
    rank = max(range(len(memory)), key=memory.__getitem__)
    need = memory[rank]
    return (
        f"needs {need / 1e9:.1f} GB on rank {rank}, {capacity / 1e9:.1f} GB usable "
        f"({(need - capacity) / 1e9:.1f} GB over)"
    )


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
) -> list[Plan]:
    """Every fitting plan, fastest first. ``global_batch`` counts sequences (default 8 per
    device); ``memory`` is bytes per device (default the GPU's), of which ``usable_memory``
    (0 < F <= 1) may be filled; ``profile``: measured costs (``cutpipe profile``) instead of the
    analytic model. ``step_boundary``: "sync" ranks by makespan + all-reduce, "overlap" by span
    + all-reduce (see the module's docstring). Every candidate not kept is appended to
    ``rejected``, when given, as a ``Rejected`` with its reason."""
    check_inputs(model, hardware, devices, global_batch, memory, schedules, profile)
    check_options(step_boundary, usable_memory, rejected)
    dropped: list[Rejected] = []
    try:
        return _recommend(
            model, hardware, devices, global_batch, memory, schedules, profile, step_boundary,
            usable_memory, dropped,
        )  # fmt: skip
    finally:  # the reasons are there for the caller even when nothing fits
        if rejected is not None:
            rejected.extend(dropped)


def _recommend(
    model: ModelSpec, hardware: Hardware, devices: int, global_batch: int | None,
    memory: float | None, schedules: Sequence[str], profile: Profile | None, step_boundary: str,
    usable_memory: float, dropped: list[Rejected],
) -> list[Plan]:  # fmt: skip
    batch = 8 * devices if global_batch is None else global_batch
    capacity = (hardware.memory if memory is None else memory) * usable_memory
    names = expand(schedules)
    items = len(_items(model, hardware, 1, profile))
    layouts = []
    for pp in divisors(devices):
        dp = devices // pp
        size = model.microbatch_size
        if batch % dp or (batch // dp) % size:
            shares = f"DP={dp} equal shares" + (
                f" of whole microbatches of {size} sequences" if size > 1 else ""
            )
            reason = f"global batch {batch} does not split into {shares}"
            dropped.append(Rejected(pp, dp, 1, "", 0, reason))
            continue
        m = batch // dp // size
        eps = [e for e in divisors(dp) if model.experts % e == 0] if model.moe else [1]
        tried = names if pp > 1 else [n for n in SINGLE_RANK if n in names] or names[:1]
        for ep in eps:
            for name in tried:
                info = schedule_info(name)
                stages = pp * info.stages_per_rank
                if stages > items:
                    dropped.append(Rejected(pp, dp, ep, name, m, too_few_items(stages, pp, items)))
                    continue
                check_size(name, pp, m, batch)
                if not info.accepts(pp, m):
                    reason = (
                        f"{title(name)} runs on {info.valid}, not PP={pp} with {m} microbatches"
                    )
                    dropped.append(Rejected(pp, dp, ep, name, m, reason))
                    continue
                layouts.append((pp, ep, name, m))
    simulated = sum(schedule_info(name).ops_bound(pp, m) for pp, _, name, m in layouts)
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
    plans = []
    with progress("simulating layouts", total=len(layouts)) as tick:
        for pp, ep, name, m in layouts:
            plan = evaluate(
                model, hardware, devices, pp, ep, name, m, capacity, profile, step_boundary
            )
            if isinstance(plan, Plan):
                plans.append(plan)
            else:
                dropped.append(plan)
            tick(status=f"{len(plans)} fit")
    if not plans:
        smallest = _smallest_need(model, hardware, devices, profile)
        usable = (
            f"{capacity / 1e9:.1f} GB usable ({usable_memory:.0%} of "
            f"{capacity / usable_memory / 1e9:.1f} GB)"
        )
        if smallest <= capacity:
            raise ValueError(
                f"{model.name} does not fit on {devices} x {hardware.name}: the training state "
                f"fits ({smallest / 1e9:.1f} GB per device "
                f"of {usable} at the deepest pipeline) but not with the "
                "activations of any schedule; use more devices, GPUs with more memory, expert "
                "parallelism or shorter sequences"
            )
        raise ValueError(
            f"{model.name} does not fit on {devices} x {hardware.name} even at the largest pipeline: "
            f"its training state alone needs {smallest / 1e9:.1f} GB per device against "
            f"{usable}, {(smallest - capacity) / 1e9:.1f} GB over; use more "
            "devices, GPUs with more memory, or expert parallelism"
        )
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
    count(devices, "devices")
    if global_batch is not None:
        count(global_batch, "global_batch")
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


def _smallest_need(
    model: ModelSpec, hardware: Hardware, devices: int, profile: Profile | None
) -> float:
    """Training-state bytes per device at the deepest pipeline and widest expert parallelism."""
    pp = max(d for d in divisors(devices) if d <= model.layers + 2)
    ep = max(
        (e for e in divisors(devices // pp) if not model.moe or model.experts % e == 0), default=1
    )
    items = _items(model, hardware, ep if model.moe else 1, profile)
    return sum(i.state_bytes for i in items) / pp


def reason(plans: Sequence[Plan], hardware: Hardware) -> str:
    """A paragraph on why the fastest plan wins, from the numbers of the others."""
    best = plans[0]
    text = (
        f"{best.schedule_title()} on {best.layout()} with {best.microbatches} microbatches per "
        f"pipeline is fastest: {best.tokens_per_second:,.0f} tokens/s, a step of {best.step_time:.2f} s "
        f"{'(span: steps overlap) ' if best.step_measure == 'span' else ''}"
        f"with a {best.bubble:.1%} bubble and {best.comm_share:.0%} of it in communication, "
        f"{best.peak_memory / 1e9:.1f} GB on the fullest {hardware.name}."
    )
    same_layout = [p for p in plans[1:] if (p.pp, p.dp, p.ep) == (best.pp, best.dp, best.ep)]
    if same_layout:
        other = same_layout[0]
        text += (
            f" On the same layout the next schedule, {other.schedule_title()}, is "
            f"{1 - other.tokens_per_second / best.tokens_per_second:.1%} slower (bubble {other.bubble:.1%}, "
            f"{other.peak_memory / 1e9:.1f} GB)."
        )
    other_layout = next(
        (p for p in plans[1:] if (p.pp, p.dp, p.ep) != (best.pp, best.dp, best.ep)), None
    )
    if other_layout is not None:
        text += (
            f" The best other layout, {other_layout.layout()} with {other_layout.schedule_title()}, "
            f"is {1 - other_layout.tokens_per_second / best.tokens_per_second:.1%} slower."
        )
    pairs = [
        (cut, dual)
        for cut in plans
        for dual in plans
        if cut.schedule == "dualpipev" and dual.schedule == "dualpipe" and cut.pp > 1
        and (cut.pp, cut.ep) == (dual.pp, dual.ep)
    ]  # fmt: skip
    if pairs:
        cut, dual = pairs[0]
        change = cut.tokens_per_second / dual.tokens_per_second - 1
        text += (
            f" At PP={cut.pp}, Cut-in-half needs {cut.peak_memory / 1e9:.1f} GB where DualPipe "
            f"needs {dual.peak_memory / 1e9:.1f} GB (it stores every stage twice) and is "
            f"{abs(change):.1%} {'faster' if change >= 0 else 'slower'}."
        )
    return text
