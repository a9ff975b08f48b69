"""Runtime overhead: microseconds per op per rank of zero-compute steps, cutpipe against torch.

Every stage is one Linear(4, 4) and every microbatch two rows, so an op's compute is a few
microseconds and a step's time is the runtime's own work: deciding what runs next, posting and
matching transfers, autograd bookkeeping. cutpipe's ``PipelineRunner`` and torch's
``Schedule1F1B`` / ``ScheduleDualPipeV`` / ``ScheduleZBVZeroBubble`` run the same schedules in one
process group (gloo, one thread per rank), in alternating rounds, each step timed between
barriers; the median step divided by the ops a rank runs (an overlapped pair counts as its two
halves) gives microseconds per op.

    python benchmarks/overhead.py [--ranks 2 4] [--microbatches 16] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from cutpipe import generate
from cutpipe.runtime import PipelineRunner, run

WIDTH, ROWS = 4, 2
TORCH_SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "dualpipev": "ScheduleDualPipeV",
    "zbv": "ScheduleZBVZeroBubble",
}


def stage_module(stage: int) -> nn.Module:
    torch.manual_seed(stage)
    return nn.Linear(WIDTH, WIDTH)


def ops_per_rank(name: str, world: int, microbatches: int, rank: int) -> int:
    """Compute ops this rank runs: an overlapped pair is its forward and its backward."""
    codes = generate(name, world, microbatches).codes[rank]
    return sum(2 if code < 0 else 1 for code in codes)


def torch_step_fn(name: str, rank: int, world: int, microbatches: int):
    from torch.distributed import pipelining

    stages_total = world if name == "1f1b" else 2 * world
    held = [rank] if name == "1f1b" else [rank, 2 * world - 1 - rank]
    stages = [
        pipelining.PipelineStage(stage_module(s), s, stages_total, torch.device("cpu"))
        for s in held
    ]
    schedule_class = getattr(pipelining, TORCH_SCHEDULES[name])
    schedule = schedule_class(
        stages[0] if name == "1f1b" else stages, microbatches, loss_fn=nn.MSELoss()
    )
    holds_first = any(s.is_first for s in stages)
    holds_last = any(s.is_last for s in stages)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        args = (x,) if holds_first else ()
        kwargs = {"target": y} if holds_last else {}
        schedule.step(*args, **kwargs)

    return step


def cutpipe_step_fn(name: str, rank: int, world: int, microbatches: int):
    schedule = generate(name, world, microbatches)
    stages = {s: stage_module(s) for s in schedule.placement.stages_of(rank)}
    # like torch's schedules, keep the loss on the rank that computes it
    runner = PipelineRunner(schedule, stages, nn.MSELoss(), loss_on_every_rank=False)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        runner.step(x, y)

    return step


def benchmark(rank: int, world: int, microbatches: int, steps: int, warmup: int) -> dict:
    x = torch.randn(ROWS * microbatches, WIDTH)
    y = torch.randn(ROWS * microbatches, WIDTH)
    contenders = {}
    for name in TORCH_SCHEDULES:
        contenders[("cutpipe", name)] = cutpipe_step_fn(name, rank, world, microbatches)
        contenders[("torch", name)] = torch_step_fn(name, rank, world, microbatches)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in contenders}
    for round_ in range(warmup + steps):
        for key, step in contenders.items():
            dist.barrier()
            start = time.perf_counter()
            step(x, y)
            dist.barrier()
            if round_ >= warmup:
                times[key].append(time.perf_counter() - start)
    return {
        "medians": {key: statistics.median(samples) for key, samples in times.items()},
        "ops": {name: ops_per_rank(name, world, microbatches, rank) for name in TORCH_SCHEDULES},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="timed rounds (median of these)")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"zero-compute steps (Linear({WIDTH}) stages, {ROWS} rows per microbatch), "
        f"{args.microbatches} microbatches, gloo: median of {args.steps} steps"
    )
    for column in ("schedule", "ranks", "ops/rank", "cutpipe us/op", "torch us/op", "ratio"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for world in args.ranks:
        results = run(benchmark, world, (args.microbatches, args.steps, args.warmup), timeout=1800)
        for name in TORCH_SCHEDULES:
            # the step ends when its slowest rank does: per op of the rank with the most ops
            ops = max(r["ops"][name] for r in results)
            ours = results[0]["medians"][("cutpipe", name)] / ops
            theirs = results[0]["medians"][("torch", name)] / ops
            table.add_row(name, str(world), str(ops), f"{ours * 1e6:.0f}", f"{theirs * 1e6:.0f}",
                          f"{ours / theirs:.2f}x")  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
