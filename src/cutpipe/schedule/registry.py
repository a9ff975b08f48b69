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
    valid: str


SCHEDULES: dict[str, ScheduleInfo] = {
    info.name: info
    for info in (
        ScheduleInfo("gpipe", "GPipe", gpipe, "linear", "ranks >= 1, microbatches >= 1"),
        ScheduleInfo("1f1b", "1F1B", one_f_one_b, "linear", "ranks >= 1, microbatches >= 1"),
        ScheduleInfo(
            "interleaved",
            "Interleaved 1F1B",
            interleaved,
            "interleaved",
            "ranks >= 1, microbatches >= 1",
        ),
        ScheduleInfo("zbh1", "ZB-H1", zb_h1, "linear", "ranks >= 1, microbatches >= 1"),
        ScheduleInfo("zbh2", "ZB-H2", zb_h2, "linear", "ranks >= 1, microbatches >= 1"),
        ScheduleInfo("zbv", "ZB-V", zbv, "v", "ranks >= 1, microbatches >= 1"),
        ScheduleInfo(
            "dualpipe",
            "DualPipe",
            dualpipe,
            "bidirectional",
            "even ranks >= 2, microbatches >= 2R-2 (odd: >= 2R-3)",
        ),
        ScheduleInfo(
            "dualpipev",
            "Cut-in-half",
            dualpipev,
            "v",
            "ranks >= 1, microbatches >= 2R-1",
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
