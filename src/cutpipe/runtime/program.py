"""The program one rank runs: its ops in order, with every send and receive resolved.

Built once per (schedule, rank) from the placement, before any tensor moves. Besides the ops, it
lists, for every rank that sends to this one, the messages in the order that rank sends them:
receives are posted in that order, which is what NCCL's in-order matching between two ranks needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from cutpipe.schedule.codes import B_CODE, F_CODE, KIND_MASK
from cutpipe.schedule.dataflow import ACTIVATION, GRADIENT, Key
from cutpipe.schedule.schedule import Schedule

#: A message between ranks: a ``cutpipe.schedule.dataflow`` key. (ACTIVATION, stage, microbatch)
#: is the output of ``stage``'s forward; (GRADIENT, stage, microbatch) is the gradient of
#: ``stage``'s input, which the backward of the stage before reads.
MessageKey = Key
#: The messages one op sends to one rank, which travel together as one transfer.
Parcel = tuple[MessageKey, ...]


@dataclass(frozen=True, slots=True)
class Instruction:
    """One F, B, W or BW with where its input comes from and where its output goes."""

    kind: int  # F_CODE, B_CODE, W_CODE or BW_CODE
    stage: int
    microbatch: int
    code: int  # the packed op, for names in errors and timelines
    source: int | None  # rank the input arrives from; None: the batch, the loss or this rank
    target: int | None  # rank the output goes to; None: this rank, or nowhere
    first: bool  # first stage of the model: the forward reads the batch
    last: bool  # last stage: the forward computes the loss, the backward starts from it
    awaits: MessageKey | None  # the value it waits for, from whichever rank; None: the batch
    makes: MessageKey | None  # the value it makes; None for a W

    @property
    def receives(self) -> MessageKey | None:
        """The message it receives from another rank, if any."""
        return None if self.source is None else self.awaits

    @property
    def sends(self) -> MessageKey | None:
        """The message it sends to another rank, if any."""
        return None if self.target is None else self.makes


@dataclass(frozen=True, slots=True)
class Pair:
    """An overlapped F&B pair: both halves' inputs are received before it starts."""

    forward: Instruction
    backward: Instruction
    code: int


Op = Instruction | Pair


def halves(op: Op) -> tuple[Instruction, ...]:
    return (op.forward, op.backward) if type(op) is Pair else (op,)


def parcels(op: Op) -> list[tuple[int, Parcel]]:
    """(destination, messages) of what ``op`` sends to other ranks, one parcel per destination.

    Sender and receiver both derive parcels with this rule, so they agree on the grouping."""
    grouped: dict[int, list[MessageKey]] = {}
    for half in halves(op):
        if half.target is not None:
            grouped.setdefault(half.target, []).append(half.sends)
    return [(dst, tuple(keys)) for dst, keys in grouped.items()]


class RankProgram:
    """The instructions of ``rank`` under ``schedule`` (forward-only: just the forwards)."""

    def __init__(self, schedule: Schedule, rank: int, forward_only: bool = False) -> None:
        if not 0 <= rank < schedule.num_ranks:
            raise ValueError(
                f"rank {rank} is outside the schedule's ranks 0..{schedule.num_ranks - 1}"
            )
        self.schedule = schedule
        self.rank = rank
        self.forward_only = forward_only
        programs = [self._instructions(r) for r in range(schedule.num_ranks)]
        self.ops: list[Op] = programs[rank]
        #: what each op sends to other ranks: (destination, parcel) pairs
        self.outbox: list[list[tuple[int, Parcel]]] = [parcels(op) for op in self.ops]
        #: for each rank that sends here: its parcels, in the order it sends them
        self.inbox: dict[int, list[Parcel]] = {}
        for sender, ops in enumerate(programs):
            for op in ops:
                for dst, parcel in parcels(op):
                    if dst == rank:
                        self.inbox.setdefault(sender, []).append(parcel)
        #: the parcel each incoming message travels in
        self.parcel_of: dict[MessageKey, Parcel] = {
            key: parcel for received in self.inbox.values() for parcel in received for key in parcel
        }
        #: the messages this rank receives, in the order its ops need them
        self.needs: list[list[tuple[MessageKey, int]]] = [
            [(half.receives, half.source) for half in halves(op) if half.receives is not None]
            for op in self.ops
        ]
        #: op index -> the stages whose weight gradients are complete once it has run: the last
        #: op of the step that computes any of the stage's (its last W, BW or, unsplit, B)
        self.grads_done: dict[int, list[int]] = {}
        last: dict[int, int] = {}
        for index, op in enumerate(self.ops):
            for half in halves(op):
                if half.kind != F_CODE:
                    last[half.stage] = index
        for stage, index in sorted(last.items()):
            self.grads_done.setdefault(index, []).append(stage)
        #: (stage, microbatch) whose backward on this rank is split into B and W
        self.split_slots = frozenset(
            (half.stage, half.microbatch)
            for op in self.ops
            for half in ((op.backward,) if type(op) is Pair else (op,))
            if half.kind == B_CODE
        )

    @property
    def stages(self) -> tuple[int, ...]:
        return self.schedule.placement.stages_of(self.rank)

    def _instruction(self, code: int) -> Instruction:
        flow = self.schedule.dataflow
        kind, stage, microbatch = flow.unpack(code)
        return Instruction(
            kind=kind,
            stage=stage,
            microbatch=microbatch,
            code=code,
            source=flow.source(kind, stage, microbatch),
            target=flow.destination(kind, stage, microbatch),
            first=stage == 0,
            last=stage == flow.num_stages - 1,
            awaits=flow.awaits(code),
            makes=flow.makes(code),
        )

    def _instructions(self, rank: int) -> list[Op]:
        split = self.schedule.codec.split_pair
        ops: list[Op] = []
        for code in self.schedule.codes[rank]:
            if code < 0:
                forward, backward = (self._instruction(c) for c in split(code))
                ops.append(forward if self.forward_only else Pair(forward, backward, code))
            elif not self.forward_only or code & KIND_MASK == F_CODE:
                ops.append(self._instruction(code))
        return ops


__all__ = [
    "ACTIVATION", "GRADIENT", "Instruction", "MessageKey", "Op", "Pair", "Parcel", "RankProgram",
    "halves", "parcels",
]  # fmt: skip
