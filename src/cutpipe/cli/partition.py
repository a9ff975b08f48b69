"""``cutpipe partition``: split a model's layers into a schedule's stages for the shortest step."""

from __future__ import annotations

import argparse

from cutpipe.cli.common import (
    add_model_arguments,
    add_plan_output,
    add_schedule_source,
    load_model_arguments,
    positive_int,
    print_json,
    schedule_from_args,
)
from cutpipe.plan.costs.model import model_items, p2p_time, w_memory
from cutpipe.plan.partition import Partition, balance, evaluate, even_sizes
from cutpipe.plan.plan_file import PlanFile
from cutpipe.plan.recommend.recommend import USABLE_MEMORY, label
from cutpipe.schedule.schedule import Schedule
from cutpipe.spec import ModelSpec


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "partition",
        help="balance a model's layers over a schedule's stages",
        description="Split the embedding, the layers and the head into the schedule's stages so "
        "that the simulated step is shortest and every rank fits in memory; compare with an "
        "even split of the layers.",
    )
    add_schedule_source(parser)
    add_model_arguments(parser)
    parser.add_argument(
        "--ep", type=positive_int, default=1, help="expert-parallel size (MoE models)"
    )
    add_plan_output(
        parser, "the balanced partition (the schedule, its microbatches, blocks per stage)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(run=run)


def plan_file(
    args: argparse.Namespace, model: ModelSpec, hardware_name: str, schedule: Schedule,
    best: Partition,
) -> PlanFile:  # fmt: skip
    """The balanced partition as a plan file: the schedule as given, by its registry label
    (``--schedule``) or whole (``--from``), on as many pipelines as its EP groups need (DP =
    EP), its step as predicted."""
    given = label(args.schedule) if args.schedule_file is None else schedule
    m = schedule.num_microbatches
    return PlanFile(
        model=model.name, layers=model.layers, schedule=given, microbatches=m,
        stage_sizes=tuple(best.sizes), pp=schedule.num_ranks, dp=args.ep, ep=args.ep,
        predicted={
            "step_time": best.step_time, "tokens_per_second": model.tokens * m / best.step_time,
            "peak_memory": max(best.memory), "hardware": hardware_name,
        },
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    model, hardware, profile, memory = load_model_arguments(args)
    schedule = schedule_from_args(args)
    within = args.ep <= hardware.gpus_per_node
    items = (
        profile.items_for(hardware, args.ep, within)
        if profile
        else model_items(model, hardware, args.ep, within)
    )
    comm = p2p_time(model, hardware, within_node=schedule.num_ranks <= hardware.gpus_per_node)
    kept = profile.w_memory if profile else w_memory(model)
    cap = (hardware.memory if memory is None else memory) * USABLE_MEMORY
    best = balance(schedule, items, comm, kept, cap)
    even = evaluate(schedule, items, even_sizes(items, schedule.num_stages), comm, kept)
    gain = 1 - best.step_time / even.step_time
    layers = [size - (s == 0) - (s == len(best.sizes) - 1) for s, size in enumerate(best.sizes)]
    if args.output is not None:
        plan_file(args, model, hardware.name, schedule, best).save(args.output)
    if args.json:
        report = {
            "schedule": schedule.name,
            "layers_per_stage": layers,
            "step_time": best.step_time,
            "even_step_time": even.step_time,
            "gain": gain,
            "memory_per_rank": best.memory,
            "even_memory_per_rank": even.memory,
        }
        if args.output is not None:
            report["plan_file"] = str(args.output)
        print_json(report)
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{model.name} ({model.seq_len:,}-token sequences): {schedule.name} on "
        f"{schedule.num_ranks} x {hardware.name}"
    )
    for column in ("stage", "rank", "layers", "F+B+W (ms)", "rank memory GB"):
        table.add_column(column, justify="right")
    work = [
        f + b + w
        for f, b, w in zip(*(best.costs.per_stage(k, len(layers)) for k in "fbw"), strict=True)
    ]
    for stage, count in enumerate(layers):
        rank = schedule.placement.pipes[0][stage]
        extra = " +embedding" if stage == 0 else " +head" if stage == len(layers) - 1 else ""
        table.add_row(str(stage), str(rank), f"{count}{extra}", f"{work[stage] * 1e3:.2f}",
                      f"{best.memory[rank] / 1e9:.1f}")  # fmt: skip
    console = Console()
    console.print(table)
    console.print(
        f"step {best.step_time * 1e3:.1f} ms balanced vs {even.step_time * 1e3:.1f} ms with layers "
        f"split evenly: {gain:.1%} faster; fullest rank {max(best.memory) / 1e9:.1f} GB of "
        f"{cap / 1e9:.1f} GB usable"
    )
    if args.output is not None:
        print(f"wrote the partition to {args.output}")
    return 0
