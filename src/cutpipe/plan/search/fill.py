"""A pass of the cost-aware search: keep a schedule's forwards and backwards, re-place its W passes.

A W pass is on no chain to the loss: it only has to run after its B, and until it does it holds
a share of its forward's activation. Where a rank waits for its next F or B, a W fills the gap;
``tune.cost_aware`` runs this on the best few candidates, patient and not.
"""

from __future__ import annotations

from collections import deque

from cutpipe.plan.search.caps import within
from cutpipe.plan.search.events import Ranks
from cutpipe.schedule.codes import B_CODE, F_CODE, KIND_BITS, KIND_MASK, W_CODE
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs


def fill_weights(base: Schedule, costs: Costs, cap: float, patient: bool) -> Schedule:
    """Keep ``base``'s order of forwards and backwards, and place its W passes by time.

    A rank whose next F or B must wait for its input runs pending W passes in the gap; with
    ``patient``, only those that end before the input arrives (if the arrival is known), so
    that no W delays the critical path. A W also runs first when the next F would break the
    memory cap. Whatever is left runs at the end, oldest first.
    """
    placement, m = base.placement, base.num_microbatches
    R, S = placement.num_ranks, placement.num_stages
    ranks = Ranks(base.dataflow, costs.comm)
    codec = base.codec
    w = costs.per_stage("w", S)
    activation = costs.per_stage("activation", S)
    kept = costs.w_memory
    timing = costs.timing(base)
    durations = (timing.forward, timing.backward, timing.weight, timing.full_backward)
    main = [[c for c in ops if c < 0 or c & KIND_MASK != W_CODE] for ops in base.codes]
    pointer = [0] * R
    memory = [0.0] * R
    pending: list[deque[tuple[int, int]]] = [deque() for _ in range(R)]

    def halves(code: int) -> tuple[int, ...]:
        return codec.split_pair(code) if code < 0 else (code,)

    def allocation(code: int) -> float:
        return sum(
            activation[(h >> KIND_BITS) % S] for h in halves(code) if h & KIND_MASK == F_CODE
        )

    def run_weight(r: int, now: float) -> None:
        stage, mb = pending[r].popleft()
        memory[r] -= kept * activation[stage]
        ranks.place(r, codec.action(W_CODE, stage, mb), now + w[stage])

    for now, r in ranks.wakeups():
        if now < ranks.clock[r] or (pointer[r] >= len(main[r]) and not pending[r]):
            continue
        now = ranks.clock[r]
        if pointer[r] >= len(main[r]):  # only weight passes left
            run_weight(r, now)
            continue
        code = main[r][pointer[r]]
        times = [ranks.ready[half] for half in halves(code)]
        ready = None if None in times else max([now, *times])
        over = not within(memory[r] + allocation(code), cap)
        if pending[r] and (over or ready is None or ready > now):
            stage = pending[r][0][0]
            if over or not patient or (ready is not None and now + w[stage] <= ready):
                run_weight(r, now)
                continue
        if ready is None:  # wait until the producer runs
            ranks.park(r, halves(code)[times.index(None)])
            continue
        if ready > now:
            ranks.clock[r] = ready
            ranks.wake(r, ready)
            continue
        # run the op
        pointer[r] += 1
        if code < 0:
            duration = timing.pair(*codec.split_pair(code))
        else:
            duration = durations[code & KIND_MASK][code >> KIND_BITS]
        for half in halves(code):
            mb, stage = divmod(half >> KIND_BITS, S)
            kind = half & KIND_MASK
            if kind == F_CODE:
                memory[r] += activation[stage]
            else:
                memory[r] -= activation[stage] * (1 - kept if kind == B_CODE else 1.0)
                if kind == B_CODE:
                    pending[r].append((stage, mb))
        ranks.place(r, code, now + duration)
    if any(pointer[r] < len(main[r]) or pending[r] for r in range(R)):
        raise ValueError(f"{base.name}: its order of forwards and backwards cannot run")
    return Schedule(f"{base.name}+w", placement, m, tuple(tuple(o) for o in ranks.orders))
