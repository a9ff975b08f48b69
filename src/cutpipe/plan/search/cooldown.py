"""Settle the cool-down: order each rank's tail by critical path, then pull W passes forward.

After its last forward a rank runs only backwards and weight passes, and its memory only falls,
so any order of that tail keeps the memory cap. The fixed orders alternate the two directions'
backwards there in a set rhythm, and on a V that rhythm makes the last microbatch's backward wait
a little on some rank, which delays the whole step's end. Ordering each tail by the longest path
from an op to the end of the step (its *bottom level*: a backward's own time plus the chain of
backwards below it) lets the last chain run unblocked. W passes end no chain, so they wait for
gaps; those that pile up at the end of the step-setting rank are then pulled forward to just
after their B wherever the simulator says that costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from cutpipe.plan.search.events import Ranks
from cutpipe.schedule.codes import B_CODE, BW_CODE, F_CODE, KIND_BITS, KIND_MASK, W_CODE
from cutpipe.schedule.dataflow import produced
from cutpipe.schedule.schedule import Schedule
from cutpipe.schedule.validate import Timing
from cutpipe.sim.costs import Costs
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate


def _last_forward(ops: tuple[int, ...]) -> int:
    return max((i for i, code in enumerate(ops) if code & KIND_MASK == F_CODE), default=-1)


def critical_path_tail(schedule: Schedule, costs: Costs) -> Schedule:
    """Keep every rank's order up to its last forward; re-sequence what follows by bottom level.

    A rank picks, among its tail ops whose input has arrived, the one with the longest path to
    the end of the step, and waits instead if a more urgent op arrives before the pick would end.
    Schedules with overlapped pairs or several pipes (DualPipe's) come back unchanged.
    """
    placement = schedule.placement
    if placement.num_pipes != 1 or any(code < 0 for ops in schedule.codes for code in ops):
        return schedule
    flow = schedule.dataflow
    timing = costs.timing(schedule)
    durations = (timing.forward, timing.backward, timing.weight, timing.full_backward)

    def duration(code: int) -> float:
        return durations[code & KIND_MASK][code >> KIND_BITS]

    level = _bottom_levels(schedule, timing)
    if level is None:
        return schedule  # not a whole training step: nothing to settle

    def bottom(code: int) -> float:
        slot = code >> KIND_BITS
        return timing.weight[slot] if code & KIND_MASK == W_CODE else level[slot]

    ranks = Ranks(flow, timing.latency)
    prefix, tails = [], []
    for ops in schedule.codes:
        cut = _last_forward(ops) + 1
        prefix.append(list(ops[:cut]))
        tails.append(list(ops[cut:]))
    pointer = [0] * placement.num_ranks

    def run(rank: int, code: int, start: float) -> None:
        """Place ``code`` and wake the rank that reads its output (it re-decides then)."""
        end = start + duration(code)
        ranks.place(rank, code, end)
        key = flow.makes(code)
        if key is not None:
            ranks.wake(flow.consumer(key), end)

    for now, r in ranks.wakeups():
        if now < ranks.clock[r]:
            continue
        if pointer[r] < len(prefix[r]):  # the fixed part: in order
            code = prefix[r][pointer[r]]
            at = ranks.ready[code]
            if at is None:
                continue  # woken when its input is made
            if at > now:
                ranks.wake(r, at)
                continue
            pointer[r] += 1
            run(r, code, now)
            continue
        known = [(at, code) for code in tails[r] if (at := ranks.ready[code]) is not None]
        ready = [(bottom(code), -at, code) for at, code in known if at <= now]
        if not ready:
            if known:
                ranks.wake(r, min(at for at, _ in known))
            continue
        urgency, _, pick = max(ready)
        sooner = [at for at, code in known if at > now and bottom(code) > urgency]
        if sooner and min(sooner) < now + duration(pick):
            ranks.wake(r, min(sooner))  # leave the rank free for it
            continue
        tails[r].remove(pick)
        run(r, pick, now)
    if any(pointer[r] < len(prefix[r]) or tails[r] for r in range(placement.num_ranks)):
        return schedule  # cannot happen for a valid schedule; keep the original to be safe
    orders = tuple(map(tuple, ranks.orders))
    return Schedule(schedule.name, placement, schedule.num_microbatches, orders)


def _bottom_levels(schedule: Schedule, timing: Timing) -> list[float] | None:
    """Per slot: the longest path from its backward to the end of the step (its own time plus
    its W, or plus the chain of backwards that read its gradient); None unless every slot has
    exactly one backward."""
    S, m = schedule.num_stages, schedule.num_microbatches
    flow = schedule.dataflow
    backward_kind = {}
    for ops in schedule.codes:
        for code in ops:
            if code & KIND_MASK in (B_CODE, BW_CODE):
                backward_kind[code >> KIND_BITS] = code & KIND_MASK
    if len(backward_kind) != S * m:
        return None
    full = (timing.forward, timing.backward, timing.weight, timing.full_backward)
    level = [0.0] * (S * m)
    # a backward's gradient is read by a lower stage's backward, so low stages come first
    for stage in range(S):
        for mb in range(m):
            slot = mb * S + stage
            kind = backward_kind[slot]
            own = timing.weight[slot] if kind == B_CODE else 0.0
            below = 0.0
            reader_kind, reader_stage = flow.reader(produced(kind, stage, mb))
            if reader_kind != W_CODE:
                reader = flow.rank(reader_stage, mb)
                hop = timing.latency if reader != flow.rank(stage, mb) else 0.0
                below = hop + level[mb * S + reader_stage]
            level[slot] = full[kind][slot] + max(own, below)
    return level


def sink_weights(
    schedule: Schedule, costs: Costs, score: Callable, evaluations: int = 256
) -> Schedule:
    """Pull the W passes in the tails of the step-setting ranks forward, to just after their B.

    The ranks with the longest span and the latest end are visited; each W in the tail is
    moved to right after its own B (or after the rank's last forward, whichever is later) and
    the move is kept if the simulator scores the step no worse. Moves that change nothing are
    kept too: they free the gaps later W need. At most ``evaluations`` simulations in all.
    """
    best = schedule
    timeline = simulate(best, costs)
    result = metrics(timeline, costs)
    best_score = score(result)
    ranks = {
        max(range(best.num_ranks), key=lambda r: result.span_per_rank[r]),
        max(range(best.num_ranks), key=lambda r: timeline.ends[r][-1] if best.codes[r] else 0),
    }
    for rank in sorted(ranks):
        weights = [c for c in best.codes[rank][_last_forward(best.codes[rank]) + 1 :]
                   if c >= 0 and c & KIND_MASK == W_CODE]  # fmt: skip
        for weight in weights:
            if evaluations <= 0:
                return best
            ops = list(best.codes[rank])
            here = ops.index(weight)
            there = max(ops.index((weight & ~KIND_MASK) | B_CODE), _last_forward(ops)) + 1
            if there >= here:
                continue
            evaluations -= 1
            ops.insert(there, ops.pop(here))
            codes = (*best.codes[:rank], tuple(ops), *best.codes[rank + 1 :])
            candidate = Schedule(best.name, best.placement, best.num_microbatches, codes)
            candidate_score = score(metrics(simulate(candidate, costs), costs))
            if candidate_score <= best_score:
                best, best_score = candidate, candidate_score
    return best


def settle_cooldown(
    schedule: Schedule, costs: Costs, score: Callable, evaluations: int = 32
) -> Schedule:
    """``critical_path_tail`` then ``sink_weights``; the input back if that is not better."""
    settled = sink_weights(critical_path_tail(schedule, costs), costs, score, evaluations)
    before = score(metrics(simulate(schedule, costs), costs))
    return settled if score(metrics(simulate(settled, costs), costs)) < before else schedule
