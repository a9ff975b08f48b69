"""Cost-aware schedules against the fixed orders, and how long the search takes.

Part 1 uses the zero-bubble paper's profiled costs (microseconds): for the linear placement at
memory caps of R (ZB-H1's peak), 1.5R and 2R (ZB-H2's) activations, and for the V at R x M_B,
the fixed orders that fit beside the cost-aware result (``--evaluations`` simulations of local
search, so the table is the same on every machine), and the lower bound of any schedule
(``cutpipe.plan.search.bounds``). Part 2 times ``cost_aware`` at R = 32, m = 256 with its default
budget (under 10 s is the aim), median of ``--rounds`` rounds alternating placements.

    python benchmarks/cost_aware.py [--rounds 3] [--evaluations 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from cutpipe.plan.search.bounds import bubble_lower_bound
from cutpipe.plan.search.caps import default_cap
from cutpipe.plan.search.tune import FIXED, cost_aware, placement_for
from cutpipe.schedule.registry import schedule_info
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

SETTINGS = [  # placement, R, m, costs, caps as multiples of 1F1B's peak
    ("linear", 8, 24, Costs(f=18522, b=18086, w=9337, comm=601), (1.0, 1.5, 2.0)),
    ("linear", 16, 64, Costs(f=11307, b=11254, w=8101, comm=379), (1.0, 1.5, 2.0)),
    ("v", 16, 48, Costs(f=14407, b=14380, w=9676, comm=1610), (1.0,)),
]


def quality(console: Console, evaluations: int) -> None:
    table = Table("placement", "R", "m", "cap", "best fixed that fits", "its span bubble",
                  "cost-aware span bubble", "lower bound", "makespan ratio")  # fmt: skip
    span = lambda r: (r.bubble_ratio_span, r.makespan)  # noqa: E731
    for placement, R, m, costs, caps in SETTINGS:
        for factor in caps:
            cap = default_cap(placement, R, costs) * factor
            fixed = []
            for name in FIXED[placement]:
                info = schedule_info(name)
                if info.accepts(R, m):
                    schedule = info.generate(R, m)
                    if max(peak_activations(schedule, costs)) <= cap + 1e-9:
                        fixed.append((name, metrics(simulate(schedule, costs), costs)))
            best_name, best = min(fixed, key=lambda item: span(item[1]))
            tuned = cost_aware(placement, R, m, costs, cap, span, search_evaluations=evaluations)
            ours = metrics(simulate(tuned, costs), costs)
            bound = f"{bubble_lower_bound(placement_for(placement, R), m, costs, cap):.6f}"
            table.add_row(placement, str(R), str(m), f"{cap:g}", best_name,
                          f"{best.bubble_ratio_span:.4f}", f"{ours.bubble_ratio_span:.6f}",
                          bound, f"{ours.makespan / best.makespan:.3f}")  # fmt: skip
    console.print(table)


def speed(console: Console, rounds: int) -> None:
    costs = Costs(f=14407, b=14380, w=9676, comm=1610)
    seconds: dict[str, list[float]] = {"linear": [], "v": []}
    for _ in range(rounds):
        for placement in seconds:
            start = time.perf_counter()
            cost_aware(placement, 32, 256, costs)
            seconds[placement].append(time.perf_counter() - start)
    table = Table("placement", "R", "m", "median seconds", "max seconds")
    for placement, values in seconds.items():
        table.add_row(
            placement, "32", "256", f"{statistics.median(values):.2f}", f"{max(values):.2f}"
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--evaluations", type=int, default=300)
    args = parser.parse_args()
    console = Console(width=max(Console().width, 120))  # the quality table is wide
    quality(console, args.evaluations)
    speed(console, args.rounds)


if __name__ == "__main__":
    main()
