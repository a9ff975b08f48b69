"""How much of the data-parallel gradient reduction hides inside the pipeline's cool-down.

PP2 x DP2 on 4 gloo processes (one thread each), a stack of Linear(width)+tanh blocks, one
schedule. With ``--sleep MS`` every block's forward and backward also sleep that long, as a GPU
kernel leaves the CPU free: on this 2-core machine four processes computing for real leave no
idle core for gloo's reduction threads, so nothing can hide there; on GPUs (NCCL) the reduction
runs beside the kernels, which the sleep stands in for. Three ways to run a step, in alternating
rounds, each timed between barriers:

- ``overlapped``: the runner's reducer starts each stage's all-reduce as soon as the stage's last
  backward of the step has run (``PipelineRunner(reducer=mesh.gradient_reducer())``);
- ``after``: the same reductions, all started when the step's last op is done (what a reduction
  called after ``step()`` does);
- ``none``: no reduction (each replica alone: a timing baseline, not the same training).

The exposed reduction time is a variant's median step minus ``none``'s; the hidden share is
1 - overlapped's exposed time / after's. ``--picture FILE.png`` also draws one recorded
overlapped step: the ops of each rank, a mark where each stage's reduction starts, and a bar for
the wait at the step's end.

    python benchmarks/dp_overlap.py [--schedule zbv] [--width 512] [--sleep 5] [--rounds 15]
                                    [--picture F]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from cutpipe import generate
from cutpipe.launch import run
from cutpipe.models import mlp
from cutpipe.parallel.mesh import build_mesh
from cutpipe.runtime import PipelineRunner
from cutpipe.runtime.program import RankProgram

MODES = ("overlapped", "after", "none")


class Sleep(torch.autograd.Function):
    """Identity that sleeps in its forward and its backward: compute that leaves the CPU free."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


class Sleepy(nn.Module):
    def __init__(self, block: nn.Module, seconds: float) -> None:
        super().__init__()
        self.block, self.seconds = block, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Sleep.apply(self.block(x), self.seconds)


def model(width: int, sleep: float) -> nn.Sequential:
    blocks = mlp(blocks=8, width=width, seed=0)
    return nn.Sequential(*(Sleepy(b, sleep) for b in blocks)) if sleep else blocks


class AfterStep:
    """A reducer that holds every stage back until the step has ended, then reduces them all."""

    def __init__(self, inner) -> None:
        self.inner, self.waiting = inner, []

    def stage_done(self, stage, parameters) -> None:
        self.waiting.append((stage, parameters))

    def finish(self) -> None:
        for stage, parameters in self.waiting:
            self.inner.stage_done(stage, parameters)
        self.waiting.clear()
        self.inner.finish()


class Clocked:
    """A reducer that notes how long ``finish`` waited for the reductions in flight."""

    def __init__(self, inner) -> None:
        self.inner, self.finish_seconds = inner, 0.0

    def stage_done(self, stage, parameters) -> None:
        self.inner.stage_done(stage, parameters)

    def finish(self) -> None:
        begin = time.perf_counter()
        self.inner.finish()
        self.finish_seconds = time.perf_counter() - begin


def measure(
    rank: int, world: int, name: str, width: int, rounds: int, m: int, sleep: float
) -> dict:
    torch.set_num_threads(1)
    mesh = build_mesh(pp=2, dp=2)
    schedule = generate(name, 2, m)
    runners = {}
    for mode in MODES:
        reducer = {"overlapped": mesh.gradient_reducer(),
                   "after": AfterStep(mesh.gradient_reducer()), "none": None}[mode]  # fmt: skip
        runners[mode] = PipelineRunner.from_sequential(
            schedule, model(width, sleep), nn.MSELoss(), group=mesh.pp_group,
            reducer=reducer,
        )  # fmt: skip
    x = torch.randn(2 * m * 32, width, generator=torch.Generator().manual_seed(0))
    x, y = mesh.shard(x), mesh.shard(x.flip(1))
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(rounds + 1):
        for mode in MODES if round_ % 2 else reversed(MODES):
            dist.barrier()
            start = time.perf_counter()
            runners[mode].step(x, y)
            dist.barrier()
            if round_:  # the first round warms up
                times[mode].append(time.perf_counter() - start)
    clocked = Clocked(mesh.gradient_reducer())
    recorder = PipelineRunner.from_sequential(
        schedule, model(width, sleep), nn.MSELoss(), group=mesh.pp_group,
        reducer=clocked, record_timeline=True,
    )  # fmt: skip
    recorder.step(x, y)
    recorder.step(x, y)
    timeline = recorder.timeline()  # on the pipeline's first rank, with every rank's times
    result = {
        "medians": {mode: statistics.median(values) for mode, values in times.items()},
        "timeline": timeline.to_dict() if timeline is not None else None,
        "finish_seconds": clocked.finish_seconds,
        "coordinate": (mesh.pp_rank, mesh.dp_rank),
    }
    for runner in (*runners.values(), recorder):
        runner.close()
    return result


def draw(results: list[dict], path: str) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from cutpipe.sim import Timeline
    from cutpipe.viz import png, scene

    first = next(r for r in results if r["coordinate"] == (0, 0))
    timeline = Timeline.from_dict(first["timeline"])
    figure, _ = png.render(scene([timeline]))
    axes = next(a for a in figure.axes if a.get_label() == "panel 0")
    for result in results:
        pp_rank, dp_rank = result["coordinate"]
        if dp_rank:
            continue
        program = RankProgram(timeline.schedule, pp_rank)
        ends = timeline.ends[pp_rank]
        for index, stages in program.grads_done.items():
            for stage in stages:
                axes.plot([ends[index]], [pp_rank + 0.42], marker="v", color="#c51b7d",
                          markersize=7)  # fmt: skip
                axes.annotate(f"stage {stage}", (ends[index], pp_rank + 0.42), fontsize=6,
                              xytext=(2, -8), textcoords="offset points", color="#c51b7d")  # fmt: skip
        low = ends[-1]
        axes.plot([low, low + result["finish_seconds"]], [pp_rank - 0.42] * 2, color="#c51b7d",
                  linewidth=3)  # fmt: skip
    right = max(timeline.ends[r["coordinate"][0]][-1] + r["finish_seconds"] for r in results)
    axes.set_xlim(right=right * 1.01)
    figure.legend(
        handles=[
            Line2D([], [], marker="v", color="#c51b7d", linestyle="",
                   label="a stage's DP all-reduce starts"),
            Line2D([], [], color="#c51b7d", linewidth=3,
                   label="the wait for the reductions still in flight"),
            Patch(color="none", label="(DP replica 0 shown; replica 1 runs the same)"),
        ],
        loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=8, ncol=3, frameon=False,
    )  # fmt: skip
    figure.savefig(path, dpi=110, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="zbv")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sleep", type=float, default=0.0,
                        help="milliseconds every block's forward and backward also sleep")  # fmt: skip
    parser.add_argument("--picture", help="draw one recorded overlapped step here (.png)")
    args = parser.parse_args()
    results = run(
        measure,
        4,
        (args.schedule, args.width, args.rounds, args.microbatches, args.sleep / 1e3),
        timeout=900,
    )
    medians = results[0]["medians"]
    none = medians["none"]
    print(f"{args.schedule}, PP2 x DP2, width {args.width}, sleep {args.sleep:g} ms, m={args.microbatches}, "
          f"median of {args.rounds} alternating rounds:")  # fmt: skip
    for mode in MODES:
        print(f"  {mode:10s} {medians[mode] * 1e3:7.2f} ms  (+{(medians[mode] - none) * 1e3:.2f})")
    exposed_after, exposed_overlapped = medians["after"] - none, medians["overlapped"] - none
    if exposed_after > 0:
        print(f"  hidden: {1 - exposed_overlapped / exposed_after:.0%} of the reduction time")
    if args.picture:
        draw(results, args.picture)
        print(f"wrote {args.picture}")


if __name__ == "__main__":
    main()
