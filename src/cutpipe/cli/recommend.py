"""``cutpipe recommend``: the fastest schedule and parallel layout for a model on a cluster."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from cutpipe.cli.common import (
    add_model_arguments,
    load_model_arguments,
    positive_int,
    print_json,
    schedule_names,
    whole,
)
from cutpipe.plan.recommend import DEFAULT_SCHEDULES, MAX_DEVICES, reason, recommend


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "recommend",
        help="simulate every layout and schedule that fits and rank them",
        description="Enumerate pipeline x data x expert parallel layouts of the devices and every "
        "schedule that fits in memory, simulate each step, and print the fastest few.",
    )
    parser.add_argument(
        "--devices", "-n", type=whole(1, MAX_DEVICES), required=True, help="number of GPUs"
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--global-batch",
        type=positive_int,
        metavar="B",
        help="sequences per step (default: 8 per device)",
    )
    parser.add_argument(
        "--schedules",
        type=schedule_names,
        default=DEFAULT_SCHEDULES,
        help=f"comma-separated schedules to consider (default: {','.join(DEFAULT_SCHEDULES)})",
    )
    parser.add_argument("--top", type=positive_int, default=8, help="how many plans to print")
    parser.add_argument("--json", action="store_true", help="print the plans as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    model, hardware, profile, memory = load_model_arguments(args)
    plans = recommend(
        model, hardware, args.devices, args.global_batch, memory, list(args.schedules), profile
    )
    shown = plans[: args.top]
    if args.json:
        print_json({"plans": [asdict(plan) for plan in shown], "reason": reason(plans, hardware)})
        return 0
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title=f"{model.name} on {args.devices} x {hardware.name}"
        + (" (measured costs)" if profile else ""),
    )
    for column in ("layout", "schedule", "m", "tok/s", "step s", "bubble", "GB", "comm"):
        left = column in ("layout", "schedule")
        table.add_column(column, justify="left" if left else "right", no_wrap=True)
    for plan in shown:
        table.add_row(
            plan.layout(),
            plan.schedule_label(),
            str(plan.microbatches),
            f"{plan.tokens_per_second:,.0f}",
            f"{plan.step_time:.3f}",
            f"{plan.bubble:.1%}",
            f"{plan.peak_memory / 1e9:.1f}",
            f"{plan.comm_share:.0%}",
        )
    console = Console()
    console.print(table)
    console.print(reason(plans, hardware))
    return 0
