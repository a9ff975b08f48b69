"""cutpipe's runtime against torch.distributed.pipelining on the same model, side by side.

Two ranks (gloo, one thread each), 16 blocks of Linear(width) + tanh, batch 128, 16 microbatches,
MSE loss summed over microbatches and kept on the rank that computes it (as torch does). For
each of 1F1B, DualPipeV and ZB-V, cutpipe's
``PipelineRunner`` and torch's ``Schedule1F1B`` / ``ScheduleDualPipeV`` / ``ScheduleZBVZeroBubble``
run in one process group, in alternating rounds; each step is timed between barriers and the
median over ``--steps`` rounds is reported, with the ratio cutpipe / torch.

    python benchmarks/runtime_vs_torch.py [--width 128] [--steps 15]
    python benchmarks/runtime_vs_torch.py --width 1024          # compute-heavy
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from cutpipe import generate
from cutpipe.launch import run
from cutpipe.models import mlp
from cutpipe.runtime import PipelineRunner

BLOCKS, BATCH, MICROBATCHES = 16, 128, 16


TORCH_SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "dualpipev": "ScheduleDualPipeV",
    "zbv": "ScheduleZBVZeroBubble",
}


def _chunks(model: nn.Sequential, stages: int) -> list[nn.Sequential]:
    per = len(model) // stages
    return [nn.Sequential(*list(model)[s * per : (s + 1) * per]) for s in range(stages)]


def torch_step_fn(name: str, rank: int, world: int, width: int):
    from torch.distributed import pipelining

    model = mlp(BLOCKS, width, seed=1)
    loss_fn = nn.MSELoss()
    device = torch.device("cpu")
    if name == "1f1b":
        chunks = _chunks(model, world)
        stages = [pipelining.PipelineStage(chunks[rank], rank, world, device)]
    else:
        chunks = _chunks(model, 2 * world)
        stages = [
            pipelining.PipelineStage(chunks[s], s, 2 * world, device)
            for s in (rank, 2 * world - 1 - rank)
        ]
    schedule_class = getattr(pipelining, TORCH_SCHEDULES[name])
    schedule = schedule_class(
        stages[0] if name == "1f1b" else stages, MICROBATCHES, loss_fn=loss_fn, scale_grads=False
    )
    parameters = [p for s in stages for p in s.submod.parameters()]
    holds_first = any(s.is_first for s in stages)
    holds_last = any(s.is_last for s in stages)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        for p in parameters:
            p.grad = None
        args = (x,) if holds_first else ()
        kwargs = {"target": y} if holds_last else {}
        schedule.step(*args, **kwargs)

    return step


def cutpipe_step_fn(name: str, rank: int, world: int, width: int):
    model = mlp(BLOCKS, width, seed=1)
    schedule = generate(name, world, MICROBATCHES)
    # like torch's schedules, keep the loss on the rank that computes it (no extra all-reduce)
    runner = PipelineRunner.from_sequential(
        schedule, model, nn.MSELoss(), loss_on_every_rank=False, loss_reduction="sum"
    )
    parameters = runner.parameters()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        for p in parameters:
            p.grad = None
        runner.step(x, y)

    return step


def benchmark(rank: int, world: int, width: int, steps: int, warmup: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, width, generator=generator)
    y = torch.randn(BATCH, width, generator=generator)
    contenders = {}
    for name in TORCH_SCHEDULES:
        contenders[("cutpipe", name)] = cutpipe_step_fn(name, rank, world, width)
        contenders[("torch", name)] = torch_step_fn(name, rank, world, width)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in contenders}
    for round_ in range(warmup + steps):
        for key, step in contenders.items():
            dist.barrier()
            start = time.perf_counter()
            step(copy.copy(x), copy.copy(y))
            dist.barrier()
            if round_ >= warmup:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(samples) for key, samples in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=15, help="timed rounds (median of these)")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    medians = run(benchmark, 2, (args.width, args.steps, args.warmup), timeout=1800)[0]

    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"2 ranks, {BLOCKS} x Linear({args.width})+tanh, batch {BATCH}, {MICROBATCHES} "
        f"microbatches: median of {args.steps} steps"
    )
    for column in ("schedule", "cutpipe ms", "torch ms", "cutpipe / torch"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for name in TORCH_SCHEDULES:
        ours, theirs = medians[("cutpipe", name)], medians[("torch", name)]
        table.add_row(name, f"{ours * 1e3:.1f}", f"{theirs * 1e3:.1f}", f"{ours / theirs:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
