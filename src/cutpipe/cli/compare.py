"""``cutpipe compare``: the Cut-in-half report's comparison table, simulated beside the closed forms."""

from __future__ import annotations

import argparse

from cutpipe.cli.common import (
    add_costs_argument,
    fmt,
    load_schedule_file,
    positive_int,
    print_json,
    readable_file,
    schedule_names,
)
from cutpipe.sim.compare import (
    DEFAULT_COSTS,
    DEFAULT_MICROBATCHES,
    DEFAULT_RANKS,
    DEFAULT_SCHEDULES,
    compare,
)
from cutpipe.sim.formulas import CLOSED_FORMS


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "compare",
        help="1F1B vs DualPipe vs Cut-in-half vs ZB-H1 vs ZB-V on the same devices",
        description="Compare schedules on the same devices and model: parameters, bubble "
        "(simulated beside the published form), activations, pipeline and EP traffic.",
    )
    parser.add_argument(
        "--ranks", "-r", type=positive_int, default=DEFAULT_RANKS, help="devices (default 8)"
    )
    parser.add_argument(
        "--microbatches",
        "-m",
        type=positive_int,
        default=DEFAULT_MICROBATCHES,
        help=f"microbatches per step (default {DEFAULT_MICROBATCHES})",
    )
    add_costs_argument(parser, "F=1,B=1,W=1,FB=2.5,ep_bytes=1", "device share (1F1B stage)")
    parser.add_argument(
        "--schedules",
        type=schedule_names,
        default=DEFAULT_SCHEDULES,
        help=f"comma-separated names (default {','.join(DEFAULT_SCHEDULES)})",
    )
    parser.add_argument(
        "--from",
        dest="schedule_files",
        action="append",
        default=[],
        type=readable_file,
        metavar="FILE",
        help="also compare the schedule in this file (.json or .csv, for the same -r and -m); "
        "repeat for more",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.set_defaults(run=run, default_costs=DEFAULT_COSTS)


def run(args: argparse.Namespace) -> int:
    loaded = tuple(load_schedule_file(path) for path in args.schedule_files)
    rows = compare(args.ranks, args.microbatches, args.costs, (*args.schedules, *loaded))
    if args.json:
        print_json(
            [
                {
                    "schedule": row.schedule,
                    "error": row.error,
                    "formula": row.formula,
                    "measure": row.measure,
                    "bubble": row.bubble,
                    "bubble_formula": row.bubble_formula,
                    "agrees": row.agrees,
                    "formula_exact": row.formula_exact,
                    "bubble_ratio": row.metrics and row.metrics.bubble_ratio,
                    "bubble_ratio_span": row.metrics and row.metrics.bubble_ratio_span,
                    "makespan": row.metrics and row.metrics.makespan,
                    "work": row.metrics and sum(row.metrics.busy_per_rank),
                    "params_x": row.params_x,
                    "activations": row.activations,
                    "pp_traffic_x": row.pp_traffic_x,
                    "ep_traffic_x": row.ep_traffic_x,
                    "ep_overlapped": row.ep_overlapped,
                }
                for row in rows
            ]
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    costs = args.costs
    table = Table(
        title=f"{args.ranks} devices, {args.microbatches} microbatches; per device share: F={fmt(costs.f)} "
        f"B={fmt(costs.b)} W={fmt(costs.w)} F&B={fmt(costs.fb)} comm={fmt(costs.comm)}",
    )
    for header in ("method", "params", "bubble", "formula", "act.", "PP comm", "EP comm"):
        table.add_column(header, justify="left" if header == "method" else "right")
    shown = []
    for row in rows:
        if row.error:
            table.add_row(row.title, "", f"[red]{row.error}[/red]")
            continue
        shown.append(row)
        if row.bubble_formula is None:
            formula = "n/a"
        else:
            formula = fmt(row.bubble_formula) + (" *" if row.agrees is False else "")
        ratio = row.metrics.bubble_ratio_span if row.measure == "span" else row.metrics.bubble_ratio
        table.add_row(
            row.title,
            f"{fmt(row.params_x, 2)}x",
            f"{fmt(row.bubble)} ({ratio:.1%})",
            formula,
            fmt(row.activations, 2),
            f"{fmt(row.pp_traffic_x, 2)}x",
            f"{fmt(row.ep_traffic_x, 2)}x ({row.ep_overlapped:.0%})",
        )
    console = Console()
    console.print(table)
    console.print(
        "bubble: simulated idle time of the most idle rank (ZB-V, ZB-H2: longest span minus least "
        "busy time) and its share of the step. formula: the published closed form, '*' where it "
        "differs from the simulation. act.: peak activations, in one device share's "
        "microbatch activations. comm: traffic against 1F1B; (%): all-to-alls inside overlapped "
        "F&B pairs, which can hide them."
    )
    for row in shown:
        form = CLOSED_FORMS.get(row.schedule)
        if form:
            console.print(
                f"  {row.title}: {form.bubble_text}, exact when {form.exact_when}, "
                "equal stages, no communication"
            )
    return 0
