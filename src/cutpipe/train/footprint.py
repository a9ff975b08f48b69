"""How much memory a run's processes need, estimated before any of them starts.

Each rank builds only the blocks of its stages (``cutpipe.models.transformer.language_model``
lays the rest out on the meta device), so a process holds its stages' weights, gradients and
AdamW state (16 bytes per parameter, sharded as ``--dp-mode`` says) and the activations its
schedule keeps at its peak (the simulator's live-memory count, ``cutpipe.sim.memory``, fed the
planner's per-block activation bytes for the run's microbatch), plus what a process with torch
loaded takes. The launcher refuses a run that cannot fit, with the figures and the cheapest
change that makes it fit; and when the kernel's out-of-memory killer ends a worker anyway, it
says so with the estimate (``oom_kills``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cutpipe.spec import ModelSpec

if TYPE_CHECKING:
    from cutpipe.train.layout import RunLayout
    from cutpipe.train.options import TrainOptions
    from cutpipe.train.tasks import Task

GIB = 2**30
#: What a worker process takes before any model: Python, torch and the process group.
PROCESS_BYTES = 0.5 * GIB
#: fp32 weights and gradients plus AdamW's two moments, per parameter.
STATE_BYTES = 16
#: ZeRO stage the planner's cost model prices for each data-parallel mode.
ZERO_OF_MODE = {"allreduce": 0, "zero1": 1, "fsdp": 3}


@dataclass(frozen=True)
class Footprint:
    """Bytes each pipeline rank's process needs: its training state and peak activations."""

    state: list[float]
    activations: list[float]
    parameters: list[float]  # held by each rank (a mirrored stage counts twice)
    replicas: int  # processes that hold each pipeline rank's share (DP x EP)

    def per_process(self, rank: int) -> float:
        return self.state[rank] + self.activations[rank] + PROCESS_BYTES

    @property
    def busiest(self) -> int:
        return max(range(len(self.state)), key=self.per_process)

    def on_machine(self, processes: int, nnodes: int) -> float:
        """Bytes the ``processes`` of one machine need: all of them on one machine, else (the
        machines' shares are not known before they meet) that many of the busiest."""
        if nnodes == 1:
            return self.replicas * sum(map(self.per_process, range(len(self.state))))
        return processes * self.per_process(self.busiest)

    def describe(self, rank: int) -> str:
        return (
            f"{_gib(self.state[rank])} of weights, gradients and AdamW state for "
            f"{self.parameters[rank] / 1e6:,.1f} M parameters, {_gib(self.activations[rank])} of "
            f"activations at the schedule's peak and {_gib(PROCESS_BYTES)} for the process"
        )


def estimate(task: Task, layout: RunLayout, options: TrainOptions) -> Footprint:
    """The run's footprint per pipeline rank (``layout`` from ``run_layout``)."""
    schedule, sizes = layout.schedule, list(layout.stage_sizes)
    per_microbatch = layout.batch // (layout.replicas * schedule.num_microbatches)
    spec = getattr(task, "spec", None)
    if isinstance(spec, ModelSpec):
        state, activations, parameters = _transformer(spec, layout, options, per_microbatch)
    else:  # the example MLP: its blocks are alike
        width = spec.width  # type: ignore[union-attr]
        block = (width + 1) * width
        stage_parameters = [size * block for size in sizes]
        state = [STATE_BYTES * p for p in stage_parameters]
        activations = [4.0 * per_microbatch * width * 2 * size for size in sizes]
        parameters = stage_parameters
        state, activations, parameters = _per_rank(layout, state, activations, parameters)
    return Footprint(state, activations, parameters, layout.replicas)


def _transformer(
    spec: ModelSpec, layout: RunLayout, options: TrainOptions, per_microbatch: int
) -> tuple[list[float], list[float], list[float]]:
    from cutpipe.plan.costs.model import Training, gpu, model_items, w_memory
    from cutpipe.plan.partition import stage_costs
    from cutpipe.sim.memory import peak_activations

    # activations as the run keeps them: fp32, or bf16 under autocast
    sized = dataclasses.replace(
        spec, microbatch_size=max(1, per_microbatch),
        dtype="bf16" if options.dtype == "bf16" else "fp32",
    )  # fmt: skip
    training = Training(
        zero=ZERO_OF_MODE[options.dp_mode], dp=options.dp * options.ep,
        recompute=options.recompute,
    )  # fmt: skip
    items = model_items(sized, gpu("H100"), ep=options.ep, training=training)
    sizes = list(layout.stage_sizes)
    costs = stage_costs(items, sizes, 0.0, w_memory(sized))
    starts = [0, *itertools.accumulate(sizes)]
    stage_parameters, stage_state = [], []
    for s, size in enumerate(sizes):
        part = items[starts[s] : starts[s] + size]
        stage_parameters.append(sum(i.parameters for i in part))
        # the cost model counts mixed precision's 16 bytes; fp32 weights, gradients and AdamW
        # take 16 too, sharded as ZeRO's stage says
        stage_state.append(sum(i.state_bytes for i in part))
    activations = peak_activations(layout.schedule, costs)
    state, _, parameters = _per_rank(layout, stage_state, [0.0] * len(sizes), stage_parameters)
    return state, activations, parameters


def _per_rank(
    layout: RunLayout, state: list[float], activations: list[float], parameters: list[float]
) -> tuple[list[float], list[float], list[float]]:
    """Stage figures summed over each rank's stages (activations: the peak of a stage's)."""
    placement = layout.schedule.placement
    ranks = range(layout.schedule.num_ranks)
    return (
        [sum(state[s] for s in placement.stages_of(r)) for r in ranks],
        [sum(activations[s] for s in placement.stages_of(r)) for r in ranks],
        [sum(parameters[s] for s in placement.stages_of(r)) for r in ranks],
    )


def _gib(count: float) -> str:
    return f"{count / GIB:,.2f} GiB" if count < 10 * GIB else f"{count / GIB:,.0f} GiB"


def check_host_memory(task: Task, layout: RunLayout, options: TrainOptions) -> Footprint:
    """Refuse (one line) a CPU run whose processes on this machine would need more memory than
    it has available, with the figures and the cheapest change that fits; the footprint."""
    footprint = estimate(task, layout, options)
    available = available_memory()
    processes, nnodes = options.nproc or 1, options.nnodes
    needed = footprint.on_machine(processes, nnodes)
    if available is None or needed <= available:
        return footprint
    rank = footprint.busiest
    raise ValueError(
        f"{task.name} does not fit: the {processes} processes need about {_gib(needed)} and this "
        f"machine has {_gib(available)} available (pipeline rank {rank}'s process: "
        f"{footprint.describe(rank)}); {_cheapest(task, layout, options, needed, available)}"
    )


def _cheapest(
    task: Task, layout: RunLayout, options: TrainOptions, needed: float, available: float
) -> str:
    """The cheapest change that fits: recompute (time), sharding (traffic), then machines."""
    tries = []
    if options.recompute != "full" and isinstance(getattr(task, "spec", None), ModelSpec):
        tries.append(("--recompute full", options.replace(recompute="full")))
    if options.dp > 1 and options.dp_mode != "fsdp":
        tries.append(("--dp-mode fsdp", options.replace(dp_mode="fsdp")))
    for flag, changed in tries:
        got = estimate(task, layout, changed).on_machine(options.nproc or 1, options.nnodes)
        if got <= available:
            return f"{flag} brings it to about {_gib(got)}"
    machines = math.ceil(needed / available) * options.nnodes
    return (
        f"spread it over about {machines} machines like this one (--nnodes {machines}), or "
        "train a smaller model"
    )


def available_memory(meminfo: str = "/proc/meminfo") -> float | None:
    """Bytes of memory the kernel says are available (None where it does not say)."""
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024
    return None


def oom_kills(vmstat: str = "/proc/vmstat") -> int | None:
    """Processes the kernel's out-of-memory killer has ended since boot (None: not said)."""
    try:
        text = Path(vmstat).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill":
            return int(value)
    return None
