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
from cutpipe.schedule.dataflow import ACTIVATION, Key
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
    ``latency`` is added to every input that crosses ranks. A pair's time is asked once per
    (stages, backward kind) unless ``pairs_vary`` (each pair has its own, e.g. measured, time).
    """

    forward: Sequence[float]
    backward: Sequence[float]
    weight: Sequence[float]
    full_backward: Sequence[float]
    pair: Callable[[int, int], float]
    latency: float = 0.0
    pairs_vary: bool = False


@dataclass(frozen=True)
class Walk:
    """When each op of each rank started and ended."""

    starts: tuple[list[float], ...]
    ends: tuple[list[float], ...]


def walk(
    schedule: Schedule, timing: Timing | None = None, release: Sequence[float] | None = None
) -> Walk:
    """Execute the schedule in dependency order; raise ``ScheduleError`` if it cannot run.

    ``release``, one time per rank (default 0), is when each rank may start its first op: the
    simulation of several steps (``cutpipe.sim.steps``) releases each step's ranks when their
    previous step and optimizer step are done.

    Ranks run until they block on an input; a blocked rank waits on the value it needs and the op
    that makes that value puts it back on the run stack. Start and end times follow from the
    dependencies alone, so the order in which ranks are advanced does not change them. What each
    op waits for comes from ``schedule.dataflow`` (``Dataflow.inputs``, one small table); a W's
    own B and a backward's own forward are also checked as order on the rank, so that running
    them out of order is named rather than waited on.
    """
    S, m, R = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    slots = S * m
    flow = schedule.dataflow
    owners = flow.owners
    gradients = flow.gradients  # a slot's gradient sits at ``gradients + slot``
    if timing is None:
        zeros = [0.0] * slots
        dur_f = dur_b = dur_w = dur_bw = zeros
        pair_time: Callable[[int, int], float] = lambda _f, _b: 0.0  # noqa: E731
    else:
        dur_f, dur_b, dur_w, dur_bw = (
            timing.forward,
            timing.backward,
            timing.weight,
            timing.full_backward,
        )
        pair_time = timing.pair
    cache_pairs = timing is None or not timing.pairs_vary
    # what each op waits for, indexed by ``code % width``: see ``Dataflow.inputs``
    inputs = flow.inputs(timing.latency if timing is not None else 0.0)
    width = len(inputs)
    span = slots << KIND_BITS

    made: list[float | None] = [None] * (2 * slots)  # when each activation, then gradient, is ready
    waiter = [-1] * (2 * slots)  # the rank blocked on each value
    split = bytearray(slots)  # slot ran B (its W is still due or done)
    w_done = bytearray(slots)  # slot's weight gradient is done (W or BW)

    codes = schedule.codes
    pointer = [0] * R
    clock = [0.0] * R if release is None else [float(t) for t in release]
    if len(clock) != R:
        raise ValueError(f"walk's release lists {len(clock)} times for {R} ranks")
    starts = tuple([0.0] * len(ops) for ops in codes)
    ends = tuple([0.0] * len(ops) for ops in codes)
    runnable = [r for r in reversed(range(R)) if codes[r]]
    pair_cache: dict[int, float] = {}  # pair durations by (forward, backward) codes % width

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
                if kind == W_CODE:
                    if not split[slot] or w_done[slot]:
                        raise _weight_error(schedule, r, code, bool(w_done[slot]))
                    start_list[p] = t
                    t += dur_w[slot]
                    w_done[slot] = 1
                else:
                    step, delay = inputs[code % width]
                    if step is not None:  # wait for the value it reads
                        ready = made[slot + step]
                        if ready is None:
                            if kind != F_CODE and made[slot] is None:  # named before it waits
                                raise _order_error(schedule, r, code, slot << KIND_BITS)
                            waiter[slot + step] = r
                            break
                        ready += delay
                        if ready > t:
                            t = ready
                    if kind == F_CODE:
                        if made[slot] is not None:
                            raise _duplicate_error(schedule, r, code)
                        start_list[p] = t
                        t += dur_f[slot]
                        made[slot] = t
                        if waiter[slot] >= 0:
                            runnable.append(waiter[slot])
                    else:
                        if made[slot] is None:
                            raise _order_error(schedule, r, code, slot << KIND_BITS)
                        gradient = gradients + slot
                        if made[gradient] is not None:
                            raise _duplicate_error(schedule, r, code)
                        start_list[p] = t
                        if kind == BW_CODE:
                            t += dur_bw[slot]
                            w_done[slot] = 1
                        else:
                            t += dur_b[slot]
                            split[slot] = 1
                        made[gradient] = t
                        if waiter[gradient] >= 0:
                            runnable.append(waiter[gradient])
            else:
                forward, backward = divmod(-1 - code, span)
                f_slot, b_slot = forward >> KIND_BITS, backward >> KIND_BITS
                if forward & KIND_MASK != F_CODE or backward & KIND_MASK not in (B_CODE, BW_CODE):
                    raise _pair_shape_error(schedule, r, code)
                if owners[f_slot] != r:
                    raise _wrong_rank_error(schedule, r, forward, owners[f_slot])
                if owners[b_slot] != r:
                    raise _wrong_rank_error(schedule, r, backward, owners[b_slot])
                if made[b_slot] is None:
                    raise _order_error(schedule, r, backward, b_slot << KIND_BITS)
                # the pair starts when the inputs of both halves are there
                f_at, b_at = forward % width, backward % width
                f_step, f_delay = inputs[f_at]
                b_step, b_delay = inputs[b_at]
                f_ready = t if f_step is None else made[f_slot + f_step]
                b_ready = t if b_step is None else made[b_slot + b_step]
                if f_ready is None or b_ready is None:
                    waiter[f_slot + f_step if f_ready is None else b_slot + b_step] = r
                    break
                f_ready += f_delay
                b_ready += b_delay
                begin = f_ready if f_ready > t else t
                if b_ready > begin:
                    begin = b_ready
                b_gradient = gradients + b_slot
                if made[f_slot] is not None:
                    raise _duplicate_error(schedule, r, forward)
                if made[b_gradient] is not None:
                    raise _duplicate_error(schedule, r, backward)
                key = f_at * width + b_at  # the stages and the backward's kind, at least
                duration = pair_cache.get(key) if cache_pairs else None
                if duration is None:
                    duration = pair_cache[key] = pair_time(forward, backward)
                start_list[p] = begin
                t = begin + duration
                made[f_slot] = made[b_gradient] = t
                if backward & KIND_MASK == BW_CODE:
                    w_done[b_slot] = 1
                else:
                    split[b_slot] = 1
                if waiter[f_slot] >= 0:
                    runnable.append(waiter[f_slot])
                if waiter[b_gradient] >= 0:
                    runnable.append(waiter[b_gradient])
            end_list[p] = t
            p += 1
        pointer[r], clock[r] = p, t

    if any(pointer[r] < len(codes[r]) for r in range(R)):
        raise _stall_error(schedule, pointer)
    if None in made or 0 in w_done:
        raise _missing_error(schedule, made, w_done, owners)
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


def _key_text(key: Key) -> str:
    what, stage, microbatch = key
    if what == ACTIVATION:
        return str(Action(Kind.F, stage, microbatch))
    return f"{Action(Kind.B, stage, microbatch)}/{Action(Kind.BW, stage, microbatch)}"


def _stall_error(schedule: Schedule, pointer: list[int]) -> ScheduleError:
    """No rank can move: explain each waiting rank, naming missing ops, self-waits or a cycle."""
    flow = schedule.dataflow
    produced: set[Key] = set()
    position: dict[Key, tuple[int, int]] = {}
    for r, ops in enumerate(schedule.codes):
        for p, code in enumerate(ops):
            for half in _halves(schedule, code):
                key = flow.makes(half)
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
            need = flow.awaits(half)
            if need is None or need in produced:
                continue
            action, need_text = _show(schedule, half), _key_text(need)
            producer = flow.producer(need)
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
    schedule: Schedule, made: list[float | None], w_done: bytearray, owners: list[int]
) -> ScheduleError:
    S, gradients = schedule.num_stages, schedule.dataflow.gradients
    for slot in range(len(w_done)):
        microbatch, stage = divmod(slot, S)
        owner = owners[slot]
        if made[slot] is None:
            missing = Action(Kind.F, stage, microbatch)
        elif made[gradients + slot] is None:
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
