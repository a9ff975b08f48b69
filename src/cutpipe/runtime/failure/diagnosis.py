"""Who is everybody waiting for? Following the wait chain from a stalled rank to its cause.

Every rank waits either for one peer (a boundary value, a send to complete) or for a collective
of the whole group. From a rank that has made no progress, follow "waits for" until a rank that
waits for nobody: that rank is computing an op that does not return, or it is not in a step at
all. A collective is waited for by the ranks that are not yet in it. The chain can also close on
itself (ranks waiting for each other), which a validated schedule never does but a rank running
something else can.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cutpipe.runtime.failure.heartbeat import Beat


@dataclass(frozen=True)
class Stall:
    """The rank a stall comes down to, and the whole story in one line."""

    root: int
    message: str


def _waits(rank: int, beat: Beat) -> str:
    return f"rank {rank} waits for {beat.waiting_for} in step {beat.step} at {beat.op}"


def _in_collective(beat: Beat, what: str, step: int) -> bool:
    return (
        beat.state == "step"
        and beat.waiting_peer is None
        and beat.waiting_for == what
        and beat.step == step
    )


def _next(rank: int, beats: Mapping[int, Beat]) -> int | None:
    """Whom ``rank`` waits for (None: nobody, or everybody is in the collective with it)."""
    beat = beats[rank]
    if beat.waiting_peer is not None:
        return beat.waiting_peer
    if beat.waiting_for is None:
        return None
    outside = [
        r
        for r, other in beats.items()
        if r != rank and not _in_collective(other, beat.waiting_for, beat.step)
    ]
    if not outside:
        return None
    # a rank that is not in a step at all explains more than one that is merely slow
    return max(outside, key=lambda r: (beats[r].state != "step", beats[r].stalled, -r))


def find_stall(start: int, beats: Mapping[int, Beat], timeout: float) -> Stall | None:
    """The cause of ``start``'s stall, or None when the chain ends at a rank still making
    progress (``start`` is only waiting its turn, as rank 0 does through the cool-down)."""
    path = [start]
    rank = start
    while True:
        beat = beats.get(rank)
        if beat is None:
            return Stall(rank, f"rank {rank} has never sent a heartbeat{_chain(path, beats)}")
        if beat.state != "step":
            return Stall(
                rank, f"rank {rank} is not in a step: it is {beat.where}{_chain(path, beats)}"
            )
        following = _next(rank, beats)
        if following is None:
            if beat.stalled < timeout:
                return None
            if beat.waiting_for is not None:
                return Stall(
                    rank,
                    f"every rank has waited {beat.stalled:.0f} s for {beat.waiting_for} and it "
                    "does not complete (the transport is broken)",
                )
            what = f"it is running {beat.op} of step {beat.step}, which has not returned"
            return Stall(
                rank,
                f"rank {rank} made no progress for {beat.stalled:.0f} s: {what}{_chain(path, beats)}",
            )
        if following in path:
            cycle = path[path.index(following) :]
            story = "; ".join(_waits(r, beats[r]) for r in cycle)
            return Stall(
                following, f"ranks {', '.join(map(str, cycle))} wait for each other: {story}"
            )
        path.append(following)
        rank = following


def _chain(path: list[int], beats: Mapping[int, Beat]) -> str:
    """ "; rank 0 waits for ... , rank 1 waits for ..." for the ranks before the root."""
    waiting = path[:-1]
    if not waiting:
        return ""
    return "; " + "; ".join(_waits(r, beats[r]) for r in waiting)
