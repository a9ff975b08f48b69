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

This module lists the layouts a ``Job`` allows (``candidate_layouts``) and ranks them
(``ranked_plans``); ``evaluate`` (``plan.recommend.evaluate``) simulates one.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from cutpipe.plan.costs.model import Hardware
from cutpipe.plan.costs.profile import Profile
from cutpipe.plan.progress import progress
from cutpipe.plan.recommend.evaluate import (
    evaluate,
    job_items,
    ring_allreduce,
    simulated_counts,
    throughput_bound,
)
from cutpipe.plan.recommend.explain import does_not_fit, reason, too_few_items
from cutpipe.plan.recommend.job import (
    MAX_DEVICES,
    STEP_MEASURES,
    USABLE_MEMORY,
    Job,
    Layout,
)
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
from cutpipe.schedule.limits import MAX_OPS
from cutpipe.schedule.registry import schedule_info
from cutpipe.spec import ModelSpec

__all__ = [  # the planner's public names, wherever they live
    "CHUNK_CHOICES", "DEFAULT_SCHEDULES", "MAX_DEVICES", "OVERLAPPING", "SINGLE_RANK",
    "STEP_MEASURES", "USABLE_MEMORY", "Job", "Layout", "Plan", "Rejected", "Search",
    "best_setting", "divisors", "evaluate", "expand", "label", "reason", "recommend",
    "ring_allreduce", "simulated_counts", "throughput_bound", "title",
]  # fmt: skip

#: What the measures say in titles.
MEASURE_WORDS = {"makespan": "makespan (steps synchronised)", "span": "span (steps overlap)"}
#: The most ops ``recommend`` simulates over all layouts (about a minute of work).
MAX_SIMULATED_OPS = 20_000_000
DEFAULT_SCHEDULES = ("1f1b", "zbh1", "zbh2", "interleaved", "zbv", "dualpipe", "dualpipev")


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
    job = Job(model, hardware, devices, global_batch, memory, usable_memory, profile, step_boundary)
    check_schedules(schedules)
    if rejected is not None and not isinstance(rejected, list):
        raise TypeError(f"rejected must be a list to append to, or None, got {rejected!r}")
    search = Search.checked(zero, recompute, precision, tp, hardware, model, profile)
    dropped: list[Rejected] = []
    try:
        layouts = candidate_layouts(job, expand(schedules), search, dropped)
        return ranked_plans(job, layouts, search, keep, dropped)
    finally:  # the reasons are there for the caller even when nothing fits
        if rejected is not None:
            rejected.extend(dropped)


def candidate_layouts(
    job: Job, names: Sequence[str], search: Search, dropped: list[Rejected]
) -> list[Layout]:
    """Every layout of the job's devices that runs one of the schedules ``names`` (labels) on
    the microbatches its global batch gives; the others go to ``dropped`` with the reason. A
    ValueError if none runs, or if simulating them all would take too long."""
    model, devices, batch = job.model, job.devices, job.batch
    items = len(job_items(job, 1))
    layouts: list[Layout] = []
    for pp, tp in search.shapes(devices, model, job.hardware):
        dp = devices // (pp * tp)
        size = model.microbatch_size
        if batch % dp or (batch // dp) % size:
            shares = f"DP={dp} equal shares" + (
                f" of whole microbatches of {size} sequences" if size > 1 else ""
            )
            why = f"global batch {batch} does not split into {shares}"
            dropped.append(Rejected(pp, dp, 1, "", 0, why, tp))
            continue
        m = batch // dp // size
        eps = [e for e in divisors(dp) if model.experts % e == 0] if model.moe else [1]
        tried = names if pp > 1 else [n for n in SINGLE_RANK if n in names] or names[:1]
        for ep in eps:
            for name in tried:
                layout = Layout(pp, dp, ep, name, m, tp)
                info = schedule_info(name)
                stages = pp * info.stages_per_rank
                if stages > items:
                    dropped.append(layout.refused(too_few_items(stages, pp, items)))
                    continue
                check_schedule_ops(layout, batch)
                if not info.accepts(pp, m):
                    why = f"{title(name)} runs on {info.valid}, not PP={pp} with {m} microbatches"
                    dropped.append(layout.refused(why))
                    continue
                layouts.append(layout)
    simulated = sum(
        schedule_info(layout.schedule).ops_bound(layout.pp, layout.microbatches)
        for layout in layouts
    )
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
    return layouts


def ranked_plans(
    job: Job, layouts: Sequence[Layout], search: Search, keep: int | None,
    dropped: list[Rejected], *, reference: bool = False,
) -> list[Plan]:  # fmt: skip
    """The fitting plans of ``layouts``, fastest first, each under its best training setting
    (``best_setting``); the most promising layouts are simulated first, so that with ``keep``
    a layout whose throughput bound is below the ``keep`` best so far is dropped unsimulated.
    A ValueError, naming the closest refusal, if none fits. ``reference``: nothing kept
    between candidates and every balancing move scored alone, the slow way whose plans the
    fast one matches exactly (tests/test_recommend_speed.py)."""
    plans: list[Plan] = []
    cache: dict | None = None if reference else {}
    known = cache if cache is not None else {}  # the items the bounds make, kept for evaluate
    bounds = {layout: throughput_bound(job, layout, search, known) for layout in layouts}
    ordered = sorted(layouts, key=bounds.__getitem__, reverse=True)  # a higher bar sooner
    leaders: list[float] = []  # a min-heap of the ``keep`` best tokens/s so far
    with progress("simulating layouts", total=len(ordered)) as tick:
        for layout in ordered:
            if keep is not None and len(leaders) >= keep and bounds[layout] < leaders[0]:
                why = (
                    f"at most {bounds[layout]:,.0f} tokens/s even with no bubble, no pipeline "
                    f"transfers and no exposed all-to-all, below the {keep} best "
                    f"({leaders[0]:,.0f} and up)"
                )
                dropped.append(layout.refused(why))
                tick(status=f"{len(plans)} fit")
                continue
            outcome = best_setting(
                search.settings(layout.dp, layout.tp, layout.pp),
                lambda training, rebalance, layout=layout: evaluate(
                    job, layout, training, rebalance, cache, screened=not reference
                ),
            )
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
            raise ValueError(does_not_fit(job, closest))
        raise ValueError(
            f"no layout of {job.model.name} on {job.devices} x {job.hardware.name} runs"
        )
    return sorted(plans, key=lambda p: -p.tokens_per_second)


def check_schedules(schedules: Sequence[str]) -> None:
    """A TypeError or ValueError if ``schedules`` is not a non-empty list of names."""
    if isinstance(schedules, str) or not all(isinstance(name, str) for name in schedules):
        raise TypeError(f"schedules must be a list of schedule names, got {schedules!r}")
    if not schedules:
        raise ValueError(f"give at least one schedule, e.g. {', '.join(DEFAULT_SCHEDULES)}")


def check_schedule_ops(layout: Layout, batch: int) -> None:
    """A ValueError if the layout's schedule, at the microbatches a global batch of ``batch``
    sequences gives, would hold more than ``MAX_OPS`` ops (the batch is too large)."""
    name, pp, microbatches = layout.schedule, layout.pp, layout.microbatches
    ops = schedule_info(name).ops_bound(pp, microbatches)
    if ops > MAX_OPS:
        raise ValueError(
            f"a global batch of {batch:,} sequences makes {microbatches:,} microbatches per "
            f"pipeline at PP={pp}, and {name} would hold about {ops:,} ops, over the limit of "
            f"{MAX_OPS:,}: use a smaller global batch"
        )
