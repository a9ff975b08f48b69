"""Argument checks shared by the generators: each failure names the rule that was broken."""

from __future__ import annotations

from collections.abc import Callable

from cutpipe.records import check_count
from cutpipe.schedule.limits import check_size
from cutpipe.schedule.params import CHUNKS


def check_counts(
    name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1, kinds: int = 3,
    steps: Callable[[int], int] | None = None,
) -> None:  # fmt: skip
    """Ranks and microbatches are ints >= 1, and the schedule is not too large to build.

    ``stages_per_rank``, ``kinds`` (ops per stage and microbatch) and ``steps`` (the microbatch
    steps the generator walks at least, given the ranks) bound the schedule's size and the
    generator's work, checked before anything is allocated (``cutpipe.schedule.limits``).
    """
    check_count(num_ranks, f"{name}: ranks")
    check_count(num_microbatches, f"{name}: microbatches")
    walked = 1 if steps is None else steps(num_ranks)
    check_size(name, num_ranks, num_ranks * stages_per_rank, num_microbatches, kinds, walked)


def check_chunked_counts(
    name: str, num_ranks: int, num_microbatches: int, chunks: int, kinds: int = 3
) -> None:
    """``check_counts`` for a schedule with ``chunks`` stages on every rank, chunks checked first.

    Chunks multiply the stages, so the size limit counts them, and a schedule too large even
    for one microbatch says to use fewer ranks or chunks.
    """
    CHUNKS.check(name, chunks)
    check_counts(name, num_ranks, num_microbatches, kinds=kinds)
    stages = num_ranks * chunks
    check_size(name, num_ranks, stages, num_microbatches, kinds, per_rank="chunks")


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
