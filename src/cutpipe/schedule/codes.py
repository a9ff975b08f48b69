"""Packed integer codes for ops: how a ``Schedule`` stores its actions.

A schedule at R = 64, m = 1024 holds up to 400,000 actions, and generating, validating and
simulating every schedule at that size must take well under two seconds. Python creates an int in
a few tens of nanoseconds and a NamedTuple in several hundred, so schedules store one int per op
and hand out ``Action`` objects only when asked.

Layout of a single action: ``((microbatch * S + stage) << 2) | kind`` with kind F=0, B=1, W=2,
BW=3. ``code >> 2`` is then the (stage, microbatch) *slot*, the index used by every per-slot table
in the validator and the simulator, and ``code | 3`` turns an F code into the BW of the same slot.
An overlapped pair is a negative number: ``-1 - (forward_code * span + backward_code)`` with
``span = (S * m) << 2``.
"""

from __future__ import annotations

from cutpipe.schedule.actions import Action, Kind, Op, Overlap

KIND_BITS = 2
KIND_MASK = 3
F_CODE, B_CODE, W_CODE, BW_CODE = 0, 1, 2, 3
_KINDS = (Kind.F, Kind.B, Kind.W, Kind.BW)


class Codec:
    """Encodes and decodes ops for one (stages, microbatches) shape."""

    __slots__ = ("num_microbatches", "num_stages", "span")

    def __init__(self, num_stages: int, num_microbatches: int) -> None:
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.span = (num_stages * num_microbatches) << KIND_BITS

    def action(self, kind: int, stage: int, microbatch: int) -> int:
        return ((microbatch * self.num_stages + stage) << KIND_BITS) | kind

    def pair(self, forward_code: int, backward_code: int) -> int:
        return -1 - (forward_code * self.span + backward_code)

    def split_pair(self, code: int) -> tuple[int, int]:
        return divmod(-1 - code, self.span)

    def encode(self, op: Op) -> int:
        if type(op) is Overlap:
            return self.pair(self.encode(op.forward), self.encode(op.backward))
        kind, stage, microbatch = op
        if Kind(kind) is Kind.FB:
            raise ValueError(f"{op!r} is not a single action; use Overlap for an F&B pair")
        if not (0 <= stage < self.num_stages and 0 <= microbatch < self.num_microbatches):
            raise ValueError(
                f"action {op} is outside the schedule: stages are 0..{self.num_stages - 1}, "
                f"microbatches 0..{self.num_microbatches - 1}"
            )
        return self.action(int(kind), stage, microbatch)

    def decode(self, code: int) -> Op:
        if code < 0:
            forward, backward = self.split_pair(code)
            return Overlap(self.decode(forward), self.decode(backward))
        slot = code >> KIND_BITS
        microbatch, stage = divmod(slot, self.num_stages)
        return Action(_KINDS[code & KIND_MASK], stage, microbatch)
