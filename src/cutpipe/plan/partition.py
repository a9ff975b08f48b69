"""Balanced stages: split a model's cost items into a placement's stages for the shortest step.

The items are the embedding, every layer and the head (``cutpipe.plan.costs.model.model_items``). A
partition gives each stage a run of consecutive items, at least one. The balancer starts from
the split that evens out each stage's compute, then moves one item at a time across a stage
boundary while the simulated step gets shorter and every rank's memory stays under the cap. On a
V, rank 0 holds both the first and the last stage, so it ends up with fewer layers when the
embedding and the head make those stages heavy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise, permutations

import numpy as np

from cutpipe.plan.costs.model import ItemCost
from cutpipe.plan.progress import progress
from cutpipe.plan.screen import Screen
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import LiveProfile, live_profile, peak_activations, peak_from_profile
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

#: The most ops of a schedule ``balance`` searches over (it simulates the step once per
#: candidate move, hundreds of times): about half a minute of search at the limit.
MAX_BALANCED_OPS = 25_000
#: Moves ``screened_descent`` weighs at once after an improvement (doubling while none helps).
FIRST_BATCH = 64


def groups(items: Sequence[ItemCost], sizes: Sequence[int]) -> list[list[ItemCost]]:
    if len(items) != sum(sizes) or min(sizes) < 1:
        raise ValueError(
            f"stage sizes {list(sizes)} must be >= 1 each and cover all {len(items)} items"
        )
    out, start = [], 0
    for size in sizes:
        out.append(list(items[start : start + size]))
        start += size
    return out


def stage_costs(
    items: Sequence[ItemCost], sizes: Sequence[int], comm: float, w_memory: float,
    p2p_bytes: float = 1.0, fb: float | None = None,
) -> Costs:  # fmt: skip
    """The simulator's per-stage costs: each stage sums its items' times, memory and traffic."""
    parts = groups(items, sizes)

    def total(field: str) -> list[float]:
        return [sum(getattr(item, field) for item in part) for part in parts]

    return Costs(
        f=total("forward"), b=total("backward"), w=total("weight"), fb=fb, comm=comm,
        ep_f=total("ep_forward"), ep_b=total("ep_backward"), activation=total("activation"),
        w_memory=w_memory, params=total("parameters"), p2p_bytes=p2p_bytes,
        ep_bytes=max(total("ep_bytes")),
    )  # fmt: skip


def stage_state_bytes(items: Sequence[ItemCost], sizes: Sequence[int]) -> list[float]:
    """Training-state bytes of each stage (parameters, gradients, optimizer state)."""
    return [sum(item.state_bytes for item in part) for part in groups(items, sizes)]


def moves(sizes: Sequence[int]) -> Iterator[list[int]]:
    """The neighbours a balancer tries: one stage gives an item's place to another."""
    for giver, taker in permutations(range(len(sizes)), 2):
        if sizes[giver] > 1:
            trial = list(sizes)
            trial[giver] -= 1
            trial[taker] += 1
            yield trial


def even_sizes(items: Sequence[ItemCost], stages: int) -> list[int]:
    """Layers spread evenly (earlier stages take the rest), embedding first, head last.

    With more stages than layers (at most two more), the head and then the embedding get a
    stage of their own."""
    layers = len(items) - 2
    if len(items) < stages:
        raise ValueError(
            f"{layers} layers + embedding + head = {len(items)} items cannot fill {stages} "
            "stages: use fewer stages"
        )
    alone = max(0, stages - layers)  # 1: the head alone; 2: the embedding too
    shared = stages - alone
    base, extra = divmod(layers, shared)
    sizes = [base + (s < extra) for s in range(shared)]
    if alone == 2:
        sizes = [1, *sizes, 1]
    elif alone == 1:
        sizes = [sizes[0] + 1, *sizes[1:], 1]
    else:
        sizes[0] += 1
        sizes[-1] += 1
    return sizes


def compute_balanced_sizes(items: Sequence[ItemCost], stages: int) -> list[int]:
    """Consecutive groups of near-equal F+B+W: stage k ends where the running total of work
    comes closest to k/stages of the whole (each stage keeps at least one item)."""
    work = [item.forward + item.backward + item.weight for item in items]
    if len(work) < stages:
        raise ValueError(
            f"{len(work) - 2} layers + embedding + head = {len(work)} items cannot fill "
            f"{stages} stages: use fewer stages"
        )
    prefix = list(accumulate(work))
    total, cuts, previous = prefix[-1], [], 0
    for k in range(1, stages):
        target = k * total / stages
        low, high = previous + 1, len(work) - (stages - k)  # items in stages 0..k-1
        cut = min(range(low, high + 1), key=lambda n: abs(prefix[n - 1] - target))
        cuts.append(cut)
        previous = cut
    bounds = [0, *cuts, len(work)]
    return [b - a for a, b in pairwise(bounds)]


def rank_balanced_sizes(
    items: Sequence[ItemCost], schedule: Schedule, capacity: float | None = None,
    comm: float = 0.0, w_memory: float = 0.5, screened: bool = True,
    live: LiveProfile | None = None,
) -> list[int]:  # fmt: skip
    """``compute_balanced_sizes``, then items moved between stages while the busiest rank's
    work shrinks: on a V a rank runs stages r and 2R-1-r, so equal stages are not equal ranks.
    Where a rank holds several stages that run at different times (interleaved; DualPipe),
    the largest stage shrinks first and the busiest rank second: a rank's chunks take turns, so
    one long chunk holds up every rank behind it however even the rank totals are.
    With ``capacity`` (bytes), first of all while the fullest rank's memory shrinks towards it.
    Arithmetic and op-order memory only, no timing, so ``recommend`` can afford it for every
    candidate (give it a short ``schedule``: the memory peak does not grow with the step).
    ``screened``: weigh the moves in batches with numpy and score exactly only those that may
    improve (``cutpipe.plan.screen``; the same steps and split as scoring every move).
    ``live``: the schedule's ``live_profile(schedule, w_memory)``, when known."""
    placement = schedule.placement
    stages = placement.num_stages
    work = [item.forward + item.backward + item.weight for item in items]
    by_chunk = chunked(schedule)
    scale = sum(work) or 1.0

    prefix = [0.0, *accumulate(work)]
    runs = [(stage, rank) for pipe in placement.pipes for stage, rank in enumerate(pipe)]
    if capacity is not None:
        live = live if live is not None else live_profile(schedule, w_memory)
        held = [0.0, *accumulate(item.activation for item in items)]
        stored = [0.0, *accumulate(item.state_bytes for item in items)]

    def memory_of(sizes: list[int]) -> list[float]:  # rank_memory, arithmetically
        bounds = [0, *accumulate(sizes)]
        activation = [held[b] - held[a] for a, b in pairwise(bounds)]
        state = [stored[b] - stored[a] for a, b in pairwise(bounds)]
        peaks = peak_from_profile(live, activation)
        return [
            peak + sum(state[s] for s in stages)
            for peak, (stages, _) in zip(peaks, live, strict=True)
        ]

    def score(sizes: list[int]) -> tuple[float, tuple[float, ...], float, float]:
        bounds = [0, *accumulate(sizes)]
        per_stage = [prefix[b] - prefix[a] for a, b in pairwise(bounds)]
        ranks = [0.0] * placement.num_ranks
        for stage, rank in runs:
            ranks[rank] += per_stage[stage]
        over = 0.0 if capacity is None else max(0.0, max(memory_of(sizes)) - capacity)
        # the largest stage, then the next largest, ...: with several stages at the largest, a
        # move that shortens one of them is progress even though the largest stays (rounded, so
        # that sums of the same work in another order tie)
        stage_order = (
            tuple(sorted((round(w / scale, 12) for w in per_stage), reverse=True))
            if by_chunk
            else ()
        )
        return over, stage_order, max(ranks), sum(x * x for x in ranks)

    screen = None
    if screened:
        memory = (live, held, stored) if capacity is not None else None
        screen = Screen(runs, placement.num_ranks, prefix, scale, by_chunk, memory, capacity)
    sizes = compute_balanced_sizes(items, stages)
    if capacity is not None:  # first under the cap, moving only the fullest rank's items
        sizes = relieve(sizes, memory_of, capacity, [stages for stages, _ in live], screen)
        if max(memory_of(sizes)) > capacity:
            return sizes  # no split fits: the caller says by how much
    if screen is not None:
        return screened_descent(sizes, score, screen)
    best = score(sizes)
    improved = True
    while improved:  # first improvement, scanning on from it (cheaper than steepest descent)
        improved = False
        for giver, taker in permutations(range(stages), 2):
            if sizes[giver] > 1:
                trial = list(sizes)
                trial[giver] -= 1
                trial[taker] += 1
                value = score(trial)
                if value < best:
                    sizes, best, improved = trial, value, True
    return sizes


def moved(sizes: Sequence[int], giver: int, taker: int) -> list[int]:
    trial = list(sizes)
    trial[giver] -= 1
    trial[taker] += 1
    return trial


def screened_descent(
    sizes: list[int], score: Callable[[list[int]], tuple], screen: Screen
) -> list[int]:
    """``rank_balanced_sizes``'s first-improvement passes, the moves weighed in batches by
    ``screen`` and scored exactly only where they may improve: the same moves in the same order,
    so the same split. A batch grows while it finds nothing (the last pass finds nothing)."""
    order = np.array(list(permutations(range(len(sizes)), 2)), dtype=np.intp)
    best = score(sizes)
    position, batch, improved = 0, FIRST_BATCH, False
    while True:
        if position >= len(order):
            if not improved:
                return sizes
            position, batch, improved = 0, FIRST_BATCH, False
        moves = order[position : position + batch]
        for index in screen.maybe_better(sizes, moves, best):
            trial = moved(sizes, *moves[index].tolist())
            value = score(trial)
            if value < best:
                sizes, best, improved = trial, value, True
                position += index + 1
                batch = FIRST_BATCH
                break
        else:
            position += len(moves)
            batch *= 2


def relieve(
    sizes: list[int], memory_of: Callable[[list[int]], list[float]], capacity: float,
    held: Sequence[Sequence[int]], screen: Screen | None = None,
) -> list[int]:  # fmt: skip
    """Steepest descent on the fullest rank's memory, each move giving one of that rank's
    stages' items to another stage, until it fits under ``capacity`` or no move helps.
    With ``screen``, only the moves whose memory numpy puts near the least are weighed exactly."""
    memory = memory_of(sizes)
    while max(memory) > capacity:
        fullest = max(range(len(memory)), key=memory.__getitem__)
        best, best_peak = None, max(memory)
        moves = [
            (giver, taker)
            for giver in held[fullest]
            if sizes[giver] >= 2
            for taker in range(len(sizes))
            if taker != giver
        ]
        if screen is not None and moves:
            rows = screen.trials(sizes, np.array(moves, dtype=np.intp))
            moves = [moves[i] for i in screen.least_peaks(rows)]
        for giver, taker in moves:
            trial = moved(sizes, giver, taker)
            peak = max(memory_of(trial))
            if peak < best_peak:
                best, best_peak = trial, peak
        if best is None:
            break
        sizes, memory = best, memory_of(best)
    return sizes


def chunked(schedule: Schedule) -> bool:
    """Whether ``rank_balanced_sizes`` balances each stage before each rank: a placement whose
    ranks hold several stages that run at different times (interleaved; DualPipe, whose two
    pipes each run every stage in turn). A V is not one: its two stages on a rank meet at the
    tip and are balanced as a pair."""
    placement = schedule.placement
    held = max(len(placement.stages_of(rank)) for rank in range(placement.num_ranks))
    return placement.kind != "v" and held > 1


def rank_memory(
    schedule: Schedule, costs: Costs, state_bytes: Sequence[float],
    activations: Sequence[float] | None = None,
) -> list[float]:  # fmt: skip
    """Per rank: training state of the stages it stores (copies count) plus peak activations
    (``activations``, when known: ``peak_activations(schedule, costs)``)."""
    if activations is None:
        activations = peak_activations(schedule, costs)
    return [
        sum(state_bytes[s] for s in schedule.placement.stages_of(r)) + activations[r]
        for r in range(schedule.num_ranks)
    ]


@dataclass(frozen=True)
class Partition:
    sizes: list[int]
    costs: Costs
    step_time: float
    memory: list[float]  # bytes per rank


def evaluate(
    schedule: Schedule,
    items: Sequence[ItemCost],
    sizes: Sequence[int],
    comm: float,
    w_memory: float,
) -> Partition:
    costs = stage_costs(items, sizes, comm, w_memory)
    step = metrics(simulate(schedule, costs), costs).makespan
    memory = rank_memory(schedule, costs, stage_state_bytes(items, sizes))
    return Partition(list(sizes), costs, step, memory)


def balance(
    schedule: Schedule,
    items: Sequence[ItemCost],
    comm: float,
    w_memory: float,
    memory_cap: float | None = None,
    max_rounds: int = 200,
) -> Partition:
    """The partition with the shortest simulated step whose every rank fits ``memory_cap``.

    Each round simulates the step once per candidate move, so schedules of more than
    ``MAX_BALANCED_OPS`` ops are refused before the search starts.
    """
    stages = schedule.num_stages
    ops = schedule.num_ops
    if ops > MAX_BALANCED_OPS:
        raise ValueError(
            f"balancing simulates the step hundreds of times; {schedule.name} with "
            f"{schedule.num_microbatches:,} microbatches holds {ops:,} ops, over the limit of "
            f"{MAX_BALANCED_OPS:,}: use fewer microbatches or ranks"
        )
    if memory_cap is not None and not (
        isinstance(memory_cap, (int, float)) and math.isfinite(memory_cap) and memory_cap > 0
    ):
        raise ValueError(f"memory_cap must be a positive finite number of bytes, got {memory_cap}")
    cap = float("inf") if memory_cap is None else memory_cap

    def fits(partition: Partition) -> bool:
        return max(partition.memory) <= cap

    def key(partition: Partition) -> tuple[bool, float]:
        """Fitting partitions first, by step; the others by how much memory they need."""
        return (False, partition.step_time) if fits(partition) else (True, max(partition.memory))

    starts = [even_sizes(items, stages), compute_balanced_sizes(items, stages)]
    best = min((evaluate(schedule, items, s, comm, w_memory) for s in starts), key=key)
    with progress("balancing stages") as tick:
        for _ in range(max_rounds):
            candidates = [
                evaluate(schedule, items, trial, comm, w_memory) for trial in moves(best.sizes)
            ]
            tick(status=f"step {best.step_time:.4g}")
            challenger = min(candidates, key=key, default=best)
            worse, value = key(best)
            if key(challenger) >= (worse, value - 1e-12):  # no gain beyond rounding
                break
            best = challenger
    if not fits(best):
        raise ValueError(
            f"no partition of {len(items) - 2} layers into {stages} stages fits {cap / 1e9:.1f} GB per "
            f"device: the best needs {max(best.memory) / 1e9:.1f} GB ({(max(best.memory) - cap) / 1e9:.1f} GB "
            "over); use more devices, smaller microbatches or a schedule with a lower activation peak"
        )
    return best
