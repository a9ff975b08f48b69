"""``Timeline``: when each op of each rank ran. The format shared by the simulator and the runtime.

A timeline is a schedule plus, per rank, a start and an end time for each op in that rank's order.
The simulator predicts one (in cost units); the runtime records one (in seconds). Everything that
reads timelines (metrics, pictures, comparisons) takes either.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cutpipe.schedule.actions import Op
from cutpipe.schedule.schedule import Schedule

FORMAT = "cutpipe-timeline"
VERSION = 1


@dataclass(frozen=True)
class Timeline:
    """Start and end of every op, per rank, in the order of ``schedule.codes``."""

    schedule: Schedule
    starts: Sequence[Sequence[float]] = field(repr=False)
    ends: Sequence[Sequence[float]] = field(repr=False)
    unit: str = "cost"
    source: str = "simulated"

    def __post_init__(self) -> None:
        for rank, ops in enumerate(self.schedule.codes):
            if not len(self.starts[rank]) == len(self.ends[rank]) == len(ops):
                raise ValueError(
                    f"timeline of rank {rank} has {len(self.starts[rank])} starts and "
                    f"{len(self.ends[rank])} ends for {len(ops)} ops"
                )

    @property
    def num_ranks(self) -> int:
        return self.schedule.num_ranks

    @property
    def begin(self) -> float:
        return min((s[0] for s in self.starts if s), default=0.0)

    @property
    def finish(self) -> float:
        return max((e[-1] for e in self.ends if e), default=0.0)

    @property
    def makespan(self) -> float:
        return self.finish - self.begin

    def busy(self, rank: int) -> float:
        """Time ``rank`` spent running ops."""
        return sum(self.ends[rank]) - sum(self.starts[rank])

    def span(self, rank: int) -> float:
        """From ``rank``'s first op starting to its last op ending."""
        starts, ends = self.starts[rank], self.ends[rank]
        return ends[-1] - starts[0] if starts else 0.0

    def events(self, rank: int) -> Iterator[tuple[Op, float, float]]:
        """(op, start, end) of every op of ``rank``, in order."""
        return zip(self.schedule.actions[rank], self.starts[rank], self.ends[rank], strict=True)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "unit": self.unit,
            "source": self.source,
            "schedule": self.schedule.to_dict(),
            "starts": [list(s) for s in self.starts],
            "ends": [list(e) for e in self.ends],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Timeline:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(
                f'not a cutpipe timeline: expected a JSON object with "format": "{FORMAT}" '
                "(written by `cutpipe simulate --timeline` or `cutpipe train --trace`)"
            )
        if data.get("version") != VERSION:
            raise ValueError(f"cutpipe timeline version {data.get('version')} is not {VERSION}")
        return cls(
            Schedule.from_dict(data["schedule"]),
            [list(map(float, s)) for s in data["starts"]],
            [list(map(float, e)) for e in data["ends"]],
            unit=str(data.get("unit", "cost")),
            source=str(data.get("source", "simulated")),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not JSON ({error}); expected a cutpipe timeline") from None
        return cls.from_dict(data)
