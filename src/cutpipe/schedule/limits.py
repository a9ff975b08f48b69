"""How large a schedule cutpipe builds, checked before a single op is allocated.

A schedule holds at most (stages x microbatches x kinds) ops: every stage runs an F, a B and,
when the backward is split, a W for every microbatch. Building, simulating and measuring one
op takes a few microseconds and a few hundred bytes, so at ``MAX_OPS`` a schedule is generated,
simulated and summarised in a few seconds and well under 1 GB. Above it the work is refused
with what to change, instead of running for minutes or exhausting memory (two ranks and a
billion microbatches would need hundreds of GB). The largest benchmark, R = 64 and m = 1024,
builds at most 393,216 ops per schedule.
"""

from __future__ import annotations

#: The most ops one schedule may hold (see docs/cli.md, "Limits").
MAX_OPS = 1_000_000
#: Bytes an op may take in a schedule file: cutpipe writes one in at most 12 (``"10F45453", ``:
#: the digits of stage and microbatch together stay within 7 under ``MAX_OPS``; the largest
#: schedules write 11.8 MB), and one more leaves room for line breaks and hand edits.
FILE_BYTES_PER_OP = 13
#: The largest schedule file read: a larger one holds more than ``MAX_OPS`` ops, so it is
#: refused by its size before a byte of it is read (parsing it would take seconds and memory).
MAX_FILE_BYTES = MAX_OPS * FILE_BYTES_PER_OP


def check_ops(count: int, limit: int = MAX_OPS) -> None:
    """A ValueError if a schedule read from a file holds more than ``limit`` ops."""
    if count > limit:
        raise ValueError(
            f"the schedule holds {count:,} ops, more than the limit of {limit:,} "
            "(cutpipe.schedule.MAX_OPS): use fewer microbatches or ranks"
        )


def estimated_ops(stages: int, microbatches: int, kinds: int = 3, steps: int = 1) -> int:
    """An upper bound on a schedule's ops (and its generator's work): every stage runs
    ``kinds`` ops per microbatch step, and a generator walks at least ``steps`` of them (ZB-V
    walks 2R-1 even for fewer microbatches)."""
    return stages * max(microbatches, steps) * kinds


def check_size(
    name: str, ranks: int, stages: int, microbatches: int, kinds: int = 3, steps: int = 1,
    limit: int = MAX_OPS, per_rank: str = "",
) -> None:  # fmt: skip
    """A ValueError naming the limit and what to change if the schedule would be too large.

    ``per_rank``: the parameter that sets the stages per rank (``"chunks"``), if one does: the
    message then offers fewer of those too.
    """
    ops = estimated_ops(stages, microbatches, kinds, steps)
    if ops <= limit:
        return
    most = limit // (stages * kinds)
    if most >= max(1, steps):
        change = f"use at most {most:,} microbatches on {ranks:,} ranks"
        if per_rank:
            change += f" with {stages // ranks:,} {per_rank}, or fewer {per_rank}"
    else:
        change = f"use fewer ranks{f' or {per_rank}' if per_rank else ''}"
    walked = max(microbatches, steps)
    raise ValueError(
        f"{name} on {ranks:,} ranks with {microbatches:,} microbatches would hold about {ops:,} "
        f"ops ({stages:,} stages x {walked:,} microbatch steps x {kinds} kinds), more than "
        f"the limit of {limit:,}: {change}"
    )
