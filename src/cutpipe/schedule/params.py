"""Keyword parameters of schedule generators, declared as data, and their text form.

A generator such as Interleaved 1F1B takes more than ranks and microbatches: how many chunks
(stages) each rank holds. Each such parameter is declared once, as a ``Param`` (name, type,
default, valid range), so the registry, the generators and the command line check it the same
way and every error says what to change. On the command line a schedule is written
``name:key=value``, e.g. ``interleaved:chunks=4``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    """One whole-number keyword parameter of a generator."""

    name: str
    default: int
    help: str
    least: int = 1
    most: int | None = None
    #: the value is how many stages each rank holds (the size limit multiplies by it)
    stages_per_rank: bool = False

    @property
    def bounds(self) -> str:
        """The valid range in words, e.g. ``>= 1``."""
        if self.most is None:
            return f">= {self.least}"
        return f"between {self.least} and {self.most}"

    def describe(self) -> str:
        """``chunks (a whole number >= 1, default 2): stages per rank``."""
        return f"{self.name} (a whole number {self.bounds}, default {self.default}): {self.help}"

    def check(self, schedule: str, value: object) -> int:
        """``value`` if it is an int in range; else an error naming the rule and an example."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"{schedule}: {self.name} must be an int, got {value!r} ({type(value).__name__})"
            )
        if value < self.least or (self.most is not None and value > self.most):
            raise ValueError(
                f"{schedule}: {self.name} must be a whole number {self.bounds}, got {value} "
                f"(e.g. {schedule}:{self.name}={self.default})"
            )
        return value

    def parse(self, schedule: str, text: str) -> int:
        """The value written after ``key=`` on the command line."""
        try:
            value = int(text)
        except ValueError:
            raise ValueError(
                f"{schedule}: {self.name} must be a whole number {self.bounds}, got {text!r} "
                f"(e.g. {schedule}:{self.name}={self.default})"
            ) from None
        return self.check(schedule, value)


#: Chunks per rank, for the schedules that hold several stages on every rank.
CHUNKS = Param("chunks", 2, "stages per rank", stages_per_rank=True)


def parse_spec(text: str) -> tuple[str, dict[str, str]]:
    """``'interleaved:chunks=4'`` -> ``('interleaved', {'chunks': '4'})``.

    Parameters follow the name after ``:`` and are separated by ``:`` or ``,``. Keys are
    case-insensitive; values are kept as text for the parameter to parse.
    """
    name, colon, rest = text.partition(":")
    params: dict[str, str] = {}
    if not colon:
        return name.strip(), params
    for item in rest.replace(",", ":").split(":"):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not key or not value:
            raise ValueError(
                f"write schedule parameters as key=value after the name, e.g. "
                f"interleaved:chunks=4; got {item.strip()!r} in {text.strip()!r}"
            )
        if key.lower() in params:
            raise ValueError(f"parameter {key!r} is given twice in {text.strip()!r}")
        params[key.lower()] = value
    return name.strip(), params


def split_specs(text: str) -> list[str]:
    """Split a comma-separated list of schedules, each possibly with parameters.

    ``'1f1b,interleaved:chunks=4,zbv'`` -> ``['1f1b', 'interleaved:chunks=4', 'zbv']``. A piece
    with ``=`` but no ``:`` continues the schedule before it (``interleavedzb:a=1,b=2``), since no
    schedule name holds ``=``. Empty pieces are dropped.
    """
    specs: list[str] = []
    for piece in text.split(","):
        if not piece.strip():
            continue
        if "=" in piece and ":" not in piece and specs:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs
