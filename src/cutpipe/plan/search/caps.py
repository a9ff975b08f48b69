"""Memory caps: the default (1F1B's peak), the least any schedule can have, and whether a memory
figure fits under a cap up to rounding (one rule for every planner)."""

from __future__ import annotations

from cutpipe.schedule.placement import Placement
from cutpipe.sim.costs import Costs

#: How far over the cap a memory figure may be and still fit: rounding only. Per-stage
#: activations in bytes (1e9 and more) summed in another order differ by many units in the last
#: place, so the slack is relative to the cap (and absolute below one unit).
CAP_SLACK = 1e-9


def within(memory: float, cap: float) -> bool:
    """Whether ``memory`` fits under ``cap`` (same units), up to rounding."""
    return memory <= cap + CAP_SLACK * max(1.0, abs(cap))


def default_cap(placement: str, ranks: int, costs: Costs) -> float:
    """1F1B's activation peak: R stage activations, or 2R half-size ones on a V, in the units
    of ``costs.activation``. With per-stage activations (bytes, from the planner) each of those
    is the largest stage's, so the cap holds 1F1B's peak whichever rank sets it."""
    chunks = 2 if placement == "v" else 1
    return ranks * chunks * max(costs.per_stage("activation", chunks * ranks))


def smallest_cap(placement: Placement, costs: Costs) -> float:
    """The least activation peak any schedule can have: the rank whose stages' activations,
    one microbatch each, add up to the most (per-stage activations as the planner gives them)."""
    activation = costs.per_stage("activation", placement.num_stages)
    return max(
        sum(activation[s] for s in placement.stages_of(rank)) for rank in range(placement.num_ranks)
    )
