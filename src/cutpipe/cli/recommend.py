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
from cutpipe.plan.recommend.breakdown import PARTS
from cutpipe.plan.recommend.plans import chunk_parameter, takes_chunks
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
#: Characters per line when the output is not a terminal (a terminal gives its own width).
WIDTH = 120


def rate(tokens_per_second: float) -> str:
    """Tokens per second in a narrow cell: 3.38M, 86k, 950."""
    if tokens_per_second >= 1e6:
        return f"{tokens_per_second / 1e6:.2f}M"
    if tokens_per_second >= 1e4:
        return f"{tokens_per_second / 1e3:.0f}k"
    return f"{tokens_per_second:,.0f}"


def breakdown(plan, hardware, usable_memory: float, whose: str = "the winner's"):
    """A plan's fullest rank, by what holds its memory, and the assumptions behind it."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False,
                  title=f"memory of {whose} fullest rank ({usable_memory:.0%} of "
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
        description="Enumerate pipeline x data x tensor (x expert, x context) parallel layouts "
        "of the devices and every schedule that fits in memory, simulate each step, and print "
        "the fastest few. Any dimension can be fixed (--pp, --dp, --tp, --ep, --cp, --chunks, "
        "--microbatch-size, --zero, --recompute, --precision); the rest is searched. --explain "
        "breaks one fully fixed layout's step down.",
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
        "interleaved without chunks is tried with every chunk count dividing the layers per "
        "pipeline rank",
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
    parser.add_argument("--pp", type=whole_number(1, MAX_DEVICES), metavar="P",
                        help="pipeline-parallel size (default: searched)")  # fmt: skip
    parser.add_argument("--dp", type=whole_number(1, MAX_DEVICES), metavar="D",
                        help="data-parallel size, EP included (default: searched)")  # fmt: skip
    parser.add_argument("--ep", type=whole_number(1, MAX_DEVICES), metavar="E",
                        help="expert-parallel size inside DP (default: searched)")  # fmt: skip
    parser.add_argument("--cp", type=whole_number(1, MAX_DEVICES), metavar="C",
                        help="context-parallel size: each sequence over C ranks, cut into 2*C "
                        "chunks (default: 1, not searched)")  # fmt: skip
    parser.add_argument("--chunks", type=whole_number(1, 1024), metavar="K",
                        help="stages per rank of interleaved schedules (default: searched)")  # fmt: skip
    parser.add_argument("--microbatch-size", type=positive_int, metavar="B",
                        help="sequences per microbatch (default: the model file's)")  # fmt: skip
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction,
                        default=True, help="with TP, split norms and dropout along the sequence "
                        "(default: on)")  # fmt: skip
    parser.add_argument("--explain", action="store_true",
                        help="for one layout with every dimension fixed: its step by part and "
                        "its memory by what holds it")  # fmt: skip
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
    if args.explain:
        check_fixed(args, model)
    rejected: list[Rejected] = []
    plans = recommend(
        model, hardware, args.devices, args.global_batch, memory, list(args.schedules), profile,
        step_boundary=args.step_boundary, usable_memory=args.usable_memory, rejected=rejected,
        zero=args.zero, recompute=args.recompute, precision=args.precision, tp=args.tp,
        keep=max(args.top, KEEP), pp=args.pp, dp=args.dp, ep=args.ep, cp=args.cp,
        chunks=args.chunks, microbatch_size=args.microbatch_size,
        sequence_parallel=args.sequence_parallel,
    )  # fmt: skip
    measure = STEP_MEASURES[args.step_boundary]
    shown = plans[:1] if args.explain else plans[: args.top]
    if args.output is not None:
        plans[0].to_plan_file(model, hardware).save(args.output)
    if args.json:
        report = {
            "step_boundary": args.step_boundary,
            "step_measure": measure,
            "usable_memory": args.usable_memory,
            "bubble": "idle share of the busiest pipeline rank's "
            + ("makespan" if measure == "makespan" else "span"),
            "plans": [asdict(plan) for plan in shown],
            "rejected": [asdict(r) for r in rejected],
            "reason": reason(plans, hardware),
        }
        if args.output is not None:
            report["plan_file"] = str(args.output)
        print_json(report)
        return 0
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # a file or a pipe: wide enough for the table's eleven columns
        console = Console(width=max(console.width, WIDTH))
    if args.explain:
        console.print(step_table(plans[0], hardware))
        console.print(breakdown(plans[0], hardware, args.usable_memory, "this plan's"))
    else:
        console.print(plans_table(shown, model, hardware, args, measure, profile))
        console.print(reason(plans, hardware))
        console.print(breakdown(plans[0], hardware, args.usable_memory))
        print_rejected(console, rejected, args)
    if args.output is not None:
        print(f"wrote the winning plan to {args.output}")
    return 0


def check_fixed(args: argparse.Namespace, model) -> None:
    """A ValueError naming what --explain needs fixed and was not given: PP, DP and TP (one of
    them follows from --devices and the others), EP for an MoE, ZeRO with DP > 1, recompute,
    one schedule, and its chunks where it takes them."""
    sizes = {"--pp": args.pp, "--dp": args.dp, "--tp": args.tp}
    missing = [flag for flag, value in sizes.items() if value is None]
    if len(missing) == 1:  # devices = PP x DP x TP x CP gives the last
        given = math.prod(v for v in sizes.values() if v is not None) * (args.cp or 1)
        if args.devices % given == 0:
            sizes[missing[0]] = args.devices // given
            missing = []
    if model.moe and args.ep is None:
        missing.append("--ep")
    if args.zero is None and sizes["--dp"] != 1:
        missing.append("--zero")
    if args.recompute is None:
        missing.append("--recompute")
    if len(args.schedules) != 1:
        missing.append("--schedules (one)")
    elif takes_chunks(args.schedules[0]) and args.chunks is None:
        missing.append(f"--chunks (or {args.schedules[0]}:{chunk_parameter(args.schedules[0])}=K)")
    if missing:
        raise ValueError(
            "--explain breaks down one layout with every dimension fixed: also give "
            + ", ".join(missing)
        )


#: What ``--explain`` calls each part of the step (``Plan.breakdown``).
PART_WORDS = {
    "forward": "forward compute (F)",
    "backward": "input-gradient compute (B)",
    "weight": "weight-gradient compute (W)",
    "recompute": "activation recompute",
    "pipeline_sends": "pipeline sends (activations, gradients)",
    "ep_alltoall": "expert all-to-all, exposed",
    "tp_collectives": "TP all-gathers and reduce-scatters",
    "cp_exchanges": "CP key/value exchanges",
    "zero3_gathers": "ZeRO-3 weight gathers",
    "dp_reduction": "gradient reduction over DP (exposed)",
    "optimizer": "optimizer step",
    "bubble": "pipeline bubble",
    "waiting": "waiting for a slower rank",
}


def step_table(plan, hardware):
    """One plan's step on its busiest rank, part by part."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False,
                  title=f"step of {plan.schedule_label()} on {plan.layout()}, "
                  f"{plan.training.short() or 'Z0'}, {plan.microbatches} microbatches: busiest "
                  f"pipeline rank ({plan.busiest_rank})")  # fmt: skip
    table.add_column("part")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for name in PARTS:
        seconds = plan.breakdown[name]
        table.add_row(PART_WORDS[name], f"{seconds:.4f}", f"{seconds / plan.step_time:.1%}")
    table.add_row("step", f"{plan.step_time:.4f}", "100.0%")
    table.caption = (
        f"{plan.tokens_per_second:,.0f} tokens/s; {plan.model_tflops_per_gpu:.0f} model TFLOP/s "
        f"per GPU, MFU {plan.mfu:.1%} (HFU {plan.hfu:.1%}) of the "
        f"{hardware.peak(plan.training.fp8) / 1e12:,.0f} TFLOP/s "
        f"{'FP8' if plan.training.fp8 and hardware.fp8_flops else 'bf16'} peak; bubble "
        f"{plan.bubble:.1%} of the busiest rank's pipeline time"
    )
    return table


def plans_table(shown, model, hardware, args, measure, profile):
    from rich import box
    from rich.table import Table

    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title=f"{model.name} ({model.seq_len:,}-token sequences) on {args.devices} x "
        f"{hardware.name}"
        + (" (measured costs)" if profile else "")
        + f", ranked by {MEASURE_WORDS[measure]}",
    )
    columns = ("layout", "schedule", "setting", "m", "tok/s", "TFLOP/s", "MFU", "step s",
               "bubble\nbusiest", "GB", "comm")  # fmt: skip
    for column in columns:
        left = column in ("layout", "schedule", "setting")  # these wrap, the numbers do not
        table.add_column(column, justify="left" if left else "right", no_wrap=not left)
    for plan in shown:
        table.add_row(
            plan.layout(),
            plan.schedule_label(),
            plan.training.short(),
            str(plan.microbatches),
            rate(plan.tokens_per_second),
            f"{plan.model_tflops_per_gpu:.0f}",
            f"{plan.mfu:.0%}",
            f"{plan.step_time:.3f}",
            f"{plan.bubble:.1%}",
            f"{plan.peak_memory / 1e9:.1f}",
            f"{plan.comm_share:.0%}",
        )
    table.caption = (
        "TFLOP/s: model FLOPs per second per GPU; MFU: of the GPU's dense "
        + ("FP8" if args.precision == "fp8" else "bf16")
        + " peak; bubble: idle share of the busiest pipeline rank"
    )
    return table


def print_rejected(console, rejected, args) -> None:
    from rich import box
    from rich.table import Table

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
