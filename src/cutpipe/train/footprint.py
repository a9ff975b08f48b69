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
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cutpipe.spec import ModelSpec

if TYPE_CHECKING:
    from cutpipe.sim.costs import Costs
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
    """The run's footprint per pipeline rank (``layout`` from ``run_layout``): each stage's
    parameters and state summed over the stages a rank stores, and the activations its
    schedule keeps at once (``cutpipe.sim.memory.peak_activations``)."""
    from cutpipe.sim.costs import Costs
    from cutpipe.sim.memory import peak_activations

    schedule, sizes = layout.schedule, list(layout.stage_sizes)
    per_microbatch = layout.batch // (layout.replicas * schedule.num_microbatches)
    spec = getattr(task, "spec", None)
    if isinstance(spec, ModelSpec):
        costs, state = _transformer_stages(spec, sizes, options, per_microbatch)
    else:  # the example MLP: alike blocks, each keeping its input and output
        width = spec.width  # type: ignore[union-attr]
        parameters = [size * (width + 1) * width for size in sizes]
        kept = [4.0 * per_microbatch * width * 2 * size for size in sizes]
        costs = Costs(activation=kept, params=[float(p) for p in parameters])
        state = [STATE_BYTES * p for p in parameters]
    placement = schedule.placement

    def on_ranks(per_stage: list[float]) -> list[float]:
        return [
            sum(per_stage[s] for s in placement.stages_of(r)) for r in range(schedule.num_ranks)
        ]

    parameters = costs.per_stage("params", schedule.num_stages)
    return Footprint(
        on_ranks(state), peak_activations(schedule, costs), on_ranks(parameters), layout.replicas
    )


def _transformer_stages(
    spec: ModelSpec, sizes: list[int], options: TrainOptions, per_microbatch: int
) -> tuple[Costs, list[float]]:
    """The planner's per-stage costs of ``spec`` cut into ``sizes`` for the run's microbatch,
    and each stage's training-state bytes (the cost model's 16 per parameter, mixed precision's
    and fp32 AdamW's alike, sharded as ZeRO's stage says)."""
    from cutpipe.plan.costs.model import Training, gpu, model_items, w_memory
    from cutpipe.plan.partition import stage_costs, stage_state_bytes

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
    return stage_costs(items, sizes, 0.0, w_memory(sized)), stage_state_bytes(items, sizes)


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
    kib = _kernel_figure(meminfo, "MemAvailable:")
    return None if kib is None else float(kib) * 1024


def oom_kills(vmstat: str = "/proc/vmstat") -> int | None:
    """Processes the kernel's out-of-memory killer has ended since boot (None: not said)."""
    return _kernel_figure(vmstat, "oom_kill")


def _kernel_figure(path: str, name: str) -> int | None:
    """The number after ``name`` on its line of a ``/proc`` file (None: no file, no line)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        words = line.split()
        if len(words) > 1 and words[0] == name:
            return int(words[1])
    return None
