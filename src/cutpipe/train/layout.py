"""Where a run's pieces go: the schedule for its pipeline ranks, the data-parallel replicas, the
blocks of each stage and the batch; from a plan file (``--plan``) exactly as the planner chose
them, or from the trainer's own defaults.

The launcher works this out before it starts any process (so a plan for other ranks, or a
shape the schedule refuses, fails once, in one line), and every worker works out the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cutpipe.plan.plan_file import PlanFile
from cutpipe.schedule.registry import schedule_info
from cutpipe.schedule.schedule import Schedule
from cutpipe.train.options import (
    GLOBAL_BATCH_MICROBATCHES,
    TrainOptions,
    default_microbatches,
    is_schedule_file,
    resolve_schedule,
)

if TYPE_CHECKING:
    from cutpipe.train.tasks import Task

#: The data-parallel mode that runs a plan's ZeRO stage (ZeRO-2 has no mode of its own here:
#: FSDP shards gradients too).
ZERO_MODES = {0: "allreduce", 1: "zero1", 2: "fsdp", 3: "fsdp"}


@dataclass(frozen=True)
class RunLayout:
    """The shape of a run on ``world`` processes."""

    schedule: Schedule
    dp: int
    stage_sizes: tuple[int, ...]  # blocks per stage: what cut_module cuts
    batch: int  # samples per pipeline step, over every replica
    ep: int = 1

    @property
    def replicas(self) -> int:
        """Pipelines training on different shares of each batch: DP x EP."""
        return self.dp * self.ep

    @property
    def pipeline_ranks(self) -> int:
        return self.schedule.num_ranks


def with_plan(options: TrainOptions) -> TrainOptions:
    """``options`` with what ``--plan`` fixes (its layout's replicas, data-parallel mode and
    recompute) taken from the plan; an option given otherwise is an error that says so."""
    if options.plan is None:
        return options
    plan = PlanFile.load(options.plan)
    if plan.tp != 1:
        raise ValueError(
            f"--plan {options.plan} uses TP={plan.tp}; cutpipe train runs pipeline, data and "
            "expert parallelism: plan without TP (recommend --tp 1), or run the layout yourself"
        )
    if plan.cp != 1:
        raise ValueError(
            f"--plan {options.plan} uses CP={plan.cp} (context parallelism), which cutpipe train "
            "does not run: plan without it (recommend without --cp), or run the layout yourself"
        )
    if plan.fp8:
        raise ValueError(f"--plan {options.plan} trains in FP8, which cutpipe train does not")
    wanted = {
        "dp": plan.dp // plan.ep,
        "ep": plan.ep,
        "dp_mode": ZERO_MODES[plan.zero],
        "recompute": plan.recompute,
    }  # a plan's DP counts every data-parallel rank; its EP groups are carved out of them
    given = {name: getattr(options, name) for name in wanted}
    defaults = TrainOptions()
    clashes = [
        f"--{name.replace('_', '-')} {given[name]} (the plan says {wanted[name]})"
        for name in wanted
        if given[name] != wanted[name] and given[name] != getattr(defaults, name)
    ]
    if options.microbatches is not None and options.microbatches != plan.microbatches:
        clashes.append(f"--microbatches {options.microbatches} (the plan says {plan.microbatches})")
    if clashes:
        raise ValueError(
            f"--plan {options.plan} fixes these: drop {', '.join(clashes)}, or plan again"
        )
    return options.replace(**wanted, microbatches=plan.microbatches)


def run_layout(options: TrainOptions, world: int, task: Task) -> RunLayout:
    """The layout of ``options`` (``with_plan`` applied) on ``world`` processes: the global
    batch is the same on any layout (``--global-batch``, or the default), and microbatches not
    given are the schedule's default, or the nearest count that divides each pipeline's share."""
    replicas = options.dp * options.ep
    if world % replicas:
        raise ValueError(
            f"{world} processes do not split into --dp {options.dp} x --ep {options.ep} "
            f"replicas: start a multiple of {replicas} (--nproc x --nnodes)"
        )
    if not options.emulate:  # an emulated run's experts are sleeps: any model takes them
        task.check_experts(options.ep)
    ranks = world // replicas
    accumulated = options.grad_accum * replicas  # pipelines' shares of one optimizer step
    plan = None if options.plan is None else PlanFile.load(options.plan)
    # by default a step is 8 of the model's microbatches; a plan fixes the microbatches, and a
    # step is then the plan's microbatches, each of the model's size, on every pipeline
    per_step = GLOBAL_BATCH_MICROBATCHES if plan is None else plan.microbatches * accumulated
    global_batch = options.global_batch or task.microbatch_size * per_step
    # an emulated run trains nothing: its batch is the model's microbatches
    share = None if options.emulate else _share(global_batch, accumulated, options)
    if plan is not None:
        _check_plan(plan, options.plan, ranks, task)
        schedule = plan.resolve()
        sizes = tuple(plan.stage_sizes)
    else:
        microbatches = options.microbatches
        if (
            microbatches is None
            and share is not None
            and not is_schedule_file(options.schedule_source)
        ):
            microbatches = fitting_microbatches(options.schedule_source, ranks, share, options)
        schedule = resolve_schedule(options.schedule_source, ranks, microbatches)
        sizes = () if options.emulate else tuple(task.default_sizes(schedule))  # cuts no model
    _check_tied_embeddings(task, schedule)
    m = schedule.num_microbatches
    if share is None:
        return RunLayout(
            schedule, options.dp, sizes, task.microbatch_size * m * replicas, options.ep
        )
    if share % m:
        raise ValueError(
            f"--global-batch {global_batch} gives each pipeline {share} sequences per pipeline "
            f"step, which do not split into {m} microbatches: use a multiple of "
            f"{m * accumulated} (or other --microbatches)"
        )
    return RunLayout(schedule, options.dp, sizes, share * replicas, options.ep)


def _share(global_batch: int, accumulated: int, options: TrainOptions) -> int:
    """Sequences of ``global_batch`` one pipeline takes per pipeline step."""
    if global_batch % accumulated:
        parts = f"{options.dp * options.ep} replicas (--dp x --ep)"
        if options.grad_accum > 1:
            parts += f" x {options.grad_accum} accumulated steps"
        raise ValueError(
            f"--global-batch {global_batch} does not split into {parts}: use a multiple of "
            f"{accumulated}"
        )
    return global_batch // accumulated


def fitting_microbatches(schedule: str, ranks: int, share: int, options: TrainOptions) -> int:
    """Microbatches for a pipeline that takes ``share`` sequences per step: the schedule's
    default when it divides them, else the nearest count above it that does, else the largest
    below it the schedule accepts."""
    info = schedule_info(schedule)
    preferred = default_microbatches(schedule, ranks)
    least = info.min_microbatches(ranks)
    fitting = [m for m in _divisors(share) if m >= least and info.accepts(ranks, m)]
    if not fitting and not info.accepts(ranks, preferred):
        return preferred  # the shape itself is refused: the schedule says why
    if not fitting:
        wanted = least * options.grad_accum * options.dp * options.ep
        given = "--global-batch" if options.global_batch else "the default global batch"
        raise ValueError(
            f"{given} gives each pipeline {share} sequences per pipeline step, which do not "
            f"split into the {least} or more microbatches {info.name} needs on {ranks} ranks: "
            f"use --global-batch {wanted} or a multiple of it"
        )
    above = [m for m in fitting if m >= preferred]
    return min(above) if above else max(fitting)


def _divisors(count: int) -> list[int]:
    """The divisors of ``count``, ascending."""
    small = [d for d in range(1, int(count**0.5) + 1) if count % d == 0]
    return sorted({*small, *(count // d for d in small)})


def _check_plan(plan: PlanFile, path: str, ranks: int, task: Task) -> None:
    if plan.pp != ranks:
        raise ValueError(
            f"--plan {path} is for {plan.pp} pipeline ranks x {plan.dp} replicas = "
            f"{plan.pp * plan.dp} processes; this run has {ranks * plan.dp}: start "
            f"{plan.pp * plan.dp} (--nproc x --nnodes)"
        )
    if plan.layers + 2 != task.num_blocks() or plan.model != task.name:
        raise ValueError(
            f"--plan {path} cuts {plan.model} ({plan.layers} layers), but --model is "
            f"{task.name} ({task.num_blocks() - 2} layers): plan this model, or train that one"
        )


def _check_tied_embeddings(task: Task, schedule: Schedule) -> None:
    """A head tied to the embedding is one parameter: the rank that holds the embedding must
    hold the head too (a V schedule's first rank does), and hold it once (no mirrored copies),
    or the two uses' gradients would never meet."""
    spec = getattr(task, "spec", None)
    if not getattr(spec, "tie_embeddings", False) or schedule.num_ranks == 1:
        return
    placement, last = schedule.placement, schedule.num_stages - 1
    together = any(
        {0, last} <= set(placement.stages_of(rank)) for rank in range(schedule.num_ranks)
    )
    mirrored = any(len(placement.copies(stage)) > 1 for stage in range(schedule.num_stages))
    if mirrored or not together:
        raise ValueError(
            f"{task.name} ties its head to its embedding (tie_word_embeddings), so one rank must "
            f"hold both, once; {schedule.name} puts them on different ranks or copies them: use "
            "a V schedule (dualpipev, zbv), or one process"
        )
