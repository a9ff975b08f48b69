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
from cutpipe.schedule.schedule import Schedule
from cutpipe.train.options import TrainOptions, resolve_schedule

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

    @property
    def pipeline_ranks(self) -> int:
        return self.schedule.num_ranks


def with_plan(options: TrainOptions) -> TrainOptions:
    """``options`` with what ``--plan`` fixes (its layout's replicas, data-parallel mode and
    recompute) taken from the plan; an option given otherwise is an error that says so."""
    if options.plan is None:
        return options
    plan = PlanFile.load(options.plan)
    if plan.ep != 1 or plan.tp != 1:
        raise ValueError(
            f"--plan {options.plan} uses EP={plan.ep} TP={plan.tp}; cutpipe train runs pipeline "
            "and data parallelism: plan with --ep 1 (and no TP), or run the layout yourself"
        )
    if plan.fp8:
        raise ValueError(f"--plan {options.plan} trains in FP8, which cutpipe train does not")
    wanted = {"dp": plan.dp, "dp_mode": ZERO_MODES[plan.zero], "recompute": plan.recompute}
    given = {"dp": options.dp, "dp_mode": options.dp_mode, "recompute": options.recompute}
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
    """The layout of ``options`` (``with_plan`` applied) on ``world`` processes."""
    if world % options.dp:
        raise ValueError(
            f"{world} processes do not split into --dp {options.dp} replicas: start a multiple "
            f"of {options.dp} (--nproc x --nnodes)"
        )
    ranks = world // options.dp
    if options.plan is not None:
        plan = PlanFile.load(options.plan)
        _check_plan(plan, options.plan, ranks, task)
        schedule = plan.resolve()
        sizes = tuple(plan.stage_sizes)
    else:
        schedule = resolve_schedule(options.schedule_source, ranks, options.microbatches)
        # an emulated run cuts no model
        sizes = () if options.emulate else tuple(task.default_sizes(schedule))
    m = schedule.num_microbatches
    batch = options.batch or task.microbatch_size * m * options.dp
    if batch % (m * options.dp):
        raise ValueError(
            f"batch {batch} does not split into {options.dp} replicas x {m} microbatches: use "
            f"a multiple of {m * options.dp}"
        )
    return RunLayout(schedule, options.dp, sizes, batch)


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
