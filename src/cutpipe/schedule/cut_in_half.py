"""Cut-in-half: derive the V-shape schedule from a bidirectional (DualPipe) one.

DualPipe on 2R ranks runs two pipes over 2R stages: pipe 0 puts stage s on rank s, pipe 1 on rank
2R-1-s. Keep only ranks 0..R-1. There, pipe 0 runs stages 0..R-1 going down and pipe 1 runs
stages R..2R-1 coming back up: exactly the two legs of a V, where rank r holds stage r and stage
2R-1-r. Joining pipe 0's microbatch i with pipe 1's microbatch i into one microbatch of the V
gives a schedule with half the devices, parameters stored once, and the same per-rank op order.
"""

from __future__ import annotations

from cutpipe.schedule.actions import Action, Op, Overlap
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule
from cutpipe.schedule.validate import validate


def cut_in_half(schedule: Schedule) -> Schedule:
    """The V-shape schedule on the first half of a bidirectional schedule's ranks.

    ``cut_in_half(dualpipe(2 * R, 2 * m)) == dualpipev(R, m)``, op for op.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"cut_in_half takes a Schedule (e.g. generate('dualpipe', 8, 16)), got {schedule!r}"
        )
    placement = schedule.placement
    ranks = placement.num_ranks
    if ranks % 2 or placement != Placement.bidirectional(ranks):
        raise ValueError(
            f"cut_in_half needs a bidirectional (DualPipe) schedule, got {schedule.name!r} on a "
            f"{placement.kind} placement"
        )
    down = placement.microbatches_of(0, schedule.num_microbatches)
    up = placement.microbatches_of(1, schedule.num_microbatches)
    if len(down) != len(up):
        raise ValueError(
            f"cut_in_half needs as many microbatches in each direction; {schedule.name!r} has "
            f"{schedule.num_microbatches} in all ({len(down)} down, {len(up)} up): use an even count"
        )
    offset = up.start  # pipe 1's microbatch up.start + j becomes the V's microbatch j

    def fold(action: Action) -> Action:
        microbatch = action.microbatch
        if microbatch >= offset:
            microbatch -= offset
        return Action(action.kind, action.stage, microbatch)

    def fold_op(op: Op) -> Op:
        if type(op) is Overlap:
            return Overlap(fold(op.forward), fold(op.backward))
        return fold(op)

    half = ranks // 2
    folded = Schedule.from_actions(
        "dualpipev",
        Placement.vshape(half),
        len(down),
        [[fold_op(op) for op in schedule.actions[r]] for r in range(half)],
    )
    validate(folded)
    return folded
