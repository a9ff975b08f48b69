"""Argument checks shared by the generators: each failure names the rule that was broken."""

from __future__ import annotations


def check_counts(name: str, num_ranks: int, num_microbatches: int) -> None:
    """Every schedule needs at least one rank and one microbatch, given as ints."""
    for label, value in (("ranks", num_ranks), ("microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: {label} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name}: needs {label} >= 1, got {value}")


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
