"""``cutpipe schedule``: print the per-rank op lists in PyTorch's action notation."""

from __future__ import annotations

import argparse

from cutpipe.cli.common import add_shape_arguments
from cutpipe.schedule.registry import generate

LEGEND = (
    "# notation of torch.distributed.pipelining: <stage><kind><microbatch>; F forward, I input-only "
    "backward, W weight backward, B full backward, (..;..)OVERLAP_F_B an overlapped pair"
)


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "schedule",
        help="print the per-rank action lists",
        description="Print each rank's ops in PyTorch's action notation, one rank per line.",
    )
    add_shape_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    schedule = generate(args.schedule, args.ranks, args.microbatches)
    print(LEGEND)
    print(schedule.text())
    return 0
