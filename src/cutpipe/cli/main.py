"""Entry point of the ``cutpipe`` command."""

from __future__ import annotations

import argparse
import sys

from cutpipe.cli import (
    bench,
    compare,
    draw,
    partition,
    profile,
    recommend,
    schedule,
    simulate,
    train,
    tune,
)
from cutpipe.schedule.validate import ScheduleError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cutpipe",
        description="Pipeline-parallel schedules: generate, validate, simulate and compare.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (
        simulate, compare, schedule, draw, train, tune, partition, recommend, profile, bench,
    ):  # fmt: skip
        module.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, ScheduleError) as error:
        print(f"cutpipe {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
