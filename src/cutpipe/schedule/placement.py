"""Placements: which rank holds each pipeline stage, for each direction data flows in.

A placement has one or more *pipes*. A pipe lists, for every stage of the model in the order data
flows through them, the rank that holds it. Ordinary schedules have one pipe. DualPipe has two that
run in opposite directions over the same stages, so every stage is held by two ranks (its
parameters are stored twice and their gradients must be summed).

Microbatches are split over the pipes in contiguous blocks: with two pipes and ``m`` microbatches,
pipe 0 carries microbatches ``0 .. ceil(m/2)-1`` and pipe 1 the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from cutpipe.records import listed, require_keys, whole


@dataclass(frozen=True)
class Placement:
    """Stage-to-rank maps, one per pipe (direction of data flow)."""

    kind: str
    num_ranks: int
    pipes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, int):
            raise TypeError(f"a placement's num_ranks must be an int, got {self.num_ranks!r}")
        if not isinstance(self.pipes, tuple) or not all(
            isinstance(pipe, tuple)
            and all(isinstance(r, int) and not isinstance(r, bool) for r in pipe)
            for pipe in self.pipes
        ):
            raise TypeError(
                "a placement's pipes must be a tuple of tuples of ranks (ints), one per pipe, "
                f"got {self.pipes!r}"
            )
        if self.num_ranks < 1:
            raise ValueError(f"a placement needs at least 1 rank, got {self.num_ranks}")
        if not self.pipes or not self.pipes[0]:
            raise ValueError("a placement needs at least one pipe with at least one stage")
        if len({len(p) for p in self.pipes}) != 1:
            raise ValueError("every pipe of a placement must list the same number of stages")
        for pipe in self.pipes:
            bad = [r for r in pipe if not 0 <= r < self.num_ranks]
            if bad:
                raise ValueError(
                    f"placement puts stages on ranks {bad}, outside 0..{self.num_ranks - 1}"
                )
        if set().union(*map(set, self.pipes)) != set(range(self.num_ranks)):
            raise ValueError("every rank of a placement must hold at least one stage")

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def linear(cls, num_ranks: int) -> Placement:
        """Stage r on rank r (GPipe, 1F1B, ZB-H1, ZB-H2)."""
        return cls("linear", num_ranks, (tuple(range(num_ranks)),))

    @classmethod
    def interleaved(cls, num_ranks: int, chunks: int) -> Placement:
        """``chunks`` stages per rank, round robin: rank r holds r, r+R, r+2R, ... (Megatron)."""
        if chunks < 1:
            raise ValueError(f"interleaved placement needs chunks >= 1, got {chunks}")
        return cls(
            "interleaved", num_ranks, (tuple(s % num_ranks for s in range(chunks * num_ranks)),)
        )

    @classmethod
    def vshape(cls, num_ranks: int) -> Placement:
        """2R stages folded into a V: rank r holds stage r and stage 2R-1-r (ZB-V, DualPipeV)."""
        down = tuple(range(num_ranks))
        return cls("v", num_ranks, (down + down[::-1],))

    @classmethod
    def bidirectional(cls, num_ranks: int) -> Placement:
        """DualPipe's mirror: pipe 0 puts stage s on rank s, pipe 1 on rank R-1-s.

        Every stage lives on two ranks, so each rank stores two stages' parameters (2x).
        """
        if num_ranks % 2:
            raise ValueError(
                f"a bidirectional placement needs an even number of ranks, got {num_ranks}"
            )
        down = tuple(range(num_ranks))
        return cls("bidirectional", num_ranks, (down, down[::-1]))

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.pipes[0])

    @property
    def num_pipes(self) -> int:
        return len(self.pipes)

    @cached_property
    def _holdings(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        held: list[list[tuple[int, int]]] = [[] for _ in range(self.num_ranks)]
        for pipe, ranks in enumerate(self.pipes):
            for stage, rank in enumerate(ranks):
                held[rank].append((pipe, stage))
        return tuple(tuple(h) for h in held)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The distinct stages whose parameters ``rank`` stores, in data-flow order."""
        return tuple(dict.fromkeys(stage for _, stage in self._holdings[rank]))

    def copies(self, stage: int) -> tuple[int, ...]:
        """The ranks that store a copy of ``stage``'s parameters (two for DualPipe)."""
        return tuple(dict.fromkeys(pipe[stage] for pipe in self.pipes))

    def parameter_share(self, rank: int, stage_params: Sequence[float] | None = None) -> float:
        """Fraction of the whole model's parameters ``rank`` stores (copies count every time)."""
        sizes = stage_params or [1.0] * self.num_stages
        total = sum(sizes)
        return sum(sizes[s] for s in self.stages_of(rank)) / total

    def parameter_shares(self, stage_params: Sequence[float] | None = None) -> list[float]:
        """``parameter_share`` of every rank, in time linear in the stages (not quadratic)."""
        sizes = stage_params or [1.0] * self.num_stages
        total = sum(sizes)
        return [sum(sizes[s] for s in self.stages_of(r)) / total for r in range(self.num_ranks)]

    def microbatches_of(self, pipe: int, num_microbatches: int) -> range:
        """The microbatch ids that flow through ``pipe``: contiguous, earlier pipes get the extra one."""
        per_pipe, extra = divmod(num_microbatches, self.num_pipes)
        start = pipe * per_pipe + min(pipe, extra)
        return range(start, start + per_pipe + (pipe < extra))

    def pipe_of(self, microbatch: int, num_microbatches: int) -> int:
        """The pipe that carries ``microbatch``."""
        for pipe in range(self.num_pipes):
            if microbatch < self.microbatches_of(pipe, num_microbatches).stop:
                return pipe
        raise ValueError(f"microbatch {microbatch} is outside 0..{num_microbatches - 1}")

    def pipe_table(self, num_microbatches: int) -> list[int]:
        """``pipe_of`` for every microbatch, as a list to index in hot loops."""
        table: list[int] = []
        for pipe in range(self.num_pipes):
            table.extend([pipe] * len(self.microbatches_of(pipe, num_microbatches)))
        return table

    def is_cross_rank(self, pipe: int, boundary: int) -> bool:
        """Whether data crossing from stage ``boundary`` to ``boundary + 1`` leaves the rank."""
        ranks = self.pipes[pipe]
        return ranks[boundary] != ranks[boundary + 1]

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "num_ranks": self.num_ranks,
            "pipes": [list(p) for p in self.pipes],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Placement:
        """The placement ``to_dict`` wrote; a ValueError names a missing or malformed field."""
        record = require_keys(data, "placement", ("kind", "num_ranks", "pipes"))
        if not isinstance(record["kind"], str):
            raise ValueError(f"placement kind must be a string, got {record['kind']!r}")
        ranks = whole(record["num_ranks"], "placement num_ranks", least=1)
        pipes = tuple(
            tuple(whole(r, f"placement pipe {p} rank") for r in listed(pipe, f"placement pipe {p}"))
            for p, pipe in enumerate(listed(record["pipes"], "placement pipes"))
        )
        return cls(record["kind"], ranks, pipes)
