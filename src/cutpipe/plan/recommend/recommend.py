"""Which schedule and parallel layout to use: every fitting choice simulated, the best few ranked.

For ``devices`` GPUs it tries every factoring into pipeline x data x tensor x context parallel
ranks (PP x DP x TP x CP; CP is 1 unless given), with expert parallelism inside the
data-parallel group for an MoE (EP divides both DP and the experts), every schedule that
accepts the pipeline shape (a schedule with chunks named without them, ``interleaved``, is
tried with every chunk count ``chunk_choices`` gives for the pipeline size), and the microbatch
count the global batch gives. Any of PP, DP, EP, CP, the chunks, the microbatch size and the
training setting can be fixed (``plan.recommend.force``); the rest is searched. Each candidate's stages are balanced by compute (embedding and head included, each
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
from dataclasses import replace

from cutpipe.plan.costs.model import Hardware, Training
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
from cutpipe.plan.recommend.force import Force
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
    chunk_choices,
    expand,
    label,
    takes_chunks,
    title,
)
from cutpipe.plan.recommend.settings import Search, best_setting, divisors
from cutpipe.records import check_count
from cutpipe.schedule.limits import MAX_OPS
from cutpipe.schedule.registry import schedule_info
from cutpipe.spec import ModelSpec

__all__ = [  # the planner's public names, wherever they live
    "CHUNK_CHOICES", "DEFAULT_SCHEDULES", "MAX_DEVICES", "OVERLAPPING", "SINGLE_RANK",
    "STEP_MEASURES", "USABLE_MEMORY", "Force", "Job", "Layout", "Plan", "Rejected", "Search",
    "best_setting", "chunk_choices", "divisors", "evaluate", "expand", "label", "reason",
    "recommend",
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
    pp: int | None = None,
    dp: int | None = None,
    ep: int | None = None,
    cp: int | None = None,
    chunks: int | None = None,
    microbatch_size: int | None = None,
    sequence_parallel: bool = True,
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
    least work, is below them is rejected unsimulated); None simulates everything.

    ``pp``, ``dp``, ``ep``, ``cp`` fix those sizes (CP is 1 unless given; the sequence length
    must divide by 2*CP), ``chunks`` the chunks of schedules named without them
    (``interleaved``), ``microbatch_size`` replaces the model's sequences per microbatch, and
    ``sequence_parallel`` says whether TP splits norms and dropout along the sequence. A fixed
    value that leaves no layout is a ValueError naming it."""
    check_schedules(schedules)
    if microbatch_size is not None:
        model = with_microbatch_size(model, microbatch_size, profile)
    job = Job(model, hardware, devices, global_batch, memory, usable_memory, profile, step_boundary)
    if rejected is not None and not isinstance(rejected, list):
        raise TypeError(f"rejected must be a list to append to, or None, got {rejected!r}")
    search = Search.checked(
        zero, recompute, precision, tp, hardware, model, profile,
        sequence_parallel=sequence_parallel, cp=1 if cp is None else cp,
    )  # fmt: skip
    force = Force.checked(job, schedules, tp, pp=pp, dp=dp, ep=ep, cp=cp, chunks=chunks)
    dropped: list[Rejected] = []
    try:
        layouts = candidate_layouts(job, schedules, search, dropped, force)
        return ranked_plans(job, layouts, search, keep, dropped)
    finally:  # the reasons are there for the caller even when nothing fits
        if rejected is not None:
            rejected.extend(dropped)


def candidate_layouts(
    job: Job, schedules: Sequence[str], search: Search, dropped: list[Rejected],
    force: Force | None = None,
) -> list[Layout]:  # fmt: skip
    """Every layout of the job's devices that ``force`` allows and that runs one of
    ``schedules`` on the microbatches its global batch gives; the others go to ``dropped`` with
    the reason. A ValueError if none runs, or if simulating them all would take too long."""
    model, devices, batch = job.model, job.devices, job.batch
    force = force or Force(cp=search.cp)
    items = len(job_items(job, 1))
    cp = search.cp
    layouts: list[Layout] = []
    for pp, tp in search.shapes(devices, model, job.hardware):
        dp = devices // (pp * tp * cp)
        if not force.allows(pp, dp):
            continue
        size = model.microbatch_size
        if batch % dp or (batch // dp) % size:
            shares = f"DP={dp} equal shares" + (
                f" of whole microbatches of {size} sequences" if size > 1 else ""
            )
            why = f"global batch {batch} does not split into {shares}"
            dropped.append(Rejected(pp, dp, 1, "", 0, why, tp, cp=cp))
            continue
        m = batch // dp // size
        eps = [e for e in divisors(dp) if model.experts % e == 0] if model.moe else [1]
        if force.ep is not None:
            if force.ep not in eps:
                why = f"EP={force.ep} does not divide DP={dp}"
                dropped.append(Rejected(pp, dp, force.ep, "", 0, why, tp, cp=cp))
                continue
            eps = [force.ep]
        names = schedule_labels(schedules, pp, m, model.layers, force.chunks)
        tried = names if pp > 1 else [n for n in SINGLE_RANK if n in names] or names[:1]
        for ep in eps:
            for name in tried:
                layout = Layout(pp, dp, ep, name, m, tp, cp)
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
        raise ValueError(nothing_runs(job, schedules, dropped, force))
    return layouts


def schedule_labels(
    schedules: Sequence[str], pp: int, microbatches: int, layers: int, chunks: int | None = None
) -> list[str]:
    """The ``label``s tried at PP = ``pp``: a schedule named without its chunks once per
    ``chunk_choices`` whose ops stay within ``MAX_OPS`` (the fewest chunks always, so that a
    batch too large is still an error), or with ``chunks`` when fixed; the others as given."""
    out: list[str] = []
    for name in schedules:
        if takes_chunks(name):
            counts = [chunks] if chunks is not None else chunk_choices(pp, layers)
            names = expand([name], counts)
            names = names[:1] + [
                n for n in names[1:] if schedule_info(n).ops_bound(pp, microbatches) <= MAX_OPS
            ]
        else:
            names = expand([name])
        out.extend(n for n in names if n not in out)
    return out


def nothing_runs(job: Job, schedules: Sequence[str], dropped: list[Rejected], force: Force) -> str:
    """Why no layout of the job runs: the batch, the schedules, or what the caller fixed."""
    devices, batch, size = job.devices, job.batch, job.model.microbatch_size
    forced = force.describe()
    within = f" with {forced}" if forced else ""
    if not dropped:
        return f"no layout of {devices} devices has {forced}: fix fewer of them"
    if all(not r.schedule for r in dropped):
        first = dropped[0]
        return (
            f"no layout of {devices} devices{within} splits a global batch of {batch} sequences "
            f"into whole microbatches of {size} (e.g. {first.layout()}: {first.reason}): pick a "
            "global batch divisible by the data-parallel sizes"
        )
    first = next(r for r in dropped if r.schedule)
    return (
        f"none of {', '.join(schedules)} runs on any layout of {devices} devices{within} (e.g. "
        f"{first.schedule} on {first.layout()}: {first.reason}): use other schedules, "
        "another device count or another global batch"
        + (", or fix less of the layout" if forced else "")
    )


def with_microbatch_size(model: ModelSpec, size: int, profile: Profile | None) -> ModelSpec:
    """``model`` with ``size`` sequences per microbatch (a profile keeps the size it measured)."""
    check_count(size, "microbatch_size")
    if profile is not None and size != profile.model.microbatch_size:
        raise ValueError(
            f"the profile was measured at microbatches of {profile.model.microbatch_size} "
            f"sequences: drop microbatch_size {size}, or profile at that size"
        )
    return replace(model, microbatch_size=size)


def ranked_plans(
    job: Job, layouts: Sequence[Layout], search: Search, keep: int | None,
    dropped: list[Rejected], *, reference: bool = False,
) -> list[Plan]:  # fmt: skip
    """The fitting plans of ``layouts``, fastest first, each under its best training setting
    (``best_setting``); the most promising layouts are simulated first, so that with ``keep``
    a layout whose throughput bound is below the ``keep`` best so far is dropped unsimulated.
    The ``keep`` fastest (all without ``keep``) are simulated once more for their breakdown
    (``split_idle``). A ValueError, naming the closest refusal, if none fits. ``reference``:
    nothing kept between candidates and every balancing move scored alone, the slow way whose
    plans the fast one matches exactly (tests/test_recommend_speed.py)."""
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

            def attempt(
                training: Training, rebalance: bool, layout: Layout = layout
            ) -> Plan | Rejected:
                return evaluate(job, layout, training, rebalance, cache, split_idle=False,
                                screened=not reference)  # fmt: skip

            outcome = best_setting(search.settings(layout.dp, layout.tp, layout.pp), attempt)
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
    ranked = sorted(plans, key=lambda p: -p.tokens_per_second)
    shown = len(ranked) if keep is None else keep
    return [split_idle(job, plan, cache) for plan in ranked[:shown]] + ranked[shown:]


def split_idle(job: Job, plan: Plan, cache: dict) -> Plan:
    """``plan`` simulated again without transfer time, so that its breakdown tells the pipeline
    sends from the bubble (``evaluate``'s ``split_idle``): the same plan otherwise (rebalancing
    finds the split it was priced with)."""
    layout = Layout(plan.pp, plan.dp, plan.ep, plan.schedule, plan.microbatches, plan.tp, plan.cp)
    again = evaluate(job, layout, plan.training, True, cache)
    return again if isinstance(again, Plan) and again.stage_sizes == plan.stage_sizes else plan


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
