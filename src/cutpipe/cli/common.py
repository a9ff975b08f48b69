"""Arguments and output helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cutpipe.schedule.registry import SCHEDULES
from cutpipe.sim.costs import Costs


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """--schedule, --ranks, --microbatches."""
    parser.add_argument(
        "--schedule",
        "-s",
        required=True,
        metavar="NAME",
        help=f"one of: {', '.join(SCHEDULES)}",
    )
    parser.add_argument("--ranks", "-r", type=int, required=True, help="pipeline ranks (devices)")
    parser.add_argument(
        "--microbatches", "-m", type=int, required=True, help="microbatches per step"
    )


def parse_costs(text: str) -> Costs:
    try:
        return Costs.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_costs_argument(parser: argparse.ArgumentParser, default: str, per: str) -> None:
    parser.add_argument(
        "--costs",
        default=default,
        type=parse_costs,
        metavar="K=V,...",
        help=f"costs per {per}, e.g. F=1,B=1,W=1,FB=2.5,comm=0.1 (keys: f, b, w, fb, comm, ep_f, "
        f"ep_b, activation, w_memory, p2p_bytes, ep_bytes; default: {default or 'F=B=W=1'})",
    )


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.{digits}f}".rstrip("0").rstrip(".")
