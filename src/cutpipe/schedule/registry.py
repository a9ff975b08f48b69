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

    def accepts(self, num_ranks: int, num_microbatches: int) -> bool:
        """Whether ``generate`` builds this schedule for that many ranks and microbatches."""
        if num_ranks < 1 or (self.even_ranks and num_ranks % 2):
            return False
        return num_microbatches >= self.min_microbatches(num_ranks)


ANY = "ranks >= 1, microbatches >= 1"

SCHEDULES: dict[str, ScheduleInfo] = {
    info.name: info
    for info in (
        ScheduleInfo("gpipe", "GPipe", gpipe, "linear", ANY),
        ScheduleInfo("1f1b", "1F1B", one_f_one_b, "linear", ANY),
        ScheduleInfo("interleaved", "Interleaved 1F1B", interleaved, "interleaved", ANY),
        ScheduleInfo("zbh1", "ZB-H1", zb_h1, "linear", ANY),
        ScheduleInfo("zbh2", "ZB-H2", zb_h2, "linear", ANY),
        ScheduleInfo("zbv", "ZB-V", zbv, "v", ANY),
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
        ),
    )
}


def schedule_info(name: str) -> ScheduleInfo:
    """Look a schedule up by name; unknown names list the known ones."""
    try:
        return SCHEDULES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}"
        ) from None


def generate(name: str, num_ranks: int, num_microbatches: int) -> Schedule:
    """Build the named schedule for ``num_ranks`` ranks and ``num_microbatches`` microbatches."""
    return schedule_info(name).generate(num_ranks, num_microbatches)
