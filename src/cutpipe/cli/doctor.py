"""``cutpipe doctor``: check this machine for V schedules on GPUs: torch, CUDA and NCCL versions,
the NCCL settings behind the doubled pipeline traffic, the allocator, CUDA graphs and bf16, each
with what to do and why.

Under torchrun (``LOCAL_RANK`` set) only local rank 0 of each node answers, its lines prefixed
with the node's name. It exits 0 whatever it finds; what it cannot check here (no GPU, no torch)
it says so and why.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys

from cutpipe.cli.common import description, print_json

#: rich's colour for each status.
STYLES = {"ok": "green", "advice": "yellow", "warning": "bold red", "unchecked": "dim"}


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "doctor",
        help="check this machine's torch, CUDA, NCCL and allocator settings for V schedules",
        description=description(__doc__),
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the findings as JSON (under torchrun one line per node)",
    )
    parser.set_defaults(run=run)


def _local_rank() -> int | None:
    """This process's LOCAL_RANK under torchrun, None outside it (or when it is not a number)."""
    try:
        return int(os.environ["LOCAL_RANK"])
    except (KeyError, ValueError):
        return None


def run(args: argparse.Namespace) -> int:
    from cutpipe.doctor.findings import STATUSES
    from cutpipe.doctor.gathering import gather
    from cutpipe.doctor.report import diagnose

    rank = _local_rank()
    if rank is not None and rank != 0:
        return 0  # one answer per node
    machine = gather()
    findings = diagnose(machine)
    counts = {status: sum(f.status == status for f in findings) for status in STATUSES}
    if args.json:
        data = {
            "node": machine.node,
            "findings": [finding.to_dict() for finding in findings],
            "counts": counts,
        }
        if rank is None:
            print_json(data)
        else:  # nodes' lines may interleave in one log: one line each
            sys.stdout.write(json.dumps(data, allow_nan=False) + "\n")
        return 0
    _print_table(machine, findings, counts, prefix=f"{machine.node}: " if rank is not None else "")
    return 0


def _print_table(machine, findings, counts: dict[str, int], prefix: str) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"cutpipe doctor on {machine.node}")
    table.add_column("check")
    table.add_column("value", overflow="fold")  # setting names are long and must stay whole
    table.add_column("status")
    table.add_column("advice", overflow="fold")
    for finding in findings:
        advice = Text(finding.advice + ("\n" if finding.advice else ""))
        advice.append(f"why: {finding.why}", style="dim")
        table.add_row(
            finding.name,
            finding.value,
            Text(finding.status, style=STYLES[finding.status]),
            advice,
        )
    summary = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    if machine.gpus == 0:
        summary += (
            f". No GPU here ({machine.no_gpu}): run cutpipe doctor on a GPU node for the GPU "
            "checks (under torchrun to check every node); the allocator and NCCL lines are "
            "about this environment, which runs started from it inherit"
        )
    table.caption = summary
    console = Console()
    if not prefix:
        console.print(table)
        return
    buffer = io.StringIO()
    Console(file=buffer, width=max(console.width - len(prefix), 40)).print(table)
    for line in buffer.getvalue().splitlines():
        print(f"{prefix}{line}")
