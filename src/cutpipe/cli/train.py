"""``cutpipe train``: run a schedule for real, on local processes, with the built-in model.

Starts ``--nproc`` processes itself (gloo on CPU), cuts the example model (``--blocks`` of
Linear(``--width``) + tanh) into the schedule's stages, and trains it on a synthetic regression
task with SGD, showing the loss and the time of each step. ``--emulate`` replaces every op's
compute with a sleep of its cost and prints the measured timeline's metrics beside the
simulator's; ``--trace FILE`` writes the last step's measured timeline (for ``cutpipe draw``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from cutpipe.cli.common import (
    SCHEDULE_HELP,
    fmt,
    output_file,
    parse_costs,
    positive_float,
    positive_int,
    real,
    require_torch,
    schedule_name,
    whole,
)
from cutpipe.schedule.registry import generate, schedule_info

#: Local processes ``train`` starts at most: more only oversubscribe the machine's cores.
MAX_PROCESSES = 64
#: Numbers the built-in model and its data may hold (weights and one batch): 1 GiB of fp32.
MAX_MODEL_ELEMENTS = 2**28


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train", help="run a schedule on local processes with the built-in model",
        description=__doc__.splitlines()[0],
    )  # fmt: skip
    parser.add_argument("--schedule", "-s", required=True, type=schedule_name, metavar="NAME",
                        help=SCHEDULE_HELP)  # fmt: skip
    parser.add_argument("--nproc", "-n", type=whole(1, MAX_PROCESSES), required=True,
                        help=f"pipeline ranks (local processes, at most {MAX_PROCESSES})")  # fmt: skip
    parser.add_argument("--microbatches", "-m", type=positive_int,
                        help="default: the schedule's minimum, at least 2 x nproc")  # fmt: skip
    parser.add_argument("--steps", type=positive_int, default=10)
    parser.add_argument("--batch", type=positive_int,
                        help="samples per step (default: 8 per microbatch)")  # fmt: skip
    parser.add_argument("--width", type=positive_int, default=128)
    parser.add_argument("--blocks", type=positive_int,
                        help="Linear+tanh blocks (default: 16, or one per stage)")  # fmt: skip
    parser.add_argument("--lr", type=positive_float, default=1.0)
    parser.add_argument(
        "--emulate", action="store_true", help="sleep for each op's cost instead of computing"
    )
    parser.add_argument("--costs", type=parse_costs, default=None, metavar="K=V,...",
                        help="per-stage costs for --emulate (default F=B=W=1)")  # fmt: skip
    parser.add_argument("--time-unit", type=positive_float, default=0.02,
                        help="seconds per cost unit with --emulate")  # fmt: skip
    parser.add_argument("--trace", type=output_file(), metavar="FILE",
                        help="write the last step's measured timeline as JSON")  # fmt: skip
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--timeout", type=positive_float, default=600.0,
                        help="stop every process after this long (seconds)")  # fmt: skip
    parser.add_argument("--step-timeout", type=real(1.0, exclusive=False, unit="seconds"), default=60.0, metavar="SECONDS",
                        help="stop every rank when one completes no op for this long "
                        "(default 60, at least 1)")  # fmt: skip
    parser.set_defaults(run=run)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting checked (and torch found) before any process starts."""
    info = schedule_info(args.schedule)
    ranks = args.nproc
    m = args.microbatches
    if m is None:
        m = max(2 * ranks, info.min_microbatches(ranks))
    schedule = generate(args.schedule, ranks, m)  # checks the shape before any process starts
    blocks = max(16, schedule.num_stages) if args.blocks is None else args.blocks
    if blocks < schedule.num_stages:
        raise ValueError(
            f"--blocks {blocks} cannot fill {schedule.num_stages} stages: use at least that many"
        )
    batch = 8 * m if args.batch is None else args.batch
    if batch % m:
        raise ValueError(
            f"--batch {batch} does not split into {m} microbatches: use a multiple of {m}"
        )
    if not args.emulate:
        elements = blocks * args.width**2 + 2 * batch * args.width
        if elements > MAX_MODEL_ELEMENTS:
            raise ValueError(
                f"the built-in model and data hold {elements:,} numbers ({blocks} blocks of "
                f"{args.width} x {args.width}, a batch of {batch} x {args.width}), over the limit "
                f"of {MAX_MODEL_ELEMENTS:,} (1 GiB of fp32): use a smaller --width, --blocks or --batch"
            )
    require_torch()
    return {
        "schedule": args.schedule, "microbatches": m, "steps": args.steps, "batch": batch,
        "width": args.width, "blocks": blocks, "lr": args.lr, "emulate": args.emulate,
        "costs": args.costs, "time_unit": args.time_unit, "trace": args.trace,
        "backend": args.backend, "step_timeout": args.step_timeout,
    }  # fmt: skip


def train_rank(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    """One rank of ``cutpipe train`` (runs in a spawned process)."""
    import torch
    from torch import nn

    from cutpipe.models import mlp
    from cutpipe.runtime import PipelineRunner
    from cutpipe.sim import Costs

    schedule = generate(options["schedule"], world, options["microbatches"])
    record = options["emulate"] or options["trace"] is not None
    device = torch.device("cpu")
    if options["backend"] == "nccl":  # one GPU per rank
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if options["emulate"]:
        costs = options["costs"] or Costs()
        runner = PipelineRunner(
            schedule, None, emulate=costs, time_unit=options["time_unit"], record_timeline=True,
            step_timeout=options["step_timeout"],
        )  # fmt: skip
        optimizer = None
        x = y = None
    else:
        model = mlp(options["blocks"], options["width"], seed=0).to(device)
        runner = PipelineRunner.from_sequential(schedule, model, nn.MSELoss(), record_timeline=record,
                                                step_timeout=options["step_timeout"])  # fmt: skip
        parameters = runner.parameters()
        optimizer = torch.optim.SGD(parameters, lr=options["lr"])
        generator = torch.Generator().manual_seed(1)
        teacher = (
            torch.randn(options["width"], options["width"], generator=generator)
            / options["width"] ** 0.5
        )
        x = torch.randn(options["batch"], options["width"], generator=generator)
        y = torch.tanh(x @ teacher)
        x, y = x.to(device), y.to(device)
    losses, seconds = [], []
    progress = None
    if rank == 0:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[status]}"),
                            TimeElapsedColumn())  # fmt: skip
        progress.start()
        task = progress.add_task(
            f"{schedule.name} on {world} ranks", total=options["steps"], status=""
        )
    timeline = None
    for _ in range(options["steps"]):
        start = time.perf_counter()
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        loss = runner.step(x, y)
        if optimizer is not None:
            optimizer.step()
        seconds.append(time.perf_counter() - start)
        if record:
            timeline = runner.timeline()
        if loss is not None:
            losses.append(float(loss))
        if progress is not None:
            status = f"step {seconds[-1] * 1e3:.1f} ms" + (
                f"  loss {losses[-1]:.5f}" if losses else ""
            )
            progress.update(task, advance=1, status=status)
    if progress is not None:
        progress.stop()
    runner.close()
    result: dict[str, Any] = {"losses": losses, "seconds": seconds}
    if rank == 0 and timeline is not None:
        if options["trace"]:
            timeline.save(options["trace"])
        result["timeline"] = timeline.to_dict()
    return result


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from cutpipe.runtime.launch import LaunchError, launch
    from cutpipe.sim import Costs, Timeline, metrics, simulate

    options = _options(args)
    outcomes = launch(
        train_rank, args.nproc, (options,), backend=args.backend, timeout=args.timeout
    )
    if not all(o.ok for o in outcomes):
        failure = LaunchError(outcomes)
        print(f"cutpipe train: {failure.summary}", file=sys.stderr)
        if getattr(args, "debug", False) or os.environ.get("CUTPIPE_DEBUG") == "1":
            print(failure, file=sys.stderr)
        else:
            print("cutpipe train: run with --debug for every rank's log", file=sys.stderr)
        return 1
    first = outcomes[0].result
    console = Console()
    steady = first["seconds"][1:] or first["seconds"]
    summary = f"{options['steps']} steps, median step {statistics.median(steady) * 1e3:.1f} ms"
    if first["losses"]:
        summary += f", loss {first['losses'][0]:.5f} -> {first['losses'][-1]:.5f}"
    console.print(summary)
    if args.emulate:
        measured = Timeline.from_dict(first["timeline"])
        costs = options["costs"] or Costs()
        got, want = metrics(measured, costs), metrics(simulate(measured.schedule, costs), costs)
        unit = options["time_unit"]
        table = Table(title="emulated step: measured beside the simulator")
        for column in ("", "measured", "simulated"):
            table.add_column(column, justify="right")
        table.add_row("makespan (cost units)", fmt(got.makespan / unit, 3), fmt(want.makespan, 3))
        table.add_row("bubble ratio", fmt(got.bubble_ratio), fmt(want.bubble_ratio))
        table.add_row(
            "bubble ratio (span)", fmt(got.bubble_ratio_span), fmt(want.bubble_ratio_span)
        )
        for r in range(measured.num_ranks):
            table.add_row(
                f"rank {r} idle (units)",
                fmt(got.idle_per_rank[r] / unit, 3),
                fmt(want.idle_per_rank[r], 3),
            )
        console.print(table)
    if args.trace:
        console.print(f"measured timeline written to {args.trace}")
    return 0
