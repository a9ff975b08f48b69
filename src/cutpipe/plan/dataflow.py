"""What an op waits for and what it makes, as keys the list schedulers share.

A key is ``(F_CODE, stage, microbatch)`` for a forward's output or ``(B_CODE, stage,
microbatch)`` for the input gradient a backward (B or BW) passes down. Same-rank inputs count
too (a W waits for its own B, the last stage's backward for its own forward), so a scheduler
that reorders a rank's ops cannot run one before its input.
"""

from __future__ import annotations

from cutpipe.schedule.codes import B_CODE, F_CODE, KIND_BITS, KIND_MASK, W_CODE

Key = tuple[int, int, int]


def awaited(code: int, num_stages: int) -> Key | None:
    """The key a single (non-pair) op waits for; None for a first-stage forward."""
    microbatch, stage = divmod(code >> KIND_BITS, num_stages)
    kind = code & KIND_MASK
    if kind == F_CODE:
        return (F_CODE, stage - 1, microbatch) if stage > 0 else None
    if kind == W_CODE:
        return (B_CODE, stage, microbatch)
    if stage < num_stages - 1:
        return (B_CODE, stage + 1, microbatch)
    return (F_CODE, stage, microbatch)  # the loss: its own forward


def produced(code: int, num_stages: int) -> Key | None:
    """The key a single op makes; None for a W, which nothing waits on."""
    microbatch, stage = divmod(code >> KIND_BITS, num_stages)
    kind = code & KIND_MASK
    if kind == W_CODE:
        return None
    return (F_CODE if kind == F_CODE else B_CODE, stage, microbatch)


def consumer_stage(key: Key, num_stages: int) -> int:
    """The stage whose op waits on ``key`` across stages (a W waits on its own stage's B)."""
    kind, stage, _ = key
    if kind == F_CODE:
        return stage + 1 if stage < num_stages - 1 else stage
    return stage - 1 if stage > 0 else stage
