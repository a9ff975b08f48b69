"""Live activation memory per rank, from the op order alone.

An F allocates its stage's activation; a B frees all of it but the ``w_memory`` fraction its W
still needs; the W frees the rest; a BW frees everything. An overlapped pair allocates its F
before its backward frees, so the peak counts both. A rank's memory changes only at its own ops,
so its peak does not depend on timing, and the runtime's count can be checked against it.
"""

from __future__ import annotations

import numpy as np

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


def _trace(schedule: Schedule, ops, change) -> list[tuple[float, float]]:
    S, live, trace = schedule.num_stages, 0.0, []
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
    return trace


def activation_trace(schedule: Schedule, costs: Costs) -> list[list[tuple[float, float]]]:
    """Per rank, per op: (the most memory live during the op, the memory live after it)."""
    change = _changes(schedule, costs)
    return [_trace(schedule, ops, change) for ops in schedule.codes]


def peak_activations(schedule: Schedule, costs: Costs) -> list[float]:
    """The most activation memory each rank holds at once (the max of ``activation_trace``).

    ``code % 4S`` is ``4 * stage + kind`` for a single action (and for each half of an
    overlapped pair), so a flat table of changes turns a rank into one running sum at C speed:
    the same additions in the same order as ``activation_trace``, so the same peaks.
    """
    S, change = schedule.num_stages, _changes(schedule, costs)
    flat = np.array([delta for per_stage in change for delta in per_stage])
    period, span = 4 * S, schedule.codec.span
    peaks = []
    for ops in schedule.codes:
        if not ops:
            peaks.append(0.0)
            continue
        codes = np.asarray(ops, dtype=np.int64)
        pairs = codes < 0
        if not pairs.any():
            peaks.append(max(0.0, float(np.cumsum(flat[codes % period]).max())))
            continue
        forward, backward = np.divmod(-1 - codes[pairs], span)
        first = codes.copy()
        first[pairs] = forward
        at = np.arange(len(codes)) + np.cumsum(pairs) - pairs  # each op's first change
        deltas = np.empty(len(codes) + int(pairs.sum()))
        deltas[at] = flat[first % period]
        deltas[at[pairs] + 1] = flat[backward % period]  # a pair frees after it allocates
        live = np.cumsum(deltas)
        # a single op's peak is the larger of before and after it; a pair's, after its F
        before = np.concatenate(([0.0], live))[at[~pairs]]
        peaks.append(float(max(live[at].max(), before.max(initial=-np.inf))))
    return peaks


#: Per rank: its stages, and the Pareto-maximal vectors of live activation counts per stage.
LiveProfile = list[tuple[tuple[int, ...], list[tuple[float, ...]]]]


def live_profile(schedule: Schedule, w_memory: float) -> LiveProfile:
    """Per rank, how its live memory combines its stages' activations at its possible peaks.

    Live memory after any op is ``sum(count[i] * activation[stage[i]])``, the counts set by the
    op order alone (an F adds 1, a B takes ``1 - w_memory``, a W ``w_memory``). So one pass
    finds the count vectors, and the peak for any per-stage activations is the largest dot
    product over the vectors no other vector exceeds everywhere: what a balancer that tries
    thousands of splits of one schedule needs (``peak_from_profile``)."""
    delta = {0: 1.0, 1: -(1 - w_memory), 2: -w_memory, 3: -1.0}  # F, B, W, BW by kind code
    profile: LiveProfile = []
    for rank, ops in enumerate(schedule.codes):
        stages = tuple(sorted(schedule.placement.stages_of(rank)))
        points = _live_counts(schedule, ops, stages, delta)
        frontier: list[tuple[float, ...]] = []
        for point in sorted(points, reverse=True):
            if not any(all(f >= p for f, p in zip(kept, point, strict=True)) for kept in frontier):
                frontier.append(point)
        profile.append((stages, frontier))
    return profile


def _live_counts(
    schedule: Schedule, ops: list[int], stages: tuple[int, ...], delta: dict[int, float]
) -> set[tuple[float, ...]]:
    """The vectors of live activation counts per stage after each op of one rank."""
    S = schedule.num_stages
    index = {stage: i for i, stage in enumerate(stages)}
    count = [0.0] * len(stages)
    points: set[tuple[float, ...]] = set()
    for code in ops:
        # an overlapped pair allocates its F before its backward frees
        for single in schedule.codec.split_pair(code) if code < 0 else (code,):
            count[index[(single >> KIND_BITS) % S]] += delta[single & KIND_MASK]
            points.add(tuple(round(c, 9) for c in count))
    return points


def peak_from_profile(profile: LiveProfile, activation: list[float]) -> list[float]:
    """``peak_activations`` for per-stage ``activation`` bytes, from ``live_profile``."""
    return [
        max(0.0, *(sum(c * activation[s] for c, s in zip(point, stages, strict=True))
                   for point in frontier))
        for stages, frontier in profile
    ]  # fmt: skip
