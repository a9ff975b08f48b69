"""``cutpipe recommend``: the fastest schedule and parallel layout for a model on a cluster."""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict

from cutpipe.cli.common import (
    add_model_arguments,
    add_plan_output,
    load_model_arguments,
    positive_int,
    print_json,
    schedule_names,
    whole_number,
)
from cutpipe.plan.recommend.recommend import (
    DEFAULT_SCHEDULES,
    MAX_DEVICES,
    MEASURE_WORDS,
    STEP_MEASURES,
    USABLE_MEMORY,
    Rejected,
    reason,
    recommend,
)
from cutpipe.schedule.params import split_specs
from cutpipe.sim.costs import RECOMPUTE_MODES


def schedules_as_given(text: str) -> tuple[str, ...]:
    """An argparse ``type``: ``--schedules`` checked like everywhere else, but kept as written,
    so that ``interleaved`` (chunks 2 and 4 tried) stays apart from ``interleaved:chunks=2``."""
    schedule_names(text)
    return tuple(spec.strip() for spec in split_specs(text))


def fraction(text: str) -> float:
    """An argparse ``type``: a number F with 0 < F <= 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0 and <= 1, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"must be a number > 0 and <= 1, got {text!r}")
    return value


#: Plans simulated in full beyond --top, for the paragraph on why the winner wins.
KEEP = 12


def rate(tokens_per_second: float) -> str:
    """Tokens per second in a narrow cell: 3.38M, 86k, 950."""
    if tokens_per_second >= 1e6:
        return f"{tokens_per_second / 1e6:.2f}M"
    if tokens_per_second >= 1e4:
        return f"{tokens_per_second / 1e3:.0f}k"
    return f"{tokens_per_second:,.0f}"


def breakdown(plan, hardware, usable_memory: float):
    """The winner's fullest rank, by what holds its memory, and the assumptions behind it."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False,
                  title=f"memory of the winner's fullest rank ({usable_memory:.0%} of "
                  f"{hardware.memory / 1e9:.0f} GB usable)")  # fmt: skip
    rows = plan.footprint.rows() if plan.footprint else []
    for name, _ in rows:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_row(*(f"{value / 1e9:.1f} GB" for _, value in rows))
    table.caption = (
        f"Assumes {plan.training.describe()}; bf16 weights and gradients, fp32 Adam state; "
        "pipeline stages outermost (across nodes beyond one node), TP and EP inside the "
        "data-parallel group."
    )
    return table


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "recommend",
        help="simulate every layout and schedule that fits and rank them",
        description="Enumerate pipeline x data x expert parallel layouts of the devices and every "
        "schedule that fits in memory, simulate each step, and print the fastest few.",
    )
    parser.add_argument(
        "--devices", "-n", type=whole_number(1, MAX_DEVICES), required=True, help="number of GPUs"
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
        type=schedules_as_given,
        default=DEFAULT_SCHEDULES,
        help=f"comma-separated schedules to consider (default: {','.join(DEFAULT_SCHEDULES)}); "
        "interleaved without chunks is tried with 2 and 4",
    )
    parser.add_argument(
        "--step-boundary",
        choices=tuple(STEP_MEASURES),
        default="sync",
        help="sync: every rank waits for the gradient all-reduce, ranked by makespan (default); "
        "overlap: consecutive steps overlap, ranked by span",
    )
    parser.add_argument(
        "--usable-memory",
        type=fraction,
        default=USABLE_MEMORY,
        metavar="F",
        help=f"share of each GPU's memory a plan may fill, 0 < F <= 1 (default: {USABLE_MEMORY})",
    )
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3),
                        help="ZeRO stage over the data-parallel ranks (default: searched, 1 to 3)")  # fmt: skip
    parser.add_argument("--recompute", choices=RECOMPUTE_MODES,
                        help="activation recompute (default: searched, least first)")  # fmt: skip
    parser.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                        help="matmul precision: bf16 (default) or fp8 on GPUs that have it")  # fmt: skip
    parser.add_argument("--tp", type=whole_number(1, 64), metavar="T",
                        help="tensor-parallel size inside a node (default: searched)")  # fmt: skip
    parser.add_argument("--top", type=positive_int, default=8, help="how many plans to print")
    parser.add_argument(
        "--verbose", action="store_true", help="also list the candidates left out, and why"
    )
    add_plan_output(
        parser, "the winning plan (layout, schedule, microbatches, stage sizes, training setting)"
    )
    parser.add_argument("--json", action="store_true", help="print the plans as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    model, hardware, profile, memory = load_model_arguments(args)
    rejected: list[Rejected] = []
    plans = recommend(
        model, hardware, args.devices, args.global_batch, memory, list(args.schedules), profile,
        step_boundary=args.step_boundary, usable_memory=args.usable_memory, rejected=rejected,
        zero=args.zero, recompute=args.recompute, precision=args.precision, tp=args.tp,
        keep=max(args.top, KEEP),
    )  # fmt: skip
    measure = STEP_MEASURES[args.step_boundary]
    shown = plans[: args.top]
    if args.output is not None:
        plans[0].to_plan_file(model, hardware).save(args.output)
    if args.json:
        report = {
            "step_boundary": args.step_boundary,
            "step_measure": measure,
            "usable_memory": args.usable_memory,
            "plans": [asdict(plan) for plan in shown],
            "rejected": [asdict(r) for r in rejected],
            "reason": reason(plans, hardware),
        }
        if args.output is not None:
            report["plan_file"] = str(args.output)
        print_json(report)
        return 0
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title=f"{model.name} ({model.seq_len:,}-token sequences) on {args.devices} x "
        f"{hardware.name}"
        + (" (measured costs)" if profile else "")
        + f", ranked by {MEASURE_WORDS[measure]}",
    )
    for column in ("layout", "schedule", "setting", "m", "tok/s", "step s", "bubble", "GB", "comm"):
        left = column in ("layout", "schedule", "setting")  # these wrap, the numbers do not
        table.add_column(column, justify="left" if left else "right", no_wrap=not left)
    for plan in shown:
        table.add_row(
            plan.layout(),
            plan.schedule_label(),
            plan.training.short(),
            str(plan.microbatches),
            rate(plan.tokens_per_second),
            f"{plan.step_time:.3f}",
            f"{plan.bubble:.1%}",
            f"{plan.peak_memory / 1e9:.1f}",
            f"{plan.comm_share:.0%}",
        )
    console = Console()
    console.print(table)
    console.print(reason(plans, hardware))
    console.print(breakdown(plans[0], hardware, args.usable_memory))
    if rejected and args.verbose:
        left_out = Table(
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            title=f"left out ({len(rejected)}; {args.usable_memory:.0%} of the memory usable)",
        )
        left_out.add_column("layout", no_wrap=True)
        left_out.add_column("schedule", no_wrap=True)
        left_out.add_column("m", justify="right")
        left_out.add_column("reason")
        for r in rejected:
            left_out.add_row(r.layout(), r.schedule_label(), str(r.microbatches or "-"), r.reason)
        console.print(left_out)
    elif rejected:
        console.print(
            f"{len(rejected)} candidates did not fit or could not run (--verbose lists them)"
        )
    if args.output is not None:
        print(f"wrote the winning plan to {args.output}")
    return 0
