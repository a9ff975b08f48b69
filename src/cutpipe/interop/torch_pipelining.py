"""Exchange schedules with ``torch.distributed.pipelining`` (its private action IR).

``to_torch_actions`` exports a cutpipe schedule as torch's per-rank ``_Action`` lists, ready for
torch's ``_validate_schedule`` and ``_add_send_recv``; ``from_torch_actions`` imports torch's
``pipeline_order`` so that cutpipe can validate and simulate torch's own schedules. Torch is
imported only when these functions run.

Torch places every stage on exactly one rank, so DualPipe (every stage on two ranks) has no torch
form; ``expressible`` says which schedules do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cutpipe.schedule.actions import Action, Kind, Op, Overlap
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule


def expressible(schedule: Schedule) -> bool:
    """Whether torch's IR can hold this schedule (one rank per stage)."""
    return schedule.placement.num_pipes == 1


def stage_to_rank(schedule: Schedule) -> Callable[[int], int]:
    """Torch's ``stage_to_rank`` callable for a single-pipe schedule."""
    ranks = schedule.placement.pipes[0]
    return ranks.__getitem__


def _torch_types() -> dict[Kind, Any]:
    from torch.distributed.pipelining import schedules

    C = schedules._ComputationType
    return {
        Kind.F: C.FORWARD,
        Kind.B: C.BACKWARD_INPUT,
        Kind.W: C.BACKWARD_WEIGHT,
        Kind.BW: C.FULL_BACKWARD,
        Kind.FB: C.OVERLAP_F_B,
    }


def to_torch_actions(schedule: Schedule) -> dict[int, list[Any]]:
    """Per-rank lists of torch ``_Action`` objects; overlapped pairs become OVERLAP_F_B."""
    if not expressible(schedule):
        raise ValueError(
            f"{schedule.name!r} puts stages on two ranks ({schedule.placement.kind} placement); "
            "torch.distributed.pipelining maps every stage to one rank and cannot express it"
        )
    from torch.distributed.pipelining.schedules import _Action

    types = _torch_types()

    def single(action: Action) -> Any:
        return _Action(action.stage, types[action.kind], action.microbatch)

    def convert(op: Op) -> Any:
        if type(op) is Overlap:
            return _Action(-1, types[Kind.FB], None, (single(op.forward), single(op.backward)))
        return single(op)

    return {rank: [convert(op) for op in ops] for rank, ops in enumerate(schedule.actions)}


def from_torch_actions(
    name: str,
    placement: Placement,
    num_microbatches: int,
    order: Mapping[int, Iterable[Any]],
) -> Schedule:
    """A cutpipe schedule from torch's ``pipeline_order``; ``None`` slots and non-compute actions
    (sends, receives, REDUCE_GRAD, UNSHARD) are dropped, since cutpipe derives communication."""
    kinds = {ctype: kind for kind, ctype in _torch_types().items()}

    def single(action: Any) -> Action:
        return Action(kinds[action.computation_type], action.stage_index, action.microbatch_index)

    ranks = []
    for rank in range(placement.num_ranks):
        ops: list[Op] = []
        for action in order.get(rank, ()):
            if action is None or action.computation_type not in kinds:
                continue
            if action.sub_actions:
                forward, backward = map(single, action.sub_actions)
                ops.append(Overlap(forward, backward))
            else:
                ops.append(single(action))
        ranks.append(ops)
    return Schedule.from_actions(name, placement, num_microbatches, ranks)
