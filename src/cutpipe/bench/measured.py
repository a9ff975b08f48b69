"""The MoE comparison run for real, through the trainer: local gloo processes, PP x EP.

Every schedule is a ``cutpipe.train.Trainer`` of the same small MoE (``bench-moe.yaml``, same seed,
same batches), built on the same processes: experts sharded over the EP group, stages as phases
with the overlap hook, Adam, the trainer's clipping and routing statistics, exactly what
``cutpipe train --ep`` runs. All trainers are built first and take their steps in rotating order,
round after round, so that the machine's noise falls on every schedule alike. Per schedule:

- throughput: the global batch over the median step time (the slowest rank's, as the trainer
  measures a step: data, pipeline, clipping, optimizer, routing statistics);
- peak memory per rank: parameters, gradients and Adam's state, plus the activation peak the
  trainer's meter saw (``cutpipe.bench.memory`` sets both beside the simulator's prediction);
- bubble: from the measured timeline of the median step, the idle share of the most idle rank;
- communication: the seconds a rank waited for all-to-alls (counted by the stages), over the
  step time, the most exposed rank.

DualPipeV also runs with its overlap hook switched off (the pair's halves one after the other),
side by side with the hooked run: the ratio of their step times is what the hook buys here. In
the same processes, ``cutpipe.bench.emulated`` times DualPipe and Cut-in-half in emulation.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from functools import cached_property
from importlib import resources
from typing import Any

from cutpipe.bench.report import LINEUP, Row
from cutpipe.schedule.registry import generate, schedule_info
from cutpipe.sim.metrics import p2p_sends
from cutpipe.spec import ModelSpec

#: The model the real runs train, shipped beside this module.
MODEL_FILE = "bench-moe.yaml"
HOOK_OFF = "dualpipev-no-hook"


def bench_model_file() -> str:
    """The path of the shipped ``bench-moe.yaml`` (the trainer reads a model file)."""
    return str(resources.files("cutpipe.bench") / MODEL_FILE)


@dataclass(frozen=True)
class RealSetting:
    """The local run: process layout, model file, microbatches per pipeline, measured steps."""

    pp: int = 2
    ep: int = 2
    microbatches: int = 8
    steps: int = 5
    schedules: tuple[str, ...] = LINEUP
    hook_off: bool = True  # also run DualPipeV without the overlap hook
    model_file: str = ""  # "" : the shipped bench-moe.yaml
    emulate_unit: float = 0.05  # seconds per cost unit of the emulated steps; 0: none

    @cached_property
    def model(self) -> ModelSpec:
        return ModelSpec.load(self.model_file or bench_model_file())

    @property
    def processes(self) -> int:
        return self.pp * self.ep

    @property
    def names(self) -> list[str]:
        """The runs: every schedule, then DualPipeV without the hook."""
        return list(self.schedules) + ([HOOK_OFF] if self.hook_off else [])

    def options(self, name: str) -> Any:
        """The trainer's options for the run ``name`` (a schedule, or ``HOOK_OFF``)."""
        from cutpipe.train.options import TrainOptions

        return TrainOptions.build(
            model=self.model_file or bench_model_file(), schedule=name.split("-")[0],
            microbatches=self.microbatches, ep=self.ep, nproc=self.processes,
            steps=self.steps + 1, no_overlap=name == HOOK_OFF,
            global_batch=self.ep * self.microbatches * self.model.microbatch_size, quiet=True, step_timeout=120.0,
        )  # fmt: skip

    def check(self) -> None:
        """A ValueError saying what to change, before any process starts."""
        from cutpipe.parallel.mesh import Layout

        Layout(self.pp, self.ep).check(
            self.processes, self.model.experts, self.model.top_k if self.model.moe else None
        )
        for name in self.schedules:
            generate(name, self.pp, self.microbatches)
        for name in self.names:
            self.options(name)
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    def to_dict(self) -> dict:
        data = asdict(self)
        data["model"] = asdict(self.model)
        return data


def bench_rank(rank: int, world: int, setting: RealSetting) -> dict[str, Any]:
    """One rank of the real runs (a spawned process): its figures for every run, the memory
    beside the simulator's, and (rank 0) the emulated steps."""
    import torch
    import torch.distributed as dist

    from cutpipe.bench.emulated import emulated_steps
    from cutpipe.bench.memory import rank_memory
    from cutpipe.train.trainer import Trainer

    names = setting.names
    trainers = {name: Trainer(setting.options(name)) for name in names}

    def step(name: str) -> tuple[float, float, float]:
        trainer = trainers[name]
        for stage in trainer.parallel.stages.values():
            stage.exposed_comm = 0.0
        (record,) = trainer.train_step()
        waited = sum(stage.exposed_comm for stage in trainer.parallel.stages.values())
        return record.step_time, waited / record.step_time, record.bubble or 0.0

    figures: dict[str, dict[str, list[float]]] = {
        name: {"seconds": [], "waited": [], "bubbles": []} for name in names
    }
    for name in names:  # learn shapes, create Adam's state
        step(name)
    for round_ in range(setting.steps):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            slowest = torch.tensor(step(name), dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            for key, value in zip(("seconds", "waited", "bubbles"), slowest.tolist(), strict=True):
                figures[name][key].append(value)
    results: dict[str, Any] = {}
    for name in names:
        trainer = trainers[name]
        seconds = figures[name]["seconds"]
        median = statistics.median(seconds)
        middle = seconds.index(min(seconds, key=lambda s: abs(s - median)))
        results[name] = {
            "seconds": seconds,
            "median": median,
            "bubble": figures[name]["bubbles"][middle],
            "comm": statistics.median(figures[name]["waited"]),
            "memory": rank_memory(trainer),  # of the last step, a collective
            "stage_sizes": list(trainer.layout.stage_sizes),
        }
        trainer.close()
    emulated = emulated_steps(setting) if setting.emulate_unit > 0 else []
    return {"runs": results, "emulated": emulated}


def rows_from(results: list[dict[str, Any]], setting: RealSetting) -> list[Row]:
    """One Row per run from every rank's results (memory: the rank with the largest)."""
    batch = setting.ep * setting.microbatches * setting.model.microbatch_size  # all pipelines
    runs = [result["runs"] for result in results]
    baseline = p2p_sends(generate("1f1b", setting.pp, setting.microbatches))
    rows = []
    for name, figures in runs[0].items():
        schedule_name = name.split("-")[0]
        schedule = generate(schedule_name, setting.pp, setting.microbatches)
        parts = [rank[name]["memory"]["measured"] for rank in runs]
        totals = [sum(part.values()) for part in parts]
        peak = max(range(len(runs)), key=totals.__getitem__)
        stored = sum(len(schedule.placement.stages_of(r)) for r in range(setting.pp))
        title = schedule_info(schedule_name).title + (" (hook off)" if name == HOOK_OFF else "")
        rows.append(
            Row(
                schedule=name,
                title=title,
                throughput=batch / figures["median"],
                memory=totals[peak],
                bubble=figures["bubble"],
                comm=figures["comm"],
                memory_parts=dict(parts[peak]),
                memory_per_rank=totals,
                params_x=stored / schedule.num_stages,
                pp_traffic_x=p2p_sends(schedule) / baseline,
                note=f"median step {figures['median'] * 1e3:.1f} ms, "
                f"stages {figures['stage_sizes']}",
            )
        )
    return rows


@dataclass(frozen=True)
class RealResults:
    """What the real runs measured: the rows, the hook's step ratio, the memory beside the
    simulator's, the emulated steps beside the simulator's."""

    rows: list[Row]
    hook_ratio: float
    memory: list[Any]  # cutpipe.bench.memory.MemoryRow
    emulated: list[Any]  # cutpipe.bench.emulated.EmulatedStep


def run_real(setting: RealSetting, timeout: float = 600.0) -> RealResults:
    """Launch the processes; the rows, the hook's step-time ratio (with / without), the memory
    table and the emulated steps."""
    from cutpipe.bench.memory import memory_rows
    from cutpipe.launch.local import LaunchError, spawn

    setting.check()
    outcomes = spawn(bench_rank, setting.processes, (setting,), timeout=timeout)
    if not all(outcome.ok for outcome in outcomes):
        raise RuntimeError(str(LaunchError(outcomes)))
    results = [outcome.result for outcome in outcomes]
    first = results[0]["runs"]
    ratio = (
        first["dualpipev"]["median"] / first[HOOK_OFF]["median"]
        if "dualpipev" in first and HOOK_OFF in first
        else float("nan")
    )
    return RealResults(
        rows_from(results, setting), ratio, memory_rows(results), results[0]["emulated"]
    )
