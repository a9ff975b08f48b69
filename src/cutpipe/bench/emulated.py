"""DualPipe and Cut-in-half in time emulation, through the trainer, beside the simulator.

Each run is ``cutpipe train --emulate --ep N``: every stage is one MoE layer whose route and
experts sleep for their cost and whose dispatch and combine are real all-to-alls on the EP group,
done no earlier than theirs (``cutpipe.parallel.emulated_moe``), so the overlap hook interleaves
real exchanges. The all-to-alls take half the compute (``COSTS``: F = 2, B = 4, W = 0 per
stage, 1 and 2 units of exchanges); with the hook an F&B pair should take its compute (6 units)
rather than compute plus exchanges (9). The simulator gets the same costs, and hides a pair's
exchanges exactly when the hook is on (``TrainOptions.simulated_costs``). The four runs take
their steps in rotating order; each keeps its median makespan. Beside the simulator fed the
nominal costs is the simulator fed every op's measured duration and the measured transfer
latency and per-op overhead (``cutpipe.sim.fit.replayed``): what the runtime adds per op shows
as the gap between the two, and a measured step close to the replay says it waited for nothing
the schedule does not ask for.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from cutpipe.sim.costs import Costs

#: Per stage: F, then the whole backward in its B, and all-to-alls as long as half of each.
COSTS = Costs(f=2, b=4, w=0, ep_f=1, ep_b=2)
#: The schedules with overlapped F&B pairs.
PAIRED = ("dualpipe", "dualpipev")


@dataclass(frozen=True)
class EmulatedStep:
    """One emulated run: its median step in cost units, measured and simulated."""

    schedule: str
    hook: bool
    measured: float  # makespan, cost units
    simulated: float
    bubble: float
    simulated_bubble: float
    replayed: float  # the simulator fed the measured op durations and delays

    @property
    def agreement(self) -> float:
        """The simulated step over the measured one (1: the runtime adds nothing)."""
        return self.simulated / self.measured

    @property
    def replay_agreement(self) -> float:
        """The replayed step over the measured one."""
        return self.replayed / self.measured

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "agreement": self.agreement,
            "replay_agreement": self.replay_agreement,
        }


def emulated_steps(setting: Any, rounds: int = 3) -> list[dict[str, Any]]:
    """Run the four emulated trainers on these processes (every rank calls it); rank 0 returns
    their steps (``EmulatedStep.to_dict``), the others an empty list."""
    import torch.distributed as dist

    from cutpipe.sim import metrics, simulate
    from cutpipe.sim.fit import measured_delays, replayed
    from cutpipe.train.options import TrainOptions
    from cutpipe.train.trainer import Trainer

    runs = [(name, hook) for name in PAIRED for hook in (True, False)]
    trainers = {}
    for name, hook in runs:
        options = TrainOptions.build(
            schedule=name, microbatches=setting.microbatches, ep=setting.ep,
            nproc=setting.processes, emulate=True, costs=COSTS, time_unit=setting.emulate_unit,
            no_overlap=not hook, steps=rounds + 1, quiet=True,
        )  # fmt: skip
        trainers[(name, hook)] = (Trainer(options), options)
    spans: dict[tuple[str, bool], list[Any]] = {run: [] for run in runs}
    for round_ in range(rounds + 1):  # the first round learns shapes
        shift = round_ % len(runs)
        for run in runs[shift:] + runs[:shift]:
            trainer = trainers[run][0]
            trainer.train_step()
            timeline = trainer.runner.timeline()
            if round_ and timeline is not None:
                spans[run].append(timeline)
    steps = []
    for run, (trainer, options) in trainers.items():
        trainer.close()
        if dist.get_rank() != 0:
            continue
        timelines = spans[run]
        makespans = [t.makespan for t in timelines]
        middle = timelines[makespans.index(statistics.median_low(makespans))]
        costs = options.simulated_costs
        expected = metrics(simulate(middle.schedule, costs), costs)
        unit = setting.emulate_unit
        steps.append(
            EmulatedStep(
                schedule=run[0], hook=run[1], measured=middle.makespan / unit,
                simulated=expected.makespan, bubble=metrics(middle, costs).bubble_ratio,
                simulated_bubble=expected.bubble_ratio,
                replayed=replayed(middle, measured_delays(middle)).makespan / unit,
            ).to_dict()
        )  # fmt: skip
    return steps


def render(steps: list[dict[str, Any]], title: str) -> Any:
    """A rich Table: each run's step measured beside the simulator's, hook on and off."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("schedule")
    table.add_column("hook")
    headers = ("step (units)\nmeasured | sim.", "sim. / measured", "replayed / measured",
               "bubble\nmeasured | sim.")  # fmt: skip
    for header in headers:
        table.add_column(header, justify="right")
    for step in steps:
        table.add_row(
            step["schedule"], "on" if step["hook"] else "off",
            f"{step['measured']:.1f} | {step['simulated']:.1f}", f"{step['agreement']:.3f}",
            f"{step['replay_agreement']:.3f}",
            f"{step['bubble']:.1%} | {step['simulated_bubble']:.1%}",
        )  # fmt: skip
    return table


def hook_ratios(steps: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per schedule: the step with the hook over the step without, measured and simulated."""
    by = {(s["schedule"], s["hook"]): s for s in steps}
    return {
        name: (
            by[(name, True)]["measured"] / by[(name, False)]["measured"],
            by[(name, True)]["simulated"] / by[(name, False)]["simulated"],
        )
        for name in PAIRED
        if (name, True) in by and (name, False) in by
    }
