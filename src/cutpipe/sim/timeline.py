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

from cutpipe.files import write_text
from cutpipe.records import finite, listed, require_keys
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
        if not isinstance(self.schedule, Schedule):
            raise TypeError(f"a timeline's schedule must be a Schedule, got {self.schedule!r}")
        if not len(self.starts) == len(self.ends) == self.schedule.num_ranks:
            raise ValueError(
                f"timeline lists starts for {len(self.starts)} ranks and ends for "
                f"{len(self.ends)}, but its schedule has {self.schedule.num_ranks} ranks"
            )
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
        """The timeline ``to_dict`` wrote; a ValueError names what is missing or malformed.

        Every time must be finite and every op must end no earlier than it starts.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(
                f'not a cutpipe timeline: expected a JSON object with "format": "{FORMAT}" '
                "(written by `cutpipe simulate --timeline` or `cutpipe train --trace`)"
            )
        if data.get("version") != VERSION:
            raise ValueError(f"cutpipe timeline version {data.get('version')} is not {VERSION}")
        record = require_keys(data, "timeline", ("schedule", "starts", "ends"))
        schedule = Schedule.from_dict(record["schedule"])
        starts, ends = [], []
        for rank, ops in enumerate(schedule.codes):
            where = f"timeline rank {rank}"
            rank_starts = listed(
                listed(record["starts"], "timeline starts", schedule.num_ranks)[rank],
                f"{where} starts", len(ops),
            )  # fmt: skip
            rank_ends = listed(
                listed(record["ends"], "timeline ends", schedule.num_ranks)[rank],
                f"{where} ends", len(ops),
            )  # fmt: skip
            starts.append([finite(t, f"{where} start {i}") for i, t in enumerate(rank_starts)])
            ends.append([finite(t, f"{where} end {i}") for i, t in enumerate(rank_ends)])
            early = next(
                (i for i, (a, b) in enumerate(zip(starts[-1], ends[-1], strict=True)) if b < a),
                None,
            )
            if early is not None:
                raise ValueError(
                    f"{where}: op {early} ({schedule.actions[rank][early]}) ends at "
                    f"{ends[-1][early]:g}, before it starts at {starts[-1][early]:g}"
                )
        return cls(
            schedule,
            starts,
            ends,
            unit=str(record.get("unit", "cost")),
            source=str(record.get("source", "simulated")),
        )

    def save(self, path: str | Path) -> None:
        """Write the timeline as JSON, atomically (the old file stays until the new is whole)."""
        write_text(path, json.dumps(self.to_dict(), allow_nan=False))

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        """Read a timeline ``save`` wrote; FileNotFoundError or ValueError naming the file."""
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise FileNotFoundError(f"timeline file {path} does not exist") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not text; expected a cutpipe timeline (JSON)") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not JSON ({error}); expected a cutpipe timeline") from None
        try:
            return cls.from_dict(data)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
