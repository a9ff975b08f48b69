"""Whether a memory figure fits under a cap, up to rounding: one rule for every planner."""

from __future__ import annotations

#: How far over the cap a memory figure may be and still fit: rounding only. Per-stage
#: activations in bytes (1e9 and more) summed in another order differ by many units in the last
#: place, so the slack is relative to the cap (and absolute below one unit).
CAP_SLACK = 1e-9


def within(memory: float, cap: float) -> bool:
    """Whether ``memory`` fits under ``cap`` (same units), up to rounding."""
    return memory <= cap + CAP_SLACK * max(1.0, abs(cap))
