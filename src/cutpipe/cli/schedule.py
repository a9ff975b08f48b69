"""``cutpipe schedule``: print or write a schedule as text, torch's CSV or cutpipe's JSON."""

from __future__ import annotations

import argparse
import sys

from cutpipe.cli.common import (
    add_costs_argument,
    add_schedule_source,
    output_file,
    print_json,
    schedule_from_args,
)
from cutpipe.files import write_text
from cutpipe.schedule.fileformat import ENDINGS, FORMATS, dumps
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "schedule",
        help="print or write a schedule (text, torch's CSV, cutpipe's JSON)",
        description="Print each rank's ops in PyTorch's action notation, or write the schedule "
        "as a file: .json (cutpipe's format, read back by --from in simulate, draw, compare and "
        "train) or .csv (what torch.distributed.pipelining and torchtitan load).",
    )
    add_schedule_source(parser)
    parser.add_argument(
        "--format",
        choices=FORMATS,
        help="text (for people), csv (torch's _load_csv) or json (cutpipe's); default: the "
        "output file's ending, or text on the terminal",
    )
    parser.add_argument(
        "--output",
        "-o",
        type=output_file((*ENDINGS, ".txt")),
        metavar="FILE",
        help="write here instead of printing (.json, .csv or .txt)",
    )
    add_costs_argument(parser, "", "stage, for the metrics --json reports")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print what was written (file, format, shape) and the simulated metrics as JSON",
    )
    parser.set_defaults(run=run)


def _format(args: argparse.Namespace) -> str:
    if args.format is not None:
        return args.format
    if args.output is None:
        return "text"
    return ENDINGS.get(args.output.suffix.lower(), "text")


def run(args: argparse.Namespace) -> int:
    schedule = schedule_from_args(args)
    format = _format(args)
    if args.json and args.output is None:
        raise ValueError("--json reports what was written: give the file with -o FILE")
    text = dumps(schedule, format)
    if args.output is None:
        # line by line: one huge write into a pipe its reader closed can end without an error
        sys.stdout.writelines(text.splitlines(keepends=True))
        return 0
    write_text(args.output, text)
    if args.json:
        print_json(
            {
                "written": str(args.output),
                "format": format,
                "schedule": schedule.name,
                "ranks": schedule.num_ranks,
                "stages": schedule.num_stages,
                "microbatches": schedule.num_microbatches,
                "ops": schedule.num_ops,
                "metrics": metrics(simulate(schedule, args.costs), args.costs).to_dict(),
            }
        )
    else:
        print(f"wrote {args.output}: {schedule.name}, {schedule.num_ranks} ranks, {format}")
    return 0
