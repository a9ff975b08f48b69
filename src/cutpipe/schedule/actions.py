"""Actions: the units of work one rank runs, and their text notation.

Kinds follow the zero-bubble convention: ``B`` computes only the gradient of the stage's *input*,
``W`` only the gradient of its *weights*, and ``BW`` is the full backward (both at once).

The text notation is PyTorch's (``torch.distributed.pipelining``), so schedules can be diffed
against torch's: there, ``I`` is the input-only backward and ``B`` the *full* backward. Our
``Kind.B`` prints as ``I`` and our ``Kind.BW`` prints as ``B``.
"""

from __future__ import annotations

import re
from enum import IntEnum
from typing import NamedTuple


class Kind(IntEnum):
    """What an action computes."""

    F = 0  # forward
    B = 1  # backward for the stage input only
    W = 2  # backward for the stage weights only
    BW = 3  # full backward: B and W together
    FB = 4  # an overlapped pair: one forward and one backward run as one unit


#: PyTorch's letter for each kind (its ``B`` is our full backward ``BW``).
TORCH_LETTER = {Kind.F: "F", Kind.B: "I", Kind.W: "W", Kind.BW: "B"}
_KIND_OF_LETTER = {letter: kind for kind, letter in TORCH_LETTER.items()}
OVERLAP_SUFFIX = "OVERLAP_F_B"


class Action(NamedTuple):
    """One F, B, W or BW of one stage on one microbatch."""

    kind: Kind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{TORCH_LETTER[self.kind]}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self.kind.name}, stage={self.stage}, microbatch={self.microbatch})"


class Overlap(NamedTuple):
    """An F of one microbatch and a backward (B or BW) of another, run as one overlapped unit.

    DualPipe runs these pairs so that the expert-parallel all-to-all of one half hides behind the
    compute of the other.
    """

    forward: Action
    backward: Action

    @property
    def kind(self) -> Kind:
        return Kind.FB

    def __str__(self) -> str:
        return f"({self.forward};{self.backward}){OVERLAP_SUFFIX}"

    def __repr__(self) -> str:
        return f"Overlap({self.forward!r}, {self.backward!r})"


Op = Action | Overlap


def units(op: Op) -> tuple[Action, ...]:
    """The single actions an op is made of: itself, or the two halves of an overlapped pair."""
    return (op.forward, op.backward) if type(op) is Overlap else (op,)


_ACTION_RE = re.compile(r"^(\d+)([FIWB])(\d+)$")


def parse_action(text: str) -> Action:
    """Parse one action in PyTorch's notation, e.g. ``"0F1"``, ``"3I0"``, ``"2W5"``, ``"1B2"``."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(
            f"cannot parse action {text!r}: expected <stage><F|I|W|B><microbatch>, e.g. '0F1' "
            "(I = input-only backward, B = full backward, as in torch.distributed.pipelining)"
        )
    stage, letter, microbatch = match.groups()
    return Action(_KIND_OF_LETTER[letter], int(stage), int(microbatch))


def parse_op(text: str) -> Op:
    """Parse an action or an overlapped pair such as ``"(0F7;7B3)OVERLAP_F_B"``."""
    text = text.strip()
    if not text.startswith("("):
        return parse_action(text)
    if not text.endswith(")" + OVERLAP_SUFFIX) or text.count(";") != 1:
        raise ValueError(
            f"cannot parse overlapped pair {text!r}: expected '(0F7;7B3){OVERLAP_SUFFIX}'"
        )
    first, second = text[1 : -len(OVERLAP_SUFFIX) - 1].split(";")
    forward, backward = parse_action(first), parse_action(second)
    if forward.kind is not Kind.F or backward.kind not in (Kind.B, Kind.BW):
        raise ValueError(
            f"overlapped pair {text!r} must be a forward then a backward (I or B), got "
            f"{forward.kind.name} then {backward.kind.name}"
        )
    return Overlap(forward, backward)
