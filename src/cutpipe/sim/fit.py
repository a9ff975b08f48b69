"""Simulations read off a measured timeline: per-stage median costs, or every op's own time.

Simulating a schedule with these predicts its step with the measured op times and no
communication or runtime overhead; the gap to the measured timeline is what those add.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from cutpipe.schedule.actions import Kind, Overlap
from cutpipe.schedule.codes import B_CODE, BW_CODE, F_CODE, KIND_BITS, KIND_MASK, W_CODE
from cutpipe.schedule.dataflow import Key
from cutpipe.schedule.validate import Timing, walk
from cutpipe.sim.costs import Costs
from cutpipe.sim.timeline import Timeline


def fitted_costs(timeline: Timeline, base: Costs | None = None) -> Costs:
    """Costs whose per-stage F, B, W and F&B times are the medians measured in ``timeline``.

    A stage that only ran full backwards gets its BW time as B and no W (the simulator charges
    B + W for a BW). Memory and size fields come from ``base``.
    """
    base = base or Costs()
    S = timeline.schedule.num_stages
    times: dict[tuple[Kind, int], list[float]] = defaultdict(list)
    pairs: list[float] = []
    for rank in range(timeline.num_ranks):
        for op, start, end in timeline.events(rank):
            if type(op) is Overlap:
                pairs.append(end - start)
            else:
                times[op.kind, op.stage].append(end - start)

    def median(kind: Kind, stage: int) -> float | None:
        values = times.get((kind, stage))
        return statistics.median(values) if values else None

    f, b, w = [], [], []
    for stage in range(S):
        f.append(median(Kind.F, stage) or 0.0)
        split_b, split_w, full = (
            median(Kind.B, stage),
            median(Kind.W, stage),
            median(Kind.BW, stage),
        )
        if split_b is not None:
            b.append(split_b)
            w.append(split_w or 0.0)
        else:
            b.append(full or 0.0)
            w.append(0.0)
    return Costs(
        f=f, b=b, w=w, fb=statistics.median(pairs) if pairs else None, comm=0.0,
        activation=base.activation, w_memory=base.w_memory, params=base.params,
        p2p_bytes=base.p2p_bytes, ep_bytes=base.ep_bytes,
    )  # fmt: skip


@dataclass(frozen=True)
class Delays:
    """What a runtime adds to a schedule's ops, as means read off a measured timeline.

    ``latency``: from an input being produced on another rank to the op that waited for it
    starting (moving the value and waking the rank). ``overhead``: from a rank finishing one op
    to starting the next when nothing was missing (posting receives, bookkeeping). On a loaded
    machine both grow, unevenly (a rank that wakes up waits for a core, now and then): means,
    not medians, because the step's idle time is their sum.
    """

    latency: float = 0.0
    overhead: float = 0.0


def replayed(timeline: Timeline, delays: Delays | None = None) -> Timeline:
    """The simulator fed every op's own measured duration, plus ``delays``.

    Whatever the machine did to the ops' lengths (a loaded core, a slow kernel), the replay
    keeps; what it cannot contain is waiting beyond the schedule's own dependencies and the
    typical delays. So a replay that predicts the measured step says the runtime waited for
    nothing the schedule does not ask for.
    """
    delays = delays or Delays()
    schedule = timeline.schedule
    slots = schedule.num_stages * schedule.num_microbatches
    tables = {kind: [0.0] * slots for kind in (F_CODE, B_CODE, W_CODE, BW_CODE)}
    pairs: dict[tuple[int, int], float] = {}
    split = schedule.codec.split_pair
    for rank in range(timeline.num_ranks):
        for code, start, end in zip(
            schedule.codes[rank], timeline.starts[rank], timeline.ends[rank], strict=True
        ):
            took = end - start + delays.overhead
            if code < 0:
                pairs[split(code)] = took
            else:
                tables[code & KIND_MASK][code >> KIND_BITS] = took
    timing = Timing(
        tables[F_CODE], tables[B_CODE], tables[W_CODE], tables[BW_CODE],
        lambda forward, backward: pairs[(forward, backward)], delays.latency, pairs_vary=True,
    )  # fmt: skip
    result = walk(schedule, timing)
    # the overhead is time before an op, idle as in the measurement, not part of the op
    starts = [[start + delays.overhead for start in rank] for rank in result.starts]
    return Timeline(schedule, starts, result.ends, unit=timeline.unit, source="replayed")


def measured_delays(timeline: Timeline) -> Delays:
    """The mean latency and overhead of ``timeline`` (see ``Delays``); zero where no op shows
    one."""
    schedule = timeline.schedule
    flow, codec = schedule.dataflow, schedule.codec
    made: dict[Key, tuple[int, float]] = {}  # each value -> (rank, end) of the op that made it
    for rank in range(timeline.num_ranks):
        for code, end in zip(schedule.codes[rank], timeline.ends[rank], strict=True):
            for half in codec.split_pair(code) if code < 0 else (code,):
                key = flow.makes(half)
                if key is not None:
                    made[key] = (rank, end)
    # (start, when the rank was free, when its last input from another rank was made) per op
    ops: list[tuple[float, float | None, float | None]] = []
    for rank in range(timeline.num_ranks):
        free = None  # when this rank finished its previous op
        for code, start, end in zip(
            schedule.codes[rank], timeline.starts[rank], timeline.ends[rank], strict=True
        ):
            ready = [
                ended
                for half in (codec.split_pair(code) if code < 0 else (code,))
                for source, ended in (made.get(flow.awaits(half), (None, 0.0)),)
                if source is not None and source != rank
            ]
            ops.append((start, free, max(ready) if ready else None))
            free = end
    # first the ops that surely waited for data (made after the rank was free), then the ones
    # made a little before: still in flight when the rank got free, if within that latency
    sure = [start - ready for start, free, ready in ops
            if ready is not None and (free is None or ready >= free)]  # fmt: skip
    typical = statistics.fmean(sure) if sure else 0.0
    latencies, overheads = [max(0.0, value) for value in sure], []
    for start, free, ready in ops:
        if free is None or (ready is not None and ready >= free):
            continue
        if ready is not None and ready + typical >= free:
            latencies.append(max(0.0, start - ready))
        else:
            overheads.append(max(0.0, start - free))
    return Delays(
        statistics.fmean(latencies) if latencies else 0.0,
        statistics.fmean(overheads) if overheads else 0.0,
    )
