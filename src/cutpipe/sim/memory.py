"""Live activation memory per rank, from the op order alone.

An F allocates its stage's activation; a B frees all of it but the ``w_memory`` fraction its W
still needs; the W frees the rest; a BW frees everything. An overlapped pair allocates its F
before its backward frees, so the peak counts both. A rank's memory changes only at its own ops,
so its peak does not depend on timing, and the runtime's count can be checked against it.
"""

from __future__ import annotations

from cutpipe.schedule.codes import F_CODE, KIND_BITS, KIND_MASK
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs


def _changes(schedule: Schedule, costs: Costs) -> list[tuple[float, float, float, float]]:
    """Per stage, the change in live memory made by its F, B, W and BW (indexed by kind code)."""
    kept = costs.w_memory
    return [
        (a, -(1 - kept) * a, -kept * a, -a)
        for a in costs.per_stage("activation", schedule.num_stages)
    ]


def activation_trace(schedule: Schedule, costs: Costs) -> list[list[tuple[float, float]]]:
    """Per rank, per op: (the most memory live during the op, the memory live after it)."""
    S, change = schedule.num_stages, _changes(schedule, costs)
    traces = []
    for ops in schedule.codes:
        live, trace = 0.0, []
        for code in ops:
            if code >= 0:
                before = live
                live += change[(code >> KIND_BITS) % S][code & KIND_MASK]
                trace.append((max(before, live), live))
            else:
                forward, backward = schedule.codec.split_pair(code)
                live += change[(forward >> KIND_BITS) % S][F_CODE]
                high = live
                live += change[(backward >> KIND_BITS) % S][backward & KIND_MASK]
                trace.append((high, live))
        traces.append(trace)
    return traces


def peak_activations(schedule: Schedule, costs: Costs) -> list[float]:
    """The most activation memory each rank holds at once (the max of ``activation_trace``)."""
    S, change = schedule.num_stages, _changes(schedule, costs)
    split = schedule.codec.split_pair
    peaks = []
    for ops in schedule.codes:
        live = peak = 0.0
        for code in ops:
            if code < 0:
                code, backward = split(code)
                live += change[(code >> KIND_BITS) % S][F_CODE]
                peak = max(peak, live)
                live += change[(backward >> KIND_BITS) % S][backward & KIND_MASK]
                continue
            live += change[(code >> KIND_BITS) % S][code & KIND_MASK]
            if live > peak:
                peak = live
        peaks.append(peak)
    return peaks
