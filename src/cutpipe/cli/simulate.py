"""``cutpipe simulate``: time one schedule under a cost model and print its metrics."""

from __future__ import annotations

import argparse

from cutpipe.cli.common import (
    add_costs_argument,
    add_schedule_source,
    fmt,
    output_file,
    print_json,
    schedule_from_args,
)
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

#: Ranks the per-rank table shows (a terminal table of thousands of rows helps nobody and takes
#: seconds to lay out); ``--json`` lists every rank.
MAX_RANK_ROWS = 256


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "simulate",
        help="simulate one schedule and print its metrics",
        description="Simulate one schedule under a cost model. Costs are per stage of that "
        "schedule: a V-shape stage is half a 1F1B stage and is given its own cost.",
    )
    add_schedule_source(parser)
    add_costs_argument(parser, "", "stage of this schedule")
    parser.add_argument("--json", action="store_true", help="print the metrics as JSON")
    parser.add_argument(
        "--timeline", type=output_file(), metavar="FILE", help="also write the timeline as JSON"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    schedule = schedule_from_args(args)
    timeline = simulate(schedule, args.costs)
    result = metrics(timeline, args.costs)
    if args.timeline is not None:
        timeline.save(args.timeline)
    if args.json:
        print_json(result.to_dict())
        return 0
    from rich.console import Console
    from rich.table import Table

    summary = Table(
        title=f"{schedule.name}: {result.ranks} ranks, {result.stages} stages, "
        f"{result.microbatches} microbatches",
        show_header=False,
    )
    for label, value in (
        ("makespan", fmt(result.makespan)),
        ("bubble ratio (absolute)", fmt(result.bubble_ratio)),
        ("bubble ratio (span)", fmt(result.bubble_ratio_span)),
        ("p2p sends", str(result.p2p_sends)),
        ("p2p bytes", fmt(result.p2p_bytes)),
        (
            "EP all-to-alls (in F&B pairs)",
            f"{result.ep_alltoalls} ({result.ep_alltoalls_overlapped})",
        ),
    ):
        summary.add_row(label, value)
    per_rank = Table("rank", "busy", "idle", "span", "peak activations", "params (share)")
    shown = min(result.ranks, MAX_RANK_ROWS)
    if shown < result.ranks:
        per_rank.caption = (
            f"ranks {shown}..{result.ranks - 1} left out of this table: --json lists every rank"
        )
    for r in range(shown):
        per_rank.add_row(
            str(r),
            fmt(result.busy_per_rank[r]),
            fmt(result.idle_per_rank[r]),
            fmt(result.span_per_rank[r]),
            fmt(result.peak_activations_per_rank[r]),
            fmt(result.params_per_rank[r]),
        )
    console = Console()
    console.print(summary)
    console.print(per_rank)
    return 0
