"""The schedules cutpipe knows by name, with what each needs and stores."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cutpipe.schedule.generators import (
    dualpipe,
    dualpipev,
    gpipe,
    interleaved,
    one_f_one_b,
    zb_h1,
    zb_h2,
    zbv,
)
from cutpipe.schedule.limits import MAX_OPS, estimated_ops
from cutpipe.schedule.schedule import Schedule


@dataclass(frozen=True)
class ScheduleInfo:
    """A named generator and the facts a user picks it by."""

    name: str
    title: str
    generate: Callable[[int, int], Schedule]
    placement: str
    valid: str  # the valid (ranks, microbatches) range, in words
    min_microbatches: Callable[[int], int] = lambda ranks: 1
    even_ranks: bool = False
    stages_per_rank: int = 1
    kinds: int = 3  # ops per stage and microbatch at most: F, B and W (2 with a full backward)
    steps: Callable[[int], int] = lambda ranks: 1  # microbatch steps the generator walks at least

    def accepts(self, num_ranks: int, num_microbatches: int) -> bool:
        """Whether ``generate`` builds this schedule for that many ranks and microbatches."""
        if num_ranks < 1 or (self.even_ranks and num_ranks % 2):
            return False
        if self.ops_bound(num_ranks, num_microbatches) > MAX_OPS:
            return False
        return num_microbatches >= self.min_microbatches(num_ranks)

    def ops_bound(self, num_ranks: int, num_microbatches: int) -> int:
        """At most how many ops the schedule holds (what ``MAX_OPS`` is checked against)."""
        return estimated_ops(
            num_ranks * self.stages_per_rank, num_microbatches, self.kinds, self.steps(num_ranks)
        )


ANY = "ranks >= 1, microbatches >= 1"

SCHEDULES: dict[str, ScheduleInfo] = {
    info.name: info
    for info in (
        ScheduleInfo("gpipe", "GPipe", gpipe, "linear", ANY, kinds=2),
        ScheduleInfo("1f1b", "1F1B", one_f_one_b, "linear", ANY, kinds=2),
        ScheduleInfo(
            "interleaved",
            "Interleaved 1F1B",
            interleaved,
            "interleaved",
            ANY,
            stages_per_rank=2,
            kinds=2,
        ),
        ScheduleInfo("zbh1", "ZB-H1", zb_h1, "linear", ANY),
        ScheduleInfo("zbh2", "ZB-H2", zb_h2, "linear", ANY),
        ScheduleInfo("zbv", "ZB-V", zbv, "v", ANY, stages_per_rank=2, steps=lambda r: 2 * r - 1),
        ScheduleInfo(
            "dualpipe",
            "DualPipe",
            dualpipe,
            "bidirectional",
            "even ranks >= 2, microbatches >= 2R-2 (odd counts: >= 2R-3), and >= 2",
            min_microbatches=lambda r: max(2, 2 * r - 3),
            even_ranks=True,
        ),
        ScheduleInfo(
            "dualpipev",
            "Cut-in-half",
            dualpipev,
            "v",
            "ranks >= 1, microbatches >= 2R-1",
            min_microbatches=lambda r: 2 * r - 1,
            stages_per_rank=2,
        ),
    )
}


def schedule_info(name: str) -> ScheduleInfo:
    """Look a schedule up by name; unknown names list the known ones."""
    if not isinstance(name, str):
        raise TypeError(
            f"the schedule name must be a str (one of {', '.join(SCHEDULES)}), got {name!r}"
        )
    try:
        return SCHEDULES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}"
        ) from None


def generate(name: str, num_ranks: int, num_microbatches: int) -> Schedule:
    """Build the named schedule for ``num_ranks`` ranks and ``num_microbatches`` microbatches.

    Refuses schedules of more than ``cutpipe.schedule.limits.MAX_OPS`` ops before building them.
    """
    return schedule_info(name).generate(num_ranks, num_microbatches)
