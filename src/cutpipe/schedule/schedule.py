"""The ``Schedule``: a placement, a microbatch count, and one ordered list of ops per rank.

Communication is never written into a schedule: who sends what to whom follows from the placement
and one dependency rule (``dataflow``, see ``cutpipe.schedule.dataflow``), so the simulator, the
validator and the runtime all derive the same sends and receives.

Ops are stored as packed ints (``codes``, see ``cutpipe.schedule.codes``); ``actions`` decodes them
into ``Action`` / ``Overlap`` objects on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from cutpipe.records import listed, require_keys, whole
from cutpipe.schedule.actions import Action, Op, parse_op
from cutpipe.schedule.codes import Codec
from cutpipe.schedule.dataflow import Dataflow
from cutpipe.schedule.placement import Placement


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered ops for one training step of ``num_microbatches`` microbatches.

    Two schedules are equal when they run the same ops in the same order on the same placement;
    the name is only a label.
    """

    name: str = field(compare=False)
    placement: Placement
    num_microbatches: int
    codes: tuple[tuple[int, ...], ...] = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.placement, Placement):
            raise TypeError(f"a schedule's placement must be a Placement, got {self.placement!r}")
        if isinstance(self.num_microbatches, bool) or not isinstance(self.num_microbatches, int):
            raise TypeError(
                f"a schedule's num_microbatches must be an int, got {self.num_microbatches!r}"
            )
        if self.num_microbatches < 1:
            raise ValueError(f"a schedule needs at least 1 microbatch, got {self.num_microbatches}")
        if len(self.codes) != self.placement.num_ranks:
            raise ValueError(
                f"schedule {self.name!r} lists ops for {len(self.codes)} ranks but its placement "
                f"has {self.placement.num_ranks}"
            )

    @classmethod
    def from_actions(
        cls, name: str, placement: Placement, num_microbatches: int, actions: Sequence[Sequence[Op]]
    ) -> Schedule:
        """Build a schedule from per-rank lists of ``Action`` / ``Overlap`` objects."""
        codec = Codec(placement.num_stages, num_microbatches)
        codes = tuple(tuple(codec.encode(op) for op in ops) for ops in actions)
        return cls(name, placement, num_microbatches, codes)

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def num_ops(self) -> int:
        """Ops of every rank (an overlapped pair counts once)."""
        return sum(map(len, self.codes))

    @cached_property
    def codec(self) -> Codec:
        return Codec(self.num_stages, self.num_microbatches)

    @cached_property
    def actions(self) -> tuple[tuple[Op, ...], ...]:
        """The ops of every rank, in order, as ``Action`` / ``Overlap`` objects."""
        decode = self.codec.decode
        return tuple(tuple(map(decode, ops)) for ops in self.codes)

    @property
    def pipe_table(self) -> list[int]:
        """The pipe of every microbatch, indexable in hot loops."""
        return self.dataflow.pipes

    def pipe_of(self, microbatch: int) -> int:
        return self.pipe_table[microbatch]

    @cached_property
    def dataflow(self) -> Dataflow:
        """What each op waits for and makes, and on which ranks (``cutpipe.schedule.dataflow``)."""
        return Dataflow(self.placement, self.num_microbatches)

    def source(self, action: Action) -> int | None:
        """The rank that sends this action its input, or None if the input is local."""
        return self.dataflow.source(*action)

    def destination(self, action: Action) -> int | None:
        """The rank this action sends its output to, or None if it stays on this rank."""
        return self.dataflow.destination(*action)

    def text(self) -> str:
        """Per-rank op lists in PyTorch's notation, one rank per line."""
        return "\n".join(
            f"rank {r}: " + " ".join(map(str, ops)) for r, ops in enumerate(self.actions)
        )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "placement": self.placement.to_dict(),
            "num_microbatches": self.num_microbatches,
            "actions": [[str(op) for op in ops] for ops in self.actions],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        """The schedule ``to_dict`` wrote; a ValueError names a missing or malformed field."""
        record = require_keys(data, "schedule", ("placement", "num_microbatches", "actions"))
        placement = Placement.from_dict(record["placement"])
        microbatches = whole(record["num_microbatches"], "schedule num_microbatches", least=1)
        per_rank = listed(record["actions"], "schedule actions", length=placement.num_ranks)
        actions = []
        for rank, ops in enumerate(per_rank):
            texts = listed(ops, f"schedule actions of rank {rank}")
            if not all(isinstance(text, str) for text in texts):
                raise ValueError(f"schedule actions of rank {rank} must be strings such as '0F1'")
            actions.append([parse_op(text) for text in texts])
        return cls.from_actions(str(record.get("name", "custom")), placement, microbatches, actions)
