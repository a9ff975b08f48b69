"""Runtime overhead: microseconds per op per rank of zero-compute steps, cutpipe against torch.

Every stage is one Linear(4, 4) and every microbatch two rows, so an op's compute is a few
microseconds and a step's time is the runtime's own work: deciding what runs next, posting and
matching transfers, autograd bookkeeping. cutpipe's ``PipelineRunner`` and torch's
``Schedule1F1B`` / ``ScheduleDualPipeV`` / ``ScheduleZBVZeroBubble`` run the same schedules in one
process group (gloo, one thread per rank), in alternating rounds, each step timed between
barriers; the median step divided by the ops a rank runs (an overlapped pair counts as its two
halves) gives microseconds per op. Two more contenders bound what a runtime could save:
``transfers`` makes only the schedule's transfers (each op's receive, waited for, then its send,
in the rank's order), with no compute and no autograd; ``bare`` adds each op's compute with
plain autograd calls (an F, its loss on the last stage, a backward through ``torch.autograd``,
a B and a W as two ``torch.autograd.grad`` calls) and no runner: no validation, no watchdog,
no agreement, no bookkeeping.

    python benchmarks/overhead.py [--ranks 2 4] [--microbatches 16] [--steps 30]
    python benchmarks/overhead.py --profile 1f1b [--ranks 2]   # where cutpipe's step goes
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from cutpipe import generate
from cutpipe.launch import run
from cutpipe.runtime import PipelineRunner
from cutpipe.schedule.codes import BW_CODE, F_CODE, W_CODE, Codec

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


def transfer_plan(name: str, rank: int, world: int, microbatches: int):
    """Per op of this rank (each half of an overlapped pair): (kind, stage, microbatch, the rank
    its input comes from or None, the input's tag, the rank its output goes to or None, the
    output's tag)."""
    schedule = generate(name, world, microbatches)
    flow = schedule.dataflow
    codec = Codec(schedule.num_stages, microbatches)
    plan = []
    for code in schedule.codes[rank]:
        for half in codec.split_pair(code) if code < 0 else (code,):
            kind, stage, mb = flow.unpack(half)
            source, destination = flow.source(kind, stage, mb), flow.destination(kind, stage, mb)
            tag_in = flow.value(flow.awaits(half)) if source is not None else 0
            tag_out = flow.value(flow.makes(half)) if destination is not None else 0
            plan.append((kind, stage, mb, source, tag_in, destination, tag_out))
    return schedule, plan


def bare_step_fn(name: str, rank: int, world: int, microbatches: int):
    """The schedule's ops as plain autograd calls, and its transfers, and nothing else."""
    schedule, plan = transfer_plan(name, rank, world, microbatches)
    last = schedule.num_stages - 1
    modules = {s: stage_module(s) for s in schedule.placement.stages_of(rank)}
    weights = {s: list(module.parameters()) for s, module in modules.items()}
    loss_fn = nn.MSELoss()

    def accumulate(stage: int, grads) -> None:
        for weight, grad in zip(weights[stage], grads, strict=True):
            weight.grad = grad if weight.grad is None else weight.grad + grad

    def receive(source: int, tag: int) -> torch.Tensor:
        tensor = torch.empty(ROWS, WIDTH)
        dist.irecv(tensor, source, tag=tag).wait()
        return tensor

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        xs, ys = x.chunk(microbatches), y.chunk(microbatches)
        saved, input_grads, deferred, sent = {}, {}, {}, []
        for kind, stage, mb, source, tag_in, destination, tag_out in plan:
            if kind == F_CODE:
                if stage == 0:
                    held = xs[mb]
                elif source is None:  # the stage before is on this rank
                    held = saved[(stage - 1, mb)][1].detach().requires_grad_()
                else:
                    held = receive(source, tag_in).requires_grad_()
                out = modules[stage](held)
                saved[(stage, mb)] = (held, loss_fn(out, ys[mb]) if stage == last else out)
                if destination is not None:
                    sent.append(dist.isend(out.detach(), destination, tag=tag_out))
                continue
            if kind == W_CODE:
                out, grad = deferred.pop((stage, mb))
                accumulate(stage, torch.autograd.grad(out, weights[stage], grad))
                continue
            if stage == last:
                grad = None  # the loss
            elif source is None:
                grad = input_grads.pop((stage + 1, mb))
            else:
                grad = receive(source, tag_in)
            held, out = saved.pop((stage, mb))
            if kind == BW_CODE:
                wanted = weights[stage] + ([held] if stage else [])
                grads = torch.autograd.grad(out, wanted, grad)
                accumulate(stage, grads[: len(weights[stage])])
                input_grad = grads[-1] if stage else None
            else:  # B: the input's gradient now, the weights' at its W
                input_grad = (
                    torch.autograd.grad(out, held, grad, retain_graph=True)[0] if stage else None
                )
                deferred[(stage, mb)] = (out, grad)
            if destination is not None:
                sent.append(dist.isend(input_grad, destination, tag=tag_out))
            elif stage:
                input_grads[(stage, mb)] = input_grad
        for work in sent:
            work.wait()

    return step


def transfers_step_fn(name: str, rank: int, world: int, microbatches: int):
    """The schedule's point-to-point transfers alone, in this rank's op order: before each op
    its input is received (if it comes from another rank), after it its output is sent."""
    _, plan = transfer_plan(name, rank, world, microbatches)
    inbox, outbox = torch.zeros(ROWS, WIDTH), torch.zeros(ROWS, WIDTH)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        sent = []
        for _, _, _, source, tag_in, destination, tag_out in plan:
            if source is not None:
                dist.irecv(inbox, source, tag=tag_in).wait()
            if destination is not None:
                sent.append(dist.isend(outbox, destination, tag=tag_out))
        for work in sent:
            work.wait()

    return step


def benchmark(rank: int, world: int, microbatches: int, steps: int, warmup: int) -> dict:
    x = torch.randn(ROWS * microbatches, WIDTH)
    y = torch.randn(ROWS * microbatches, WIDTH)
    contenders = {}
    for name in TORCH_SCHEDULES:
        contenders[("cutpipe", name)] = cutpipe_step_fn(name, rank, world, microbatches)
        contenders[("torch", name)] = torch_step_fn(name, rank, world, microbatches)
        contenders[("bare", name)] = bare_step_fn(name, rank, world, microbatches)
        contenders[("transfers", name)] = transfers_step_fn(name, rank, world, microbatches)
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


def profile(rank: int, world: int, name: str, microbatches: int, steps: int) -> str | None:
    """cProfile's busiest calls of ``steps`` cutpipe steps on rank 0, by their own time."""
    x = torch.randn(ROWS * microbatches, WIDTH)
    y = torch.randn(ROWS * microbatches, WIDTH)
    step = cutpipe_step_fn(name, rank, world, microbatches)
    for _ in range(3):
        step(x, y)
    dist.barrier()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step(x, y)
    profiler.disable()
    elapsed = (time.perf_counter() - start) / steps
    if rank != 0:
        return None
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    return f"{name}, {world} ranks: {elapsed * 1e3:.2f} ms per step (profiled)\n{out.getvalue()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="timed rounds (median of these)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", choices=sorted(TORCH_SCHEDULES),
                        help="profile cutpipe's steps of this schedule instead")  # fmt: skip
    args = parser.parse_args()
    if args.profile:
        for world in args.ranks:
            found = run(profile, world, (args.profile, args.microbatches, args.steps), timeout=600)
            print(found[0])
        return

    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"microseconds per op of zero-compute steps (Linear({WIDTH}) stages, {ROWS} rows "
        "per microbatch), "
        f"{args.microbatches} microbatches, gloo: median of {args.steps} steps"
    )
    columns = ("schedule", "ranks", "ops/rank", "cutpipe", "torch", "cutpipe/torch", "bare",
               "bare/torch", "transfers", "transfers/torch")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for world in args.ranks:
        results = run(benchmark, world, (args.microbatches, args.steps, args.warmup), timeout=1800)
        for name in TORCH_SCHEDULES:
            # the step ends when its slowest rank does: per op of the rank with the most ops
            ops = max(r["ops"][name] for r in results)
            ours = results[0]["medians"][("cutpipe", name)] / ops
            theirs = results[0]["medians"][("torch", name)] / ops
            bare = results[0]["medians"][("bare", name)] / ops
            floor = results[0]["medians"][("transfers", name)] / ops
            table.add_row(name, str(world), str(ops), f"{ours * 1e6:.0f}", f"{theirs * 1e6:.0f}",
                          f"{ours / theirs:.2f}x", f"{bare * 1e6:.0f}", f"{bare / theirs:.2f}x",
                          f"{floor * 1e6:.0f}", f"{floor / theirs:.2f}x")  # fmt: skip
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
