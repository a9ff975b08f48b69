"""Run a schedule's ops in dependency order, the way the runtime would, and say what is wrong.

The communication model is the runtime's: sends are asynchronous, receives block. A rank runs its
ops in order; an op waits until every input it receives from another rank has been produced. So
a schedule runs to the end exactly when

- every (stage, microbatch) gets one F and one backward (B and W, or BW, alone or in a pair),
- each op runs on a rank that holds its stage (for its microbatch's pipe),
- an op's inputs from its own rank come earlier in that rank's list, and
- no set of ranks waits on each other in a cycle (a deadlock).

``walk`` executes the ops once, optionally timing them; ``validate`` is a walk with zero costs.
Errors are ``ScheduleError`` values naming the rank, the op and the missing dependency.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cutpipe.schedule.actions import Action, Kind
from cutpipe.schedule.codes import B_CODE, BW_CODE, F_CODE, KIND_BITS, KIND_MASK, W_CODE
from cutpipe.schedule.schedule import Schedule


class ScheduleError(ValueError):
    """A schedule that cannot run as written."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        action: str | None = None,
        dependency: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.action = action
        self.dependency = dependency


@dataclass(frozen=True)
class Timing:
    """How long ops take, for ``walk``: per-slot tables and a pair rule.

    ``forward``, ``backward``, ``weight`` and ``full_backward`` hold one duration per slot
    (``microbatch * S + stage``); ``pair(forward_code, backward_code)`` gives an overlapped pair's;
    ``latency`` is added to every input that crosses ranks.
    """

    forward: Sequence[float]
    backward: Sequence[float]
    weight: Sequence[float]
    full_backward: Sequence[float]
    pair: Callable[[int, int], float]
    latency: float = 0.0


@dataclass(frozen=True)
class Walk:
    """When each op of each rank started and ended."""

    starts: tuple[list[float], ...]
    ends: tuple[list[float], ...]


def _per_slot(schedule: Schedule, per_stage: Callable[[tuple[int, ...]], list]) -> list:
    """Expand a per-stage pattern (computed from a pipe's stage-to-rank list) to every slot."""
    placement, m = schedule.placement, schedule.num_microbatches
    out: list = []
    for pipe, ranks in enumerate(placement.pipes):
        out.extend(per_stage(ranks) * len(placement.microbatches_of(pipe, m)))
    return out


def slot_owners(schedule: Schedule) -> list[int]:
    """The rank that runs each slot (``microbatch * S + stage``), from the placement."""
    return _per_slot(schedule, list)


def _crossing_latency(schedule: Schedule, latency: float, step: int) -> list[float]:
    """Per slot: ``latency`` if the input from stage s+step comes from another rank, else 0."""
    S = schedule.num_stages

    def pattern(ranks: tuple[int, ...]) -> list[float]:
        return [
            latency if 0 <= s + step < S and ranks[s + step] != ranks[s] else 0.0 for s in range(S)
        ]

    return _per_slot(schedule, pattern)


def walk(schedule: Schedule, timing: Timing | None = None) -> Walk:
    """Execute the schedule in dependency order; raise ``ScheduleError`` if it cannot run.

    Ranks run until they block on an input; a blocked rank waits on the slot it needs and the op
    that produces that slot puts it back on the run stack. Start and end times follow from the
    dependencies alone, so the order in which ranks are advanced does not change them.
    """
    S, m, R = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    slots = S * m
    owners = slot_owners(schedule)
    if timing is None:
        zeros = [0.0] * slots
        dur_f = dur_b = dur_w = dur_bw = lat_f = lat_b = zeros
        pair_time: Callable[[int, int], float] = lambda _f, _b: 0.0  # noqa: E731
    else:
        dur_f, dur_b, dur_w, dur_bw = (
            timing.forward,
            timing.backward,
            timing.weight,
            timing.full_backward,
        )
        lat_f = _crossing_latency(schedule, timing.latency, -1)
        lat_b = _crossing_latency(schedule, timing.latency, +1)
        pair_time = timing.pair
    span = slots << KIND_BITS
    last = S - 1

    f_end: list[float | None] = [None] * slots  # when each slot's F output is ready
    g_end: list[float | None] = [None] * slots  # when each slot's input gradient is ready
    split = bytearray(slots)  # slot ran B (its W is still due or done)
    w_done = bytearray(slots)  # slot's weight gradient is done (W or BW)
    f_waiter = [-1] * slots  # rank blocked on each slot's F output
    g_waiter = [-1] * slots  # rank blocked on each slot's input gradient

    codes = schedule.codes
    pointer = [0] * R
    clock = [0.0] * R
    starts = tuple([0.0] * len(ops) for ops in codes)
    ends = tuple([0.0] * len(ops) for ops in codes)
    runnable = [r for r in reversed(range(R)) if codes[r]]
    pair_cache: dict[int, float] = {}  # pair duration by (forward stage, backward stage, kind)

    # The hot loop: it runs once per op, so it works on the packed codes directly.
    while runnable:
        r = runnable.pop()
        ops, p, t = codes[r], pointer[r], clock[r]
        start_list, end_list = starts[r], ends[r]
        n = len(ops)
        while p < n:
            code = ops[p]
            if code >= 0:
                slot = code >> KIND_BITS
                if owners[slot] != r:
                    raise _wrong_rank_error(schedule, r, code, owners[slot])
                kind = code & KIND_MASK
                if kind == F_CODE:
                    if slot % S:
                        ready = f_end[slot - 1]
                        if ready is None:
                            f_waiter[slot - 1] = r
                            break
                        ready += lat_f[slot]
                        if ready > t:
                            t = ready
                    if f_end[slot] is not None:
                        raise _duplicate_error(schedule, r, code)
                    start_list[p] = t
                    t += dur_f[slot]
                    f_end[slot] = t
                    if f_waiter[slot] >= 0:
                        runnable.append(f_waiter[slot])
                elif kind == W_CODE:
                    if not split[slot] or w_done[slot]:
                        raise _weight_error(schedule, r, code, bool(w_done[slot]))
                    start_list[p] = t
                    t += dur_w[slot]
                    w_done[slot] = 1
                else:
                    if f_end[slot] is None:
                        raise _order_error(schedule, r, code, slot << KIND_BITS)
                    if slot % S != last:
                        ready = g_end[slot + 1]
                        if ready is None:
                            g_waiter[slot + 1] = r
                            break
                        ready += lat_b[slot]
                        if ready > t:
                            t = ready
                    if g_end[slot] is not None:
                        raise _duplicate_error(schedule, r, code)
                    start_list[p] = t
                    if kind == BW_CODE:
                        t += dur_bw[slot]
                        w_done[slot] = 1
                    else:
                        t += dur_b[slot]
                        split[slot] = 1
                    g_end[slot] = t
                    if g_waiter[slot] >= 0:
                        runnable.append(g_waiter[slot])
            else:
                forward, backward = divmod(-1 - code, span)
                f_slot, b_slot = forward >> KIND_BITS, backward >> KIND_BITS
                if forward & KIND_MASK != F_CODE or backward & KIND_MASK not in (B_CODE, BW_CODE):
                    raise _pair_shape_error(schedule, r, code)
                if owners[f_slot] != r:
                    raise _wrong_rank_error(schedule, r, forward, owners[f_slot])
                if owners[b_slot] != r:
                    raise _wrong_rank_error(schedule, r, backward, owners[b_slot])
                if f_end[b_slot] is None:
                    raise _order_error(schedule, r, backward, b_slot << KIND_BITS)
                begin = t
                if f_slot % S:
                    ready = f_end[f_slot - 1]
                    if ready is None:
                        f_waiter[f_slot - 1] = r
                        break
                    ready += lat_f[f_slot]
                    if ready > begin:
                        begin = ready
                if b_slot % S != last:
                    ready = g_end[b_slot + 1]
                    if ready is None:
                        g_waiter[b_slot + 1] = r
                        break
                    ready += lat_b[b_slot]
                    if ready > begin:
                        begin = ready
                if f_end[f_slot] is not None:
                    raise _duplicate_error(schedule, r, forward)
                if g_end[b_slot] is not None:
                    raise _duplicate_error(schedule, r, backward)
                key = ((f_slot % S) * S + b_slot % S) * 4 + (backward & KIND_MASK)
                duration = pair_cache.get(key)
                if duration is None:
                    duration = pair_cache[key] = pair_time(forward, backward)
                start_list[p] = begin
                t = begin + duration
                f_end[f_slot] = g_end[b_slot] = t
                if backward & KIND_MASK == BW_CODE:
                    w_done[b_slot] = 1
                else:
                    split[b_slot] = 1
                if f_waiter[f_slot] >= 0:
                    runnable.append(f_waiter[f_slot])
                if g_waiter[b_slot] >= 0:
                    runnable.append(g_waiter[b_slot])
            end_list[p] = t
            p += 1
        pointer[r], clock[r] = p, t

    if any(pointer[r] < len(codes[r]) for r in range(R)):
        raise _stall_error(schedule, pointer, owners)
    if None in f_end or None in g_end or 0 in w_done:
        raise _missing_error(schedule, f_end, g_end, w_done, owners)
    return Walk(starts, ends)


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` unless the schedule runs to the end under the runtime's model."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate takes a Schedule (e.g. generate('zbv', 4, 8)), got {schedule!r}")
    walk(schedule)


# -- error messages: built only on failure, so they may be slow and thorough ------------------


def _show(schedule: Schedule, code: int) -> str:
    return str(schedule.codec.decode(code))


def _describe(schedule: Schedule, code: int) -> str:
    action = schedule.codec.decode(code)
    assert isinstance(action, Action)
    return f"{action} ({action.kind.name} of stage {action.stage}, microbatch {action.microbatch})"


def _wrong_rank_error(schedule: Schedule, rank: int, code: int, owner: int) -> ScheduleError:
    action = schedule.codec.decode(code)
    assert isinstance(action, Action)
    pipe = schedule.pipe_of(action.microbatch)
    where = f" of pipe {pipe}" if schedule.placement.num_pipes > 1 else ""
    held = ", ".join(map(str, schedule.placement.stages_of(rank)))
    return ScheduleError(
        f"rank {rank} runs {_describe(schedule, code)}, but stage {action.stage}{where} is held by "
        f"rank {owner}; rank {rank} holds stages {held}",
        rank=rank,
        action=str(action),
    )


def _duplicate_error(schedule: Schedule, rank: int, code: int) -> ScheduleError:
    action = schedule.codec.decode(code)
    assert isinstance(action, Action)
    what = "forward" if action.kind is Kind.F else "backward"
    return ScheduleError(
        f"rank {rank} runs {_describe(schedule, code)}, but that {what} already ran: every "
        "(stage, microbatch) gets exactly one F and one backward (B and W, or BW)",
        rank=rank,
        action=str(action),
    )


def _weight_error(schedule: Schedule, rank: int, code: int, already: bool) -> ScheduleError:
    action = schedule.codec.decode(code)
    assert isinstance(action, Action)
    needed = Action(Kind.B, action.stage, action.microbatch)
    reason = (
        "its weight gradient is already done (by an earlier W or BW)"
        if already
        else f"it needs {needed} (the input-gradient backward) to run on this rank first"
    )
    return ScheduleError(
        f"rank {rank} runs {_describe(schedule, code)}, but {reason}",
        rank=rank,
        action=str(action),
        dependency=None if already else str(needed),
    )


def _order_error(schedule: Schedule, rank: int, code: int, needed: int) -> ScheduleError:
    return ScheduleError(
        f"rank {rank} runs {_describe(schedule, code)} before {_show(schedule, needed)}, the "
        "forward it differentiates; that forward must come earlier on the same rank",
        rank=rank,
        action=_show(schedule, code),
        dependency=_show(schedule, needed),
    )


def _pair_shape_error(schedule: Schedule, rank: int, code: int) -> ScheduleError:
    return ScheduleError(
        f"rank {rank} runs {_show(schedule, code)}: an overlapped pair must be a forward (F) and a "
        "backward (B or BW)",
        rank=rank,
        action=_show(schedule, code),
    )


def _halves(schedule: Schedule, code: int) -> tuple[int, ...]:
    return schedule.codec.split_pair(code) if code < 0 else (code,)


def _output_key(code: int) -> tuple[int, str] | None:
    """What a single action produces for others: ("F", slot) or ("G", slot) for a gradient."""
    kind = code & KIND_MASK
    if kind == W_CODE:
        return None
    return (code >> KIND_BITS, "F" if kind == F_CODE else "G")


def _needed_key(schedule: Schedule, code: int) -> tuple[int, str] | None:
    """The output a single action receives from a neighbouring stage, or None."""
    slot, kind = code >> KIND_BITS, code & KIND_MASK
    stage = slot % schedule.num_stages
    if kind == F_CODE and stage > 0:
        return (slot - 1, "F")
    if kind in (B_CODE, BW_CODE) and stage < schedule.num_stages - 1:
        return (slot + 1, "G")
    return None


def _key_text(schedule: Schedule, key: tuple[int, str]) -> str:
    slot, what = key
    microbatch, stage = divmod(slot, schedule.num_stages)
    if what == "F":
        return str(Action(Kind.F, stage, microbatch))
    return f"{Action(Kind.B, stage, microbatch)}/{Action(Kind.BW, stage, microbatch)}"


def _stall_error(schedule: Schedule, pointer: list[int], owners: list[int]) -> ScheduleError:
    """No rank can move: explain each waiting rank, naming missing ops, self-waits or a cycle."""
    produced: set[tuple[int, str]] = set()
    position: dict[tuple[int, str], tuple[int, int]] = {}
    for r, ops in enumerate(schedule.codes):
        for p, code in enumerate(ops):
            for half in _halves(schedule, code):
                key = _output_key(half)
                if key is None:
                    continue
                position.setdefault(key, (r, p))
                if p < pointer[r]:
                    produced.add(key)

    waits = []
    for r, ops in enumerate(schedule.codes):
        if pointer[r] >= len(ops):
            continue
        for half in _halves(schedule, ops[pointer[r]]):
            need = _needed_key(schedule, half)
            if need is None or need in produced:
                continue
            action, need_text = _show(schedule, half), _key_text(schedule, need)
            producer = owners[need[0]]
            where = position.get(need)
            if where is None:
                return ScheduleError(
                    f"rank {r} waits at {action} for {need_text} from rank {producer}, but no rank "
                    f"runs it: the schedule is missing it (rank {producer} should run it)",
                    rank=r,
                    action=action,
                    dependency=need_text,
                )
            if where[0] == r:
                return ScheduleError(
                    f"rank {r} runs {action} (position {pointer[r]}) before {need_text}, which it "
                    f"needs and which the same rank runs later (position {where[1]}): move it "
                    "earlier",
                    rank=r,
                    action=action,
                    dependency=need_text,
                )
            waits.append((r, action, need_text, where[0]))
            break
    chain = "; ".join(f"rank {r} waits at {a} for {n} from rank {src}" for r, a, n, src in waits)
    first = waits[0]
    return ScheduleError(
        f"deadlock: {chain}. Every waiting rank blocks on a receive whose sender is itself "
        "waiting; reorder the ops so that each input is produced before it is awaited",
        rank=first[0],
        action=first[1],
        dependency=first[2],
    )


def _missing_error(
    schedule: Schedule,
    f_end: list[float | None],
    g_end: list[float | None],
    w_done: bytearray,
    owners: list[int],
) -> ScheduleError:
    S = schedule.num_stages
    for slot in range(len(f_end)):
        microbatch, stage = divmod(slot, S)
        owner = owners[slot]
        if f_end[slot] is None:
            missing = Action(Kind.F, stage, microbatch)
        elif g_end[slot] is None:
            missing = Action(Kind.BW, stage, microbatch)
        elif not w_done[slot]:
            missing = Action(Kind.W, stage, microbatch)
        else:
            continue
        what = "backward (B then W, or BW)" if missing.kind is Kind.BW else missing.kind.name
        return ScheduleError(
            f"stage {stage}, microbatch {microbatch} never gets its {what}: rank {owner} should run "
            f"{missing}",
            rank=owner,
            action=str(missing),
        )
    raise AssertionError("no missing op found")  # pragma: no cover
