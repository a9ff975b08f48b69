"""The event simulator: time a schedule under a cost model.

Each rank runs its ops in order; an op starts when the rank is free and every input it receives
has arrived (the producer's end plus ``comm`` if it crossed ranks). This is the runtime's model
(asynchronous sends, blocking receives), walked once in dependency order, so an invalid schedule
raises the validator's ``ScheduleError`` here too.
"""

from __future__ import annotations

from cutpipe.schedule.schedule import Schedule
from cutpipe.schedule.validate import walk
from cutpipe.sim.costs import Costs
from cutpipe.sim.timeline import Timeline


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Predict when every op of ``schedule`` runs under ``costs`` (default: F = B = W = 1)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"simulate takes a Schedule (e.g. generate('1f1b', 4, 8)), got {schedule!r}"
        )
    if costs is not None and not isinstance(costs, Costs):
        raise TypeError(f"simulate's costs must be a Costs or None, got {costs!r}")
    result = walk(schedule, (costs or Costs()).timing(schedule))
    return Timeline(schedule, result.starts, result.ends, unit="cost", source="simulated")
