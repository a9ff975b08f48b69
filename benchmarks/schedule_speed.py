"""How fast cutpipe generates, validates and simulates every schedule at R = 64, m = 1024.

``simulate`` validates as it walks: it applies every rule of ``validate`` (the same walk), so one
pass both checks and times a schedule. The total below counts generate + simulate + metrics, which
is what a user's ``cutpipe simulate`` does; ``validate`` alone is shown beside it for reference.

Each figure is the median of ``--rounds`` rounds; rounds alternate over the schedules so that
noise on this shared machine spreads evenly. The last lines check that cost grows linearly in
R x m by timing m = 512 and m = 1024 side by side.

    python benchmarks/schedule_speed.py [--ranks 64] [--microbatches 1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from cutpipe import SCHEDULES, generate, metrics, simulate, validate

#: seconds to generate, validate, simulate and summarise one million ops (1.5 µs an op)
BUDGET = 1.5
STEPS = ("generate", "simulate", "metrics", "validate")


def time_once(name: str, ranks: int, microbatches: int) -> dict[str, float]:
    seconds = {}
    start = time.perf_counter()
    schedule = generate(name, ranks, microbatches)
    seconds["generate"] = time.perf_counter() - start
    start = time.perf_counter()
    timeline = simulate(schedule)
    seconds["simulate"] = time.perf_counter() - start
    start = time.perf_counter()
    metrics(timeline)
    seconds["metrics"] = time.perf_counter() - start
    start = time.perf_counter()
    validate(schedule)
    seconds["validate"] = time.perf_counter() - start
    seconds["ops"] = sum(map(len, schedule.codes))
    return seconds


def measure(ranks: int, microbatches: int, rounds: int) -> dict[str, dict[str, float]]:
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in SCHEDULES}
    for _ in range(rounds):
        for name in SCHEDULES:
            samples[name].append(time_once(name, ranks, microbatches))
    return {
        name: {key: statistics.median(s[key] for s in runs) for key in (*STEPS, "ops")}
        for name, runs in samples.items()
    }


def total(row: dict[str, float]) -> float:
    return row["generate"] + row["simulate"] + row["metrics"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    results = measure(args.ranks, args.microbatches, args.rounds)
    table = Table(
        title=f"R = {args.ranks}, m = {args.microbatches}: median of {args.rounds} rounds, seconds"
    )
    for column in (
        "schedule",
        "ops",
        "generate",
        "simulate (validates)",
        "metrics",
        "total",
        "validate alone",
    ):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for name, row in results.items():
        table.add_row(
            name,
            f"{row['ops']:,.0f}",
            f"{row['generate']:.3f}",
            f"{row['simulate']:.3f}",
            f"{row['metrics']:.3f}",
            f"{total(row):.3f}",
            f"{row['validate']:.3f}",
        )
    grand = sum(map(total, results.values()))
    table.add_row(
        "all", f"{sum(r['ops'] for r in results.values()):,.0f}", "", "", "", f"{grand:.3f}", ""
    )
    console = Console()
    console.print(table)
    ops = sum(r["ops"] for r in results.values())
    per_million = grand / ops * 1e6
    verdict = "under" if per_million < BUDGET else "OVER"
    console.print(
        f"total for all schedules: {grand:.2f} s, {per_million:.2f} s per million ops ({verdict} "
        f"the budget of {BUDGET:g} s per million)"
    )

    half = measure(args.ranks, args.microbatches // 2, args.rounds)
    half_total = sum(map(total, half.values()))
    console.print(
        f"linearity: m = {args.microbatches // 2}: {half_total:.2f} s, m = {args.microbatches}: "
        f"{grand:.2f} s, ratio {grand / half_total:.2f} (2.00 is linear in R x m)"
    )


if __name__ == "__main__":
    main()
