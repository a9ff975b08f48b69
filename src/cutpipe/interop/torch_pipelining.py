"""Exchange schedules with ``torch.distributed.pipelining`` (its private action IR).

``to_torch(schedule, stages, loss_fn)`` returns a ready torch schedule object (torch's
``_PipelineScheduleRuntime`` loaded with the schedule's compute actions; torch adds the sends and
receives itself) and ``from_torch`` turns a torch schedule object or CSV file into a cutpipe
``Schedule``, so every torch schedule can be validated, simulated and drawn. The lower-level
``to_torch_actions`` / ``from_torch_actions`` work on torch's per-rank ``_Action`` lists. Torch
is imported only when these functions run; docs/interop.md shows them with torchtitan.

Torch places every stage on exactly one rank, so DualPipe (every stage on two ranks) has no torch
form; ``expressible`` says which schedules do.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from cutpipe.schedule.actions import Action, Kind, Op, Overlap
from cutpipe.schedule.fileformat import from_rows, load_schedule
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.registry import schedule_info
from cutpipe.schedule.schedule import Schedule
from cutpipe.schedule.validate import validate


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


def to_torch(schedule: Schedule, stages: Sequence[Any] | Any, loss_fn: Callable | None = None,
             **options: Any) -> Any:  # fmt: skip
    """A torch schedule object that runs ``schedule`` on this rank's stages.

    ``stages`` are this rank's stages (torch's ``PipelineStage``, in any order), ``options`` go
    to torch's constructor (``scale_grads``, ``output_merge_spec``, ...). The object's ``step`` is
    torch's own runtime: torch lowers the compute actions to its sends and receives, as it does
    for a CSV loaded with ``_load_csv``.
    """
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    actions = to_torch_actions(schedule)
    held = list(stages) if isinstance(stages, Sequence) else [stages]
    if not held:
        raise ValueError("to_torch needs this rank's PipelineStage objects, got none")
    rank = held[0].group_rank
    wanted = sorted(schedule.placement.stages_of(rank)) if rank < schedule.num_ranks else []
    if sorted(stage.stage_index for stage in held) != wanted:
        raise ValueError(
            f"rank {rank} runs stages {wanted} of {schedule.name!r}, but was given stages "
            f"{sorted(stage.stage_index for stage in held)}: build a PipelineStage for each"
        )
    if held[0].group_size != schedule.num_ranks:
        raise ValueError(
            f"{schedule.name!r} is a schedule for {schedule.num_ranks} ranks, but the stages' "
            f"process group has {held[0].group_size}"
        )
    runtime = _PipelineScheduleRuntime(held, schedule.num_microbatches, loss_fn=loss_fn, **options)
    runtime.pipeline_order = actions
    runtime._prepare_schedule_with_comms(actions)
    return runtime


def from_torch(source: Any) -> Schedule:
    """A validated cutpipe schedule from a torch schedule object or a CSV file torch reads.

    A torch schedule object's ``pipeline_order`` is read as it is, except for one defect of
    torch 2.13: ``Schedule1F1B`` numbers its last rank's forwards 1..m in ``pipeline_order``
    (its runtime runs 0..m-1), which is corrected here.
    """
    if isinstance(source, (str, os.PathLike)):
        return load_schedule(source)
    order = getattr(source, "pipeline_order", None)
    if not isinstance(order, Mapping):
        raise TypeError(
            "from_torch takes a torch.distributed.pipelining schedule object or the path of a "
            f"CSV schedule, got {type(source).__name__}"
        )
    class_name = type(source).__name__
    try:
        name = schedule_info(class_name).name
    except ValueError:
        name = class_name
    microbatches = source._n_microbatches
    rows = [list(order.get(rank, ())) for rank in range(len(order))]
    if class_name == "Schedule1F1B":
        rows[-1] = _forwards_from_zero(rows[-1], microbatches)
    texts = [[str(a) for a in row if a is not None and a.is_compute_op] for row in rows]
    schedule = from_rows(name, texts)
    if schedule.num_microbatches != microbatches:
        raise ValueError(
            f"torch's {class_name} runs {microbatches} microbatches but its pipeline_order "
            f"names {schedule.num_microbatches}"
        )
    validate(schedule)
    return schedule


def _forwards_from_zero(row: list[Any], microbatches: int) -> list[Any]:
    from torch.distributed.pipelining.schedules import _ComputationType

    forward = _ComputationType.FORWARD
    ids = [a.microbatch_index for a in row if a is not None and a.computation_type == forward]
    if ids != list(range(1, microbatches + 1)):
        return row  # already right (a later torch)
    return [
        a._replace(microbatch_index=a.microbatch_index - 1)
        if a is not None and a.computation_type == forward
        else a
        for a in row
    ]
