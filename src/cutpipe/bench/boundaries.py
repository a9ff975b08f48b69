"""Step boundaries measured: the time per step of many steps with the optimizer step synchronous
or overlapped (``PipelineRunner(step_boundary=...)``), on local gloo processes.

Each schedule runs ``steps`` steps with each boundary, the two in alternating rounds so that the
machine's noise falls on both alike. A rank notes when each of its steps returns
(``time.perf_counter``, one clock for every process of a machine); a step of the pipeline ends
when its last rank's does, and the steady-state time per step is the median interval between
those ends, over every round, once the first steps have filled the pipeline. Emulated runs sleep for the costs
(tiny tensors flow); real runs train an MLP with AdamW, clipped by the global norm.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from cutpipe.schedule.registry import generate
from cutpipe.sim.costs import Costs
from cutpipe.sim.steps import BOUNDARIES


@dataclass(frozen=True)
class BoundarySetting:
    """Attributes:
    schedules: the schedules measured.
    ranks, microbatches, steps: the shape of each run.
    rounds: runs of each boundary, alternating.
    costs: per linear stage (a V stage costs half); emulated runs sleep ``unit`` seconds per unit.
    width: 0: emulate; otherwise a real MLP of this width, ``blocks`` blocks, batch ``rows``
        rows per microbatch.
    max_norm: the clipping norm (every step gathers the global norm: that is what ``sync`` waits
        for).
    """

    schedules: tuple[str, ...] = ("zbv", "dualpipev")
    ranks: int = 4
    microbatches: int = 8
    steps: int = 10
    rounds: int = 2
    costs: Costs = field(default_factory=lambda: Costs(f=1, b=1, w=1))
    unit: float = 0.01
    width: int = 0
    blocks: int = 16
    rows: int = 4
    max_norm: float = 1e9

    def stage_costs(self, schedule_name: str) -> Costs:
        schedule = generate(schedule_name, self.ranks, self.microbatches)
        return self.costs.scaled(0.5 if schedule.placement.kind == "v" else 1)


def _runner(name: str, setting: BoundarySetting, boundary: str) -> tuple[Any, Any, tuple]:
    """A runner for one run, its optimizer (None when emulated) and the batch of every step."""
    import torch
    from torch import nn

    from cutpipe.models import mlp
    from cutpipe.runtime import PipelineRunner

    schedule = generate(name, setting.ranks, setting.microbatches)
    options = {"step_boundary": boundary, "clip_grad_norm": setting.max_norm}
    if not setting.width:
        runner = PipelineRunner(
            schedule, None, emulate=setting.stage_costs(name), time_unit=setting.unit, **options
        )
        return runner, None, ()
    model = mlp(blocks=setting.blocks, width=setting.width, seed=0)
    runner = PipelineRunner.from_sequential(schedule, model, nn.MSELoss(), **options)
    optimizer = torch.optim.AdamW(runner.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    rows = setting.rows * setting.microbatches
    batch = (
        torch.randn(rows, setting.width, generator=generator),
        torch.randn(rows, setting.width, generator=generator),
    )
    return runner, optimizer, batch


def measure_rank(rank: int, world: int, setting: BoundarySetting) -> dict[str, Any]:
    """This rank's step end times: by schedule, by boundary, one list per round."""
    ends: dict[str, dict[str, list[list[float]]]] = {}
    for name in setting.schedules:
        ends[name] = {boundary: [] for boundary in BOUNDARIES}
        for _ in range(setting.rounds):
            for boundary in BOUNDARIES:
                runner, optimizer, batch = _runner(name, setting, boundary)
                times = []
                for _ in range(setting.steps):
                    runner.step(*batch, optimizer=optimizer)
                    times.append(time.perf_counter())
                runner.settle()
                runner.close()
                ends[name][boundary].append(times)
    return ends


def step_gaps(ends_by_rank: list[list[float]], skip: int = 2) -> list[float]:
    """The intervals between the pipeline's step ends (each its last rank's), after the first
    ``skip`` steps."""
    done = [max(ends[k] for ends in ends_by_rank) for k in range(len(ends_by_rank[0]))]
    return [later - earlier for earlier, later in itertools.pairwise(done)][skip:]


def measured_steps(ranks: list[dict[str, Any]], setting: BoundarySetting) -> dict[str, dict]:
    """Per schedule: the steady-state step of each boundary (seconds; the median interval of
    every round) and their ratio, overlap over sync."""
    report: dict[str, dict] = {}
    for name in setting.schedules:
        steps = {
            boundary: statistics.median(
                gap
                for i in range(setting.rounds)
                for gap in step_gaps([rank[name][boundary][i] for rank in ranks])
            )
            for boundary in BOUNDARIES
        }
        report[name] = {**steps, "ratio": steps["overlap"] / steps["sync"]}
    return report
