"""The cost-aware search against the exact optimum (OR-Tools CP-SAT) on small random instances.

Draws ``--instances`` shapes (linear R = 2 or 3, V R = 2; m = 2 to 5), integer costs
(F, B 2-9, W 1-7, comm 0, 0.5 or 1), a cap of 1, 1.25, 1.5 or 2 times 1F1B's peak and an
objective (makespan or span) from ``--seed``, solves each exactly and runs ``cost_aware`` with
its default budget. Prints how many the solver proved optimal and the worst gap over those.

    python benchmarks/exact_gap.py [--instances 40] [--seed 0]
"""

from __future__ import annotations

import argparse
import random

from cutpipe.plan.search.caps import default_cap
from cutpipe.plan.search.exact import OBJECTIVES, exact_schedule
from cutpipe.plan.search.tune import cost_aware
from cutpipe.sim.costs import Costs
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

#: What ``cost_aware`` minimises for each objective (the objective first).
RANKINGS = {
    "makespan": lambda result: (result.makespan, max(result.span_per_rank)),
    "span": lambda result: (max(result.span_per_rank), result.makespan),
}


def instance(rng: random.Random) -> tuple:
    placement = rng.choice(("linear", "v"))
    ranks = rng.choice((2, 3)) if placement == "linear" else 2
    m = rng.randint(2, 5)
    costs = Costs(f=rng.randint(2, 9), b=rng.randint(2, 9), w=rng.randint(1, 7),
                  comm=rng.choice((0, 0.5, 1)))  # fmt: skip
    factor = rng.choice((1.0, 1.25, 1.5, 2.0))
    return placement, ranks, m, costs, factor, rng.choice(("makespan", "span"))


def gaps(instances: int, seed: int) -> list[tuple[tuple, float, bool]]:
    """(instance, the search's value over the optimum minus 1, proved optimal) for each."""
    rng, out = random.Random(seed), []
    for _ in range(instances):
        placement, ranks, m, costs, factor, objective = shape = instance(rng)
        cap = factor * default_cap(placement, ranks, costs)
        exact = exact_schedule(placement, ranks, m, costs, cap, objective, time_limit=30)
        tuned = cost_aware(placement, ranks, m, costs, cap, RANKINGS[objective])
        value = OBJECTIVES[objective](metrics(simulate(tuned, costs), costs))
        out.append((shape, value / exact.value - 1, exact.optimal))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = gaps(args.instances, args.seed)
    proved = [(shape, gap) for shape, gap, optimal in results if optimal]
    worst = max(proved, key=lambda item: item[1])
    exact_hits = sum(gap <= 1e-12 for _, gap in proved)
    print(f"{len(results)} instances, {len(proved)} proved optimal by the solver")
    print(f"the search finds the optimum on {exact_hits} of them; worst gap {worst[1]:.2%}")
    if worst[1] > 0:
        print(f"worst: {worst[0]}")


if __name__ == "__main__":
    main()
