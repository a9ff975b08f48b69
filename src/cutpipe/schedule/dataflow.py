"""What every op waits for and what it makes: the one statement of a schedule's dependencies.

Data flows along the stages of a microbatch: a forward (F) reads the previous stage's activation;
a backward (B or BW) reads the gradient of the next stage's input, or, on the last stage, its own
forward's output (the loss); a weight pass (W) reads what its own B left. ``awaited`` says this
and nothing else does: who reads a value, which rank sends an op its input, and the per-slot
tables of the validator's walk are all derived from it, so the validator, the simulator, the
runtime, the planners and the pictures cannot disagree about a dependency.

A value is named by a *key* ``(ACTIVATION or GRADIENT, stage, microbatch)``: the output of that
stage's forward, or the gradient of that stage's input (made by its B or BW). Ranks come from the
placement: a microbatch flows through one pipe, and the pipe says which rank runs each stage.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from itertools import chain
from typing import Any

from cutpipe.schedule.codes import B_CODE, BW_CODE, F_CODE, KIND_BITS, KIND_MASK, W_CODE, Codec
from cutpipe.schedule.placement import Placement

ACTIVATION = F_CODE  # a forward's output
GRADIENT = B_CODE  # the gradient of a stage's input, made by its B or BW

#: ``(ACTIVATION | GRADIENT, stage, microbatch)``: one value that one op makes and another reads.
Key = tuple[int, int, int]
KINDS = (F_CODE, B_CODE, W_CODE, BW_CODE)  # in the order of their codes


def awaited(kind: int, stage: int, microbatch: int, num_stages: int) -> Key | None:
    """The value an op cannot start without; None for a first-stage forward (it reads the batch).

    ``kind`` is F_CODE, B_CODE, W_CODE or BW_CODE. Same-stage inputs count: a W waits for its own
    B, the last stage's backward for its own forward.
    """
    if kind == F_CODE:
        return forward_input(stage, microbatch)
    if kind == W_CODE:
        return (GRADIENT, stage, microbatch)
    if stage < num_stages - 1:
        return (GRADIENT, stage + 1, microbatch)
    return (ACTIVATION, stage, microbatch)


def forward_input(stage: int, microbatch: int) -> Key | None:
    """What ``stage``'s forward reads: the previous stage's activation (None on the first stage,
    whose forward reads the batch). The gradient of a stage's input has this value's shape."""
    return (ACTIVATION, stage - 1, microbatch) if stage > 0 else None


def produced(kind: int, stage: int, microbatch: int) -> Key | None:
    """The value an op makes; None for a W, whose weight gradient no other op reads."""
    if kind == W_CODE:
        return None
    return (ACTIVATION if kind == F_CODE else GRADIENT, stage, microbatch)


class Dataflow:
    """The rule on one placement and microbatch count: ranks, pipes and tables for hot loops.

    Ops are packed codes (``cutpipe.schedule.codes``) or ``(kind, stage, microbatch)`` triples
    (an ``Action`` is one). A *slot* is ``microbatch * S + stage``.
    """

    def __init__(self, placement: Placement, num_microbatches: int) -> None:
        self.placement = placement
        self.num_stages = placement.num_stages
        self.num_microbatches = num_microbatches
        self.pipes = placement.pipe_table(num_microbatches)  # the pipe of every microbatch
        S = self.num_stages
        # the rule inverted: every (kind, stage) that reads each (ACTIVATION or GRADIENT, stage)
        self._reading: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for stage in range(S):
            for kind in KINDS:
                key = awaited(kind, stage, 0, S)
                if key is not None:
                    self._reading.setdefault((key[0], key[1]), []).append((kind, stage))
        # ``reader`` by [ACTIVATION or GRADIENT][stage], a list for hot loops
        self._reader = [[self._pick((what, stage)) for stage in range(S)] for what in range(2)]

    def _pick(self, value: tuple[int, int]) -> tuple[int, int]:
        readers = self._reading.get(value, [(-1, -1)])
        return next(((kind, stage) for kind, stage in readers if stage != value[1]), readers[0])

    # -- single ops and values ------------------------------------------------------------------

    def unpack(self, code: int) -> tuple[int, int, int]:
        """(kind, stage, microbatch) of a single (not paired) op code."""
        microbatch, stage = divmod(code >> KIND_BITS, self.num_stages)
        return code & KIND_MASK, stage, microbatch

    def awaits(self, code: int) -> Key | None:
        """``awaited`` for a single op code."""
        microbatch, stage = divmod(code >> KIND_BITS, self.num_stages)
        return awaited(code & KIND_MASK, stage, microbatch, self.num_stages)

    def makes(self, code: int) -> Key | None:
        """``produced`` for a single op code."""
        microbatch, stage = divmod(code >> KIND_BITS, self.num_stages)
        return produced(code & KIND_MASK, stage, microbatch)

    def reader(self, key: Key) -> tuple[int, int]:
        """(kind, stage) of the op that reads ``key``: F_CODE, B_CODE (the backward, B or BW) or
        W_CODE. The op of another stage if there is one: a gradient is also read by its own
        stage's W when the backward is split, but only the first stage's has no other reader."""
        return self._reader[key[0]][key[1]]

    # -- ranks and pipes ------------------------------------------------------------------------

    def pipe(self, microbatch: int) -> int:
        return self.pipes[microbatch]

    def rank(self, stage: int, microbatch: int) -> int:
        """The rank that runs ``stage`` for ``microbatch`` (in the microbatch's pipe)."""
        return self.placement.pipes[self.pipes[microbatch]][stage]

    def producer(self, key: Key) -> int:
        """The rank that makes ``key``."""
        return self.rank(key[1], key[2])

    def consumer(self, key: Key) -> int:
        """The rank that runs ``reader(key)``."""
        return self.rank(self._reader[key[0]][key[1]][1], key[2])

    def source(self, kind: int, stage: int, microbatch: int) -> int | None:
        """The rank that sends this op its input, or None if the input is made on its own rank
        (or there is none: a first-stage forward, an overlapped pair as a whole)."""
        if kind not in KINDS:  # an overlapped pair (``Kind.FB``): ask for each half
            return None
        key = awaited(kind, stage, microbatch, self.num_stages)
        if key is None:
            return None
        sender = self.producer(key)
        return None if sender == self.rank(stage, microbatch) else sender

    def destination(self, kind: int, stage: int, microbatch: int) -> int | None:
        """The rank this op sends its output to, or None if the output stays on its rank."""
        if kind not in KINDS:
            return None
        key = produced(kind, stage, microbatch)
        if key is None:
            return None
        receiver = self.consumer(key)
        return None if receiver == self.rank(stage, microbatch) else receiver

    # -- tables for hot loops ------------------------------------------------------------------

    @property
    def gradients(self) -> int:
        """Where gradients start in a value table: activation of slot s at s, gradient at this+s."""
        return self.num_stages * self.num_microbatches

    def value(self, key: Key) -> int:
        """The index of ``key`` in a value table (see ``gradients``)."""
        what, stage, microbatch = key
        slot = microbatch * self.num_stages + stage
        return slot + self.gradients if what == GRADIENT else slot

    def _over_microbatches(self, per_pipe: list[list]) -> list:
        """Repeat each pipe's pattern (the entries of one microbatch) over that pipe's microbatches."""
        m = self.num_microbatches
        parts = [
            pattern * len(self.placement.microbatches_of(pipe, m))
            for pipe, pattern in enumerate(per_pipe)
        ]
        return parts[0] if len(parts) == 1 else list(chain.from_iterable(parts))

    @cached_property
    def owners(self) -> list[int]:
        """The rank that runs each slot."""
        return self._over_microbatches([list(ranks) for ranks in self.placement.pipes])

    def inputs(self, latency: float = 0.0) -> list[tuple[int | None, float]]:
        """Per op code, modulo the table's length: ``(step, delay)`` for the value it awaits.

        The value sits at ``slot + step`` in a value table (see ``gradients``); ``delay`` is
        ``latency`` when it is made on another rank, else 0. ``(None, 0.0)``: the op awaits
        nothing (a first-stage forward). The rule is the same for every microbatch, so one
        microbatch's codes make the table when every pipe puts the stages on ranks alike (it
        then stays in the processor's cache); otherwise it lists every code, and ``code % len``
        is the code.
        """

        def entry(kind: int, stage: int, ranks: tuple[int, ...]) -> tuple[int | None, float]:
            key = awaited(kind, stage, 0, self.num_stages)
            if key is None:
                return (None, 0.0)
            crosses = ranks[key[1]] != ranks[stage]
            return (self.value(key) - stage, latency if crosses else 0.0)

        return self._per_code(entry)

    def readers(self, latency: float = 0.0) -> list[tuple[tuple[int, float], ...]]:
        """Per op code, modulo the table's length: ``(step, delay)`` for every op that awaits
        what it makes. The reader's code is ``code + step``; ``delay`` is ``latency`` when the
        reader runs on another rank, else 0. Same-stage readers count (a B's own W)."""
        codec = Codec(self.num_stages, 1)  # code steps are the same for every microbatch

        def entry(kind: int, stage: int, ranks: tuple[int, ...]) -> tuple[tuple[int, float], ...]:
            key = produced(kind, stage, 0)
            if key is None:
                return ()
            here = codec.action(kind, stage, 0)
            return tuple(
                (codec.action(k, s, 0) - here, latency if ranks[s] != ranks[stage] else 0.0)
                for k, s in self._reading.get((key[0], key[1]), ())
            )

        return self._per_code(entry)

    def _per_code(self, entry: Callable[[int, int, tuple[int, ...]], Any]) -> list:
        """``entry(kind, stage, ranks of the pipe)`` for every code of one microbatch, per pipe;
        one microbatch's table if the pipes agree, else every code's."""
        patterns = [
            [entry(kind, stage, ranks) for stage in range(self.num_stages) for kind in KINDS]
            for ranks in self.placement.pipes
        ]
        if all(pattern == patterns[0] for pattern in patterns):
            return patterns[0]
        return self._over_microbatches(patterns)
