"""Several training steps back to back: what a step costs once steps follow each other.

One step's makespan assumes every rank waits for the slowest before the next step; the span
measure of the zero-bubble papers assumes the next step's warm-up overlaps this step's tail.
Which one holds depends on the step boundary, so both are simulated here:

- ``"sync"``: at the end of each step every rank waits until every rank has run its last op and
  the gradient all-reduce (``reduction``) is done, then runs its optimizer step (``optimizer``),
  then starts the next step.
- ``"overlap"``: a rank runs its optimizer step as soon as its own last op ends and then starts
  the next step; ranks wait for each other only through the schedule's own data flow (step k+1's
  ops wait for step k+1's inputs). The global check of step k (the all-reduce of its gradient
  norm, say: post-validation) must arrive before a rank's step k+1 is over: a rank whose last op
  of step k+1 ends before every rank's step k ended plus ``reduction`` waits for it before its
  optimizer step. That binds only when the reduction is about as long as a whole step (the
  steps then pair up: period 2, see below).

Each step is one walk of the schedule (``cutpipe.schedule.validate.walk``, the rule every other
part of cutpipe uses) with each rank released when its previous step and optimizer are done.

The *steady state* is the time per step once the steps repeat exactly. After each step the
state is, per rank, when it may start its optimizer step, and when the step's last op (on any
rank) ended;
the next step depends on nothing else and is the same walk. So once the state after step
``s + p`` is the state after step ``s`` shifted by one amount ``D`` on every rank, every later
step repeats too, and ``D / p`` is the time per step for ever after (``period = p``, which is 1
unless a long reduction makes the steps pair up; ``settled`` is the first step of the repeating
run). The steps are simulated past the ones asked for until that happens (at most
``SETTLE_LIMIT``), so the steady state is exact, not an average that mixes in the first steps'
transient, and does not depend on how many steps are asked for. A step's time runs from the previous step's end to when
its last rank finishes its optimizer step; the first step's starts at 0.

With ``sync`` the steps repeat from the first: steady state = makespan + reduction + optimizer.
With ``overlap`` the steady state is at most the longest per-rank span + optimizer when the
reduction is 0 (the previous step's timeline shifted by that much is a valid next step, and the
simulation starts each op as early as it can). It equals it for every single-direction schedule
(1F1B, GPipe, interleaved, Looped BFS, interleaved ZB, ZB-H1, ZB-H2, ZB-V, DualPipeV; checked
in tests/test_sim_steps.py under random costs with communication and overlapped pairs): one rank
starts the step, and the rank with the longest span waits, from its first op to its last, only
for work that its own first op leads to, so the next step cannot start it earlier. DualPipe
starts two directions at once, on rank 0 and on rank R-1. With an even microbatch count they
mirror each other and the same holds; with an odd count (the directions carry one microbatch
apart) and communication or unequal costs, the lone step's longest span includes a wait at its
start for the other direction's first activation, which in back-to-back steps was sent earlier
(that direction's first rank finished its shorter step first): the steady state is then shorter
than the span (R = 2, m = 3, comm = 0.5: 13 per step against a span of 13.5).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass, field

from cutpipe.schedule.schedule import Schedule
from cutpipe.schedule.validate import Timing, walk
from cutpipe.sim.costs import MAX_COST, Costs
from cutpipe.sim.timeline import Timeline

BOUNDARIES = ("sync", "overlap")
#: What each boundary means, for error messages and help texts.
BOUNDARY_HELP = {
    "sync": "every rank waits for all ranks and the all-reduce, then steps its optimizer",
    "overlap": "each rank steps its optimizer when its own last op ends and goes on",
}
#: The most ops all simulated steps together may hold (K steps x the schedule's ops): the
#: timelines of 4 million ops take a few seconds and about 300 MB.
MAX_STEP_OPS = 4_000_000
#: The most steps simulated to find where the steps start repeating (none here needs more
#: than two); past it the steady state is the mean of the later half of the steps' times.
SETTLE_LIMIT = 64


@dataclass(frozen=True)
class MultiStep:
    """``len(steps)`` steps of one schedule on one clock, and what a step costs.

    Attributes:
        steps: one timeline per step, all on one clock (step k+1's ops start after step k's).
        ready: per step, per rank, when the rank may start its optimizer step: its last op's
            end (``overlap``, or later if the previous step's check has not arrived), or every
            rank's last op's end plus the reduction (``sync``).
        per_step: each step's time: from the previous step's end (0 for the first) to when
            its last rank finishes its optimizer step.
        steady: the time per step once the steps repeat (see the module); exact unless
            ``settled`` is None.
        settled, period: from step ``settled`` (0-based) on, every ``period`` steps take
            ``period * steady``; None if the steps did not repeat within ``SETTLE_LIMIT`` steps
            (``steady`` is then the mean of the later half of those steps' times).
        makespan, span: of one step alone (``metrics(simulate(...))``: the makespan and the
            longest per-rank span).
    """

    schedule: Schedule
    boundary: str
    optimizer: float
    reduction: float
    steps: tuple[Timeline, ...] = field(repr=False)
    ready: tuple[tuple[float, ...], ...] = field(repr=False)
    per_step: tuple[float, ...]
    steady: float
    settled: int | None
    period: int | None
    makespan: float
    span: float

    @property
    def count(self) -> int:
        return len(self.steps)

    @property
    def finish(self) -> float:
        """When the last rank finishes the last step's optimizer step."""
        return max(self.ready[-1]) + self.optimizer

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule.name,
            "boundary": self.boundary,
            "steps": self.count,
            "optimizer": self.optimizer,
            "reduction": self.reduction,
            "steady": self.steady,
            "settled": self.settled,
            "period": self.period,
            "per_step": list(self.per_step),
            "makespan": self.makespan,
            "span": self.span,
        }


def simulate_steps(
    schedule: Schedule,
    costs: Costs | None = None,
    *,
    steps: int,
    boundary: str = "sync",
    optimizer: float = 0.0,
    reduction: float = 0.0,
) -> MultiStep:
    """Simulate ``steps`` steps of ``schedule`` back to back under ``costs`` (default F=B=W=1).

    ``optimizer`` is one optimizer step's time on a rank, ``reduction`` the gradient
    all-reduce's, in the costs' units; ``boundary`` is ``"sync"`` or ``"overlap"`` (the module
    says what each means and how the steady state is found).
    """
    _check(schedule, costs, steps, boundary, optimizer, reduction)
    costs = costs or Costs()
    timing = costs.timing(schedule)
    optimizer, reduction = float(optimizer), float(reduction)
    timelines: list[Timeline] = []
    ready: list[tuple[float, ...]] = []
    states: list[tuple[float, ...]] = []
    found: tuple[int, int, float] | None = None
    for index, (timeline, rank_ready, last) in enumerate(
        _run(schedule, timing, boundary, optimizer, reduction)
    ):
        if index < steps:
            timelines.append(timeline)
        ready.append(rank_ready)
        states.append((*rank_ready, last))
        if found is None:
            found = _repeat(states)
        if index + 1 >= steps and (found is not None or index + 1 >= SETTLE_LIMIT):
            break
    ends = [max(each) + optimizer for each in ready]
    times = [b - a for a, b in zip([0.0, *ends], ends, strict=False)]
    if found is not None:
        state, period, shift = found
        steady = shift / period
        settled = state + 1  # the steps after a repeating state repeat; maybe earlier ones too
        while settled > 0 and _close(times[settled - 1], times[settled - 1 + period]):
            settled -= 1
    else:
        settled = period = None
        later = times[len(times) // 2 :]
        steady = sum(later) / len(later)
    first = timelines[0]
    return MultiStep(
        schedule=schedule,
        boundary=boundary,
        optimizer=optimizer,
        reduction=reduction,
        steps=tuple(timelines),
        ready=tuple(ready[:steps]),
        per_step=tuple(times[:steps]),
        steady=steady,
        settled=settled,
        period=period,
        makespan=first.makespan,
        span=max(first.span(r) for r in range(first.num_ranks)),
    )


def _run(
    schedule: Schedule, timing: Timing, boundary: str, optimizer: float, reduction: float
) -> Iterator[tuple[Timeline, tuple[float, ...], float]]:
    """Step after step: its timeline, when each rank may start its optimizer step, and when
    the step's last op ended."""
    R = schedule.num_ranks
    release = [0.0] * R
    previous = -math.inf  # when the previous step's last op ended (none before the first)
    while True:
        result = walk(schedule, timing, release)
        last = [ends[-1] if ends else release[r] for r, ends in enumerate(result.ends)]
        finished = max(last)
        if boundary == "sync":
            ready = (finished + reduction,) * R
        else:  # the previous step's check must have arrived before this step is over
            check = previous + reduction
            ready = tuple(t if t >= check else check for t in last)
        yield Timeline(schedule, result.starts, result.ends), ready, finished
        release = [t + optimizer for t in ready]
        previous = finished


def _repeat(states: list[tuple[float, ...]]) -> tuple[int, int, float] | None:
    """(that earlier step, period, shift) if the state after the newest step is an earlier
    step's shifted alike on every rank (to rounding), else None."""
    newest = states[-1]
    scale = max(1.0, *map(abs, newest))
    for period in range(1, len(states)):
        earlier = states[-1 - period]
        shifts = [a - b for a, b in zip(newest, earlier, strict=True)]
        if max(shifts) - min(shifts) <= 1e-9 * scale:  # one shift for all, to rounding
            return len(states) - 1 - period, period, sum(shifts) / len(shifts)
    return None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def _check(
    schedule: object,
    costs: object,
    steps: object,
    boundary: object,
    optimizer: object,
    reduction: object,
) -> None:
    """A TypeError or ValueError that says what to change, before any work."""
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"simulate_steps takes a Schedule (e.g. generate('zbv', 4, 8)), got {schedule!r}"
        )
    if costs is not None and not isinstance(costs, Costs):
        raise TypeError(f"simulate_steps' costs must be a Costs or None, got {costs!r}")
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"steps must be a whole number >= 1, got {steps!r}")
    if steps < 1:
        raise ValueError(
            f"steps must be at least 1 (how many steps to run back to back), got {steps}"
        )
    if steps * schedule.num_ops > MAX_STEP_OPS:
        most = max(1, MAX_STEP_OPS // max(1, schedule.num_ops))
        raise ValueError(
            f"{steps} steps of {schedule.num_ops:,} ops are over the limit of {MAX_STEP_OPS:,} "
            f"simulated ops: simulate at most {most} steps of this schedule (the steady state "
            "does not depend on how many), or fewer ranks or microbatches"
        )
    if boundary not in BOUNDARIES:
        choices = "; ".join(f"{name!r}: {text}" for name, text in BOUNDARY_HELP.items())
        raise ValueError(
            f"boundary must be one of {', '.join(map(repr, BOUNDARIES))} ({choices}), got {boundary!r}"
        )
    for name, value in (("optimizer", optimizer), ("reduction", reduction)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number (a time in the costs' units), got {value!r}")
        if not math.isfinite(value) or not 0 <= value <= MAX_COST:
            raise ValueError(
                f"{name} must be a time between 0 and {MAX_COST:g} in the costs' units (0 for "
                f"none), got {value!r}"
            )
