"""A plan file: what ``recommend`` or ``partition`` chose, in the form ``cutpipe train --plan``
runs as is.

JSON, one object (docs/plan.md, "Plan files")::

    {"format": "cutpipe.plan", "version": 1,
     "model": "tiny-dense", "layers": 8,
     "layout": {"pp": 4, "dp": 1, "ep": 1, "tp": 1, "cp": 1},
     "schedule": "zbv", "microbatches": 8,
     "stage_sizes": [1, 1, 1, 1, 1, 1, 1, 3],
     "training": {"zero": 0, "recompute": "none", "fp8": false, "sequence_parallel": true},
     "predicted": {"step_time": 0.0123, "tokens_per_second": 41000.0, "hardware": "H100"}}

``stage_sizes`` lists the model's blocks (the embedding, every layer, the head, in order) per
pipeline stage, so the trainer cuts exactly the partition the planner priced. ``schedule`` is a
registry name with its parameters (``interleaved:chunks=2``) or a whole schedule as
``cutpipe schedule -o`` writes it (``cutpipe.schedule.fileformat``), for orders no generator
makes. ``predicted`` is what the planner expected, for the record; nothing reads it back.
``cp`` (context-parallel ranks per sequence) and ``sequence_parallel`` (with TP) were added
after the first files were written: a file without them means 1 and true.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cutpipe.files import write_text
from cutpipe.records import finite, listed, mapping, require_keys, whole
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import RECOMPUTE_MODES

FORMAT = "cutpipe.plan"
VERSION = 1
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class PlanFile:
    """A layout, a schedule and a stage partition for one model (see the module)."""

    model: str
    layers: int
    schedule: str | Schedule
    microbatches: int
    stage_sizes: tuple[int, ...]
    pp: int
    dp: int = 1
    ep: int = 1
    tp: int = 1
    zero: int = 0
    recompute: str = "none"
    fp8: bool = False
    cp: int = 1
    sequence_parallel: bool = True
    predicted: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # a list given for the partition compares equal to the tuple read back from a file
        if isinstance(self.stage_sizes, list):
            object.__setattr__(self, "stage_sizes", tuple(self.stage_sizes))
        object.__setattr__(self, "predicted", dict(self.predicted))
        problems = []
        if not isinstance(self.model, str) or not self.model:
            problems.append(f"model must be a name, got {self.model!r}")
        for name in ("layers", "microbatches", "pp", "dp", "ep", "tp", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a whole number >= 1, got {value!r}")
        if not isinstance(self.stage_sizes, tuple) or not self.stage_sizes:
            problems.append(f"stage_sizes must list blocks per stage, got {self.stage_sizes!r}")
        elif any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in self.stage_sizes):
            problems.append(f"stage_sizes must be whole numbers >= 1, got {list(self.stage_sizes)}")
        elif isinstance(self.layers, int) and sum(self.stage_sizes) != self.layers + 2:
            problems.append(
                f"stage_sizes {list(self.stage_sizes)} hold {sum(self.stage_sizes)} blocks, but "
                f"{self.model} has {self.layers + 2} (the embedding, {self.layers} layers, the head)"
            )
        if isinstance(self.dp, int) and isinstance(self.ep, int) and self.ep and self.dp % self.ep:
            problems.append(
                f"ep {self.ep} must divide dp {self.dp} (the expert-parallel groups are carved "
                "out of the data-parallel ranks)"
            )
        if self.zero not in ZERO_STAGES:
            problems.append(f"zero must be one of {ZERO_STAGES}, got {self.zero!r}")
        if self.recompute not in RECOMPUTE_MODES:
            problems.append(
                f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}"
            )
        if not isinstance(self.fp8, bool):
            problems.append(f"fp8 must be true or false, got {self.fp8!r}")
        if not isinstance(self.sequence_parallel, bool):
            problems.append(
                f"sequence_parallel must be true or false, got {self.sequence_parallel!r}"
            )
        if not isinstance(self.schedule, (str, Schedule)) or self.schedule == "":
            problems.append(
                f"schedule must be a registry name or a Schedule, got {self.schedule!r}"
            )
        if isinstance(self.schedule, Schedule):
            if self.schedule.num_ranks != self.pp:
                problems.append(
                    f"the schedule is for {self.schedule.num_ranks} ranks, the layout has pp={self.pp}"
                )
            if self.schedule.num_microbatches != self.microbatches:
                problems.append(
                    f"the schedule runs {self.schedule.num_microbatches} microbatches, the plan "
                    f"says {self.microbatches}"
                )
        if problems:
            raise ValueError("plan: " + "; ".join(problems))

    @property
    def num_stages(self) -> int:
        return len(self.stage_sizes)

    def resolve(self) -> Schedule:
        """The schedule this plan runs, checked against its stage partition."""
        from cutpipe.schedule.registry import generate

        schedule = self.schedule
        if not isinstance(schedule, Schedule):
            schedule = generate(schedule, self.pp, self.microbatches)
        if schedule.num_stages != self.num_stages:
            raise ValueError(
                f"plan: stage_sizes has {self.num_stages} stages, but {schedule.name} on "
                f"{self.pp} ranks has {schedule.num_stages}"
            )
        return schedule

    def to_dict(self) -> dict[str, Any]:
        from cutpipe.schedule.fileformat import dumps

        schedule = self.schedule
        if isinstance(schedule, Schedule):
            schedule = json.loads(dumps(schedule, "json"))
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "layers": self.layers,
            "layout": {"pp": self.pp, "dp": self.dp, "ep": self.ep, "tp": self.tp, "cp": self.cp},
            "schedule": schedule,
            "microbatches": self.microbatches,
            "stage_sizes": list(self.stage_sizes),
            "training": {
                "zero": self.zero,
                "recompute": self.recompute,
                "fp8": self.fp8,
                "sequence_parallel": self.sequence_parallel,
            },
            "predicted": dict(self.predicted),
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> PlanFile:
        from cutpipe.schedule.fileformat import loads

        data = require_keys(
            data, source, ("format", "version", "model", "layers", "layout", "schedule",
                           "microbatches", "stage_sizes"),
        )  # fmt: skip
        if data["format"] != FORMAT:
            raise ValueError(f"{source}: format is {data['format']!r}, not {FORMAT!r}")
        if data["version"] != VERSION:
            raise ValueError(
                f"{source}: version {data['version']!r} is not {VERSION}: write it again with "
                "this cutpipe's recommend -o or partition -o"
            )
        layout = require_keys(data["layout"], f"{source}: layout", ("pp",))
        training = mapping(data.get("training", {}), f"{source}: training")
        schedule = data["schedule"]
        if isinstance(schedule, dict):
            schedule = loads(json.dumps(schedule), "json")
        elif not isinstance(schedule, str):
            raise ValueError(f"{source}: schedule must be a name or a schedule object")
        if not isinstance(data["model"], str):
            raise ValueError(f"{source}: model must be a name, got {data['model']!r}")
        recompute = training.get("recompute", "none")
        fp8 = training.get("fp8", False)
        if not isinstance(fp8, bool):
            raise ValueError(f"{source}: training.fp8 must be true or false, got {fp8!r}")
        sequence_parallel = training.get("sequence_parallel", True)
        if not isinstance(sequence_parallel, bool):
            raise ValueError(
                f"{source}: training.sequence_parallel must be true or false, got "
                f"{sequence_parallel!r}"
            )
        predicted = mapping(data.get("predicted", {}), f"{source}: predicted")
        return cls(
            model=data["model"],
            layers=whole(data["layers"], f"{source}: layers", 1),
            schedule=schedule,
            microbatches=whole(data["microbatches"], f"{source}: microbatches", 1),
            stage_sizes=tuple(
                whole(s, f"{source}: stage_sizes", 1)
                for s in listed(data["stage_sizes"], f"{source}: stage_sizes")
            ),
            pp=whole(layout.get("pp"), f"{source}: layout.pp", 1),
            dp=whole(layout.get("dp", 1), f"{source}: layout.dp", 1),
            ep=whole(layout.get("ep", 1), f"{source}: layout.ep", 1),
            tp=whole(layout.get("tp", 1), f"{source}: layout.tp", 1),
            cp=whole(layout.get("cp", 1), f"{source}: layout.cp", 1),
            zero=whole(training.get("zero", 0), f"{source}: training.zero"),
            recompute=recompute if isinstance(recompute, str) else repr(recompute),
            fp8=fp8,
            sequence_parallel=sequence_parallel,
            predicted={k: _plain(v, f"{source}: predicted.{k}") for k, v in predicted.items()},
        )

    def save(self, path: str | os.PathLike) -> None:
        write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> PlanFile:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"cannot read plan file {path}: {error.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"plan file {path} is not JSON: {error}") from None
        return cls.from_dict(data, str(path))


def _plain(value: Any, what: str) -> Any:
    """A predicted figure: a finite number, or a short text (the hardware's name)."""
    if isinstance(value, str):
        return value
    return finite(value, what)
