"""``cutpipe tune``: a cost-aware zero-bubble schedule for given costs and memory cap."""

from __future__ import annotations

import argparse
from contextlib import suppress

from cutpipe.cli.common import (
    add_costs_argument,
    fmt,
    output_file,
    positive_int,
    print_json,
    real,
)
from cutpipe.plan.bounds import v_bubble_lower_bound
from cutpipe.plan.scheduler import FIXED, cost_aware, default_cap
from cutpipe.schedule.fileformat import ENDINGS, save_schedule
from cutpipe.schedule.registry import schedule_info
from cutpipe.sim.costs import MAX_COST
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

OBJECTIVES = {
    "makespan": lambda result: (result.makespan, result.bubble_ratio_span),
    "span": lambda result: (result.bubble_ratio_span, result.makespan),
}


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "tune",
        help="search a cost-aware schedule under a memory cap",
        description="Place F, B and W passes (and, on a V, the order of chunks) by simulated time "
        "for the given costs, under a per-rank activation cap, and compare with the fixed orders.",
    )
    parser.add_argument("--placement", choices=("linear", "v"), default="v",
                        help="one stage per rank (linear) or two folded into a V (default v)")  # fmt: skip
    parser.add_argument("--ranks", "-r", type=positive_int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=positive_int, required=True,
                        help="microbatches per step")  # fmt: skip
    add_costs_argument(parser, "", "stage (a V stage is half a rank's layers)")
    parser.add_argument(
        "--memory-cap",
        type=real(0.0, MAX_COST, unit="stage activations"),
        metavar="A",
        help="activations a rank may hold, in units of one stage's (default: 1F1B's peak, "
        "R units on a linear placement and 2R on a V)",
    )
    parser.add_argument("--objective", choices=tuple(OBJECTIVES), default="makespan",
                        help="what to minimise: the step (makespan) or the span bubble")  # fmt: skip
    parser.add_argument("--seconds", type=real(0.0, exclusive=False, unit="seconds"),
                        default=1.0, help="local-search budget")  # fmt: skip
    parser.add_argument(
        "-o",
        "--output",
        type=output_file(tuple(ENDINGS)),
        metavar="FILE",
        help="write the tuned schedule: .json (cutpipe's format, for --from in simulate, draw, "
        "compare and train) or .csv (torch's)",
    )
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    costs, R, m = args.costs, args.ranks, args.microbatches
    tuned = cost_aware(args.placement, R, m, costs, args.memory_cap, OBJECTIVES[args.objective],
                       args.seconds)  # fmt: skip
    rows = [(tuned.name, metrics(simulate(tuned, costs), costs))]
    for name in FIXED[args.placement]:
        info = schedule_info(name)
        if info.accepts(R, m):
            fixed = info.generate(R, m)
            rows.append((name, metrics(simulate(fixed, costs), costs)))
    cap = args.memory_cap if args.memory_cap is not None else default_cap(args.placement, R, costs)
    floor = None
    if args.placement == "v":
        with suppress(ValueError):  # per-stage costs, all-to-alls: the bound does not cover them
            floor = v_bubble_lower_bound(R, m, costs, cap)
    if args.output is not None:
        save_schedule(tuned, args.output)
    if args.json:
        report = {name: result.to_dict() for name, result in rows}
        if floor is not None:
            report["lower_bound"] = {"bubble_ratio_span": floor}
        print_json(report)
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.placement} placement, R={R}, m={m}, activation cap {fmt(cap)}")
    for column in ("schedule", "makespan", "bubble (abs)", "bubble (span)", "peak activations"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for name, result in rows:
        table.add_row(name, fmt(result.makespan), fmt(result.bubble_ratio), fmt(result.bubble_ratio_span),
                      fmt(max(result.peak_activations_per_rank))
                      + ("" if max(result.peak_activations_per_rank) <= cap + 1e-9 else " (over)"))  # fmt: skip
    console = Console()
    console.print(table)
    if floor is not None:
        console.print(f"No V schedule has a span bubble below {floor:.6f} with these costs and this "
                      "cap (cutpipe.plan.bounds).")  # fmt: skip
    return 0
