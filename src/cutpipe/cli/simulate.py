"""``cutpipe simulate``: time one schedule under a cost model and print its metrics.

With ``--steps K`` it also runs K steps back to back (``cutpipe.sim.steps``) and prints the time
per step once they repeat, for synchronised and overlapping step boundaries, beside one step's
makespan and longest span.
"""

from __future__ import annotations

import argparse

from cutpipe.cli.common import (
    add_costs_argument,
    add_schedule_source,
    add_steps_arguments,
    fmt,
    output_file,
    print_json,
    schedule_from_args,
    steps_from_args,
)
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate
from cutpipe.sim.steps import MultiStep

#: Ranks the per-rank table shows (a terminal table of thousands of rows helps nobody and takes
#: seconds to lay out); ``--json`` lists every rank.
MAX_RANK_ROWS = 256
#: Step times the steps table lists (``--json`` lists every step).
MAX_STEP_TIMES = 6


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
    add_steps_arguments(parser, "also simulate")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    schedule = schedule_from_args(args)
    timeline = simulate(schedule, args.costs)
    result = metrics(timeline, args.costs)
    runs = steps_from_args(args, schedule, args.costs)
    if args.timeline is not None:
        timeline.save(args.timeline)
    if args.json:
        data = result.to_dict()
        if runs:
            data["steps"] = {run.boundary: _step_dict(run) for run in runs}
        print_json(data)
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
    if runs:
        console.print(_steps_table(runs))
    return 0


def _step_dict(run: MultiStep) -> dict:
    data = run.to_dict()
    del data["schedule"], data["boundary"]
    return data


def _steps_table(runs: list[MultiStep]):
    """One row per boundary: the time per step once the steps repeat, from which step, and the
    first steps' times; one step's makespan and longest span under it."""
    from rich.table import Table

    first = runs[0]
    table = Table(
        "boundary", "steady per step", "repeats from", "step times",
        title=f"{first.count} steps back to back: optimizer {fmt(first.optimizer)}, "
        f"reduction {fmt(first.reduction)}",
        caption=f"one step alone: makespan {fmt(first.makespan)}, longest span "
        f"{fmt(first.span)}",
    )  # fmt: skip
    for run in runs:
        times = ", ".join(fmt(t) for t in run.per_step[:MAX_STEP_TIMES])
        if run.count > MAX_STEP_TIMES:
            times += ", ..."
        settled = "not yet" if run.settled is None else f"step {run.settled}"
        if run.period not in (None, 1):
            settled += f" (every {run.period})"
        table.add_row(run.boundary, fmt(run.steady), settled, times)
    return table
