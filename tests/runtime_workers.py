"""Functions the multi-process runtime tests run on every rank (spawned processes import them)."""

from __future__ import annotations

import copy
import json
from typing import Any

import torch
from torch import nn

from cutpipe import Costs, generate
from cutpipe.models import mlp
from cutpipe.runtime import PipelineError, PipelineRunner
from cutpipe.sim import metrics, peak_activations, simulate
from cutpipe.sim.fit import measured_delays, replayed


def batch(
    m: int, width: int, per_microbatch: int = 3, seed: int = 7
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(per_microbatch * m, width, generator=generator)
    y = torch.randn(per_microbatch * m, width, generator=generator)
    return x, y


def reference(model: nn.Module, x, y, m: int, reduction: str) -> float:
    """The single-process answer: the same microbatches, one after the other."""
    total = 0.0
    for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
        loss = nn.functional.mse_loss(model(xi), yi)
        (loss / m if reduction == "mean" else loss).backward()
        total += float(loss)
    return total / m if reduction == "mean" else total


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def exactness(rank: int, world: int, cases: list[tuple[str, int, str]]) -> list[dict]:
    """Each case: train one step and evaluate once; compare with the single-process reference."""
    results = []
    for name, m, reduction in cases:
        schedule = generate(name, world, m)
        model = mlp(blocks=8, width=16, seed=3)
        twin = copy.deepcopy(model)
        x, y = batch(m, 16)
        runner = PipelineRunner.from_sequential(
            schedule, model, nn.MSELoss(), loss_reduction=reduction
        )
        loss = runner.step(x, y)
        peak = runner.peak_activation_units
        expected = reference(twin, x, y, m, reduction)
        held = runner.parameters()
        twins = dict(zip(map(id, model.parameters()), twin.parameters(), strict=True))
        grad_error = max(relative_error(p.grad, twins[id(p)].grad) for p in held)
        with torch.no_grad():
            evaluated = runner.step(x, y)
        predicted = peak_activations(schedule, Costs(w_memory=0.5))[rank]
        results.append(
            {
                "case": f"{name} R={world} m={m} {reduction}",
                "loss": float(loss),
                "expected": expected,
                "eval": float(evaluated),
                "grad_error": grad_error,
                "peak": peak,
                "predicted_peak": predicted,
            }
        )
        runner.close()
    return results


def shapes(rank: int, world: int) -> list[float]:
    """Boundaries of any shape and dtype, and a batch shape that changes between steps."""

    class Pair(nn.Module):  # returns (hidden, an integer mask): two tensors, two dtypes
        def __init__(self, width: int) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x, mask=None):
            mask = (x > 0).to(torch.int32) if mask is None else mask
            return torch.tanh(self.linear(x * mask)), mask

    class Head(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.linear = nn.Linear(width, 3)

        def forward(self, x, mask):
            return self.linear(x).to(torch.float64)  # a dtype change on the way out

    schedule = generate("1f1b", world, 4)
    torch.manual_seed(0)
    layers = [Pair(6) for _ in range(world - 1)] + [Head(6)]
    stages = {rank: layers[rank]}
    runner = PipelineRunner(schedule, stages, lambda out, t: (out - t).pow(2).mean())
    losses = []
    for batch_size in (8, 12, 8):  # the second step changes shapes, the third changes them back
        x = torch.randn(batch_size, 6, generator=torch.Generator().manual_seed(batch_size))
        y = torch.zeros(batch_size, 3, dtype=torch.float64)
        losses.append(float(runner.step(x, y)))
    runner.close()
    return losses


def emulated(rank: int, world: int, cases: list[tuple[str, int]], unit: float) -> list[dict]:
    """Time-emulated steps, gathered on rank 0: the measured bubble beside the simulator's, fed
    the nominal costs and fed every op's measured duration."""
    results = []
    for name, m in cases:
        schedule = generate(name, world, m)
        costs = Costs(f=1, b=1, w=1, fb=2.5).scaled(0.5 if schedule.placement.kind == "v" else 1)
        runner = PipelineRunner(schedule, None, emulate=costs, time_unit=unit, record_timeline=True)
        runner.step()
        measured = runner.timeline()
        runner.close()
        if rank == 0:
            observed = metrics(measured, costs)
            delays = measured_delays(measured)
            replay = replayed(measured, delays)
            results.append(
                {
                    "case": f"{name} R={world} m={m}",
                    "measured": observed.bubble_ratio,
                    "replayed": metrics(replay, costs).bubble_ratio,
                    "latency": delays.latency,
                    "overhead": delays.overhead,
                    "simulated": metrics(simulate(schedule, costs), costs).bubble_ratio,
                    "makespan": measured.makespan,
                    "replayed_makespan": replay.makespan,
                }
            )
    return results


def four_ranks(
    rank: int, world: int, emulated_cases: list[tuple[str, int]], unit: float,
    exact_cases: list[tuple[str, int, str]],
) -> dict[str, list]:  # fmt: skip
    """The 4-rank launches in one: ``emulated`` first (while nothing else has run), then
    ``exactness``."""
    return {
        "emulated": emulated(rank, world, emulated_cases, unit),
        "exactness": exactness(rank, world, exact_cases),
    }


def bad_inputs(rank: int, world: int, cases: list[str]) -> dict[str, str]:
    """Each case breaks one rule; report what this rank raised. Cases that fail before any
    boundary value moves leave every rank free to go on to the next one."""
    schedule = generate("1f1b", world, 4)
    model = mlp(blocks=4, width=8)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    outcomes = {}
    for case in cases:
        try:
            if case == "ranks":
                PipelineRunner.from_sequential(generate("1f1b", world + 1, 4), model, nn.MSELoss())
            elif case == "modules":
                PipelineRunner(schedule, {rank + 1: nn.Linear(8, 8)}, nn.MSELoss())
            elif case == "not a module":
                PipelineRunner(schedule, {rank: "a linear layer"}, nn.MSELoss())
            elif case == "timeout":
                PipelineRunner.from_sequential(schedule, model, step_timeout=float("nan"))
            elif case == "local loss":  # not an error: the loss stays where it is computed
                losses = []
                for everywhere in (False, True):
                    runner = PipelineRunner.from_sequential(
                        schedule, model, nn.MSELoss(), loss_on_every_rank=everywhere
                    )
                    loss = runner.step(x, y)
                    losses.append(None if loss is None else round(float(loss), 6))
                    runner.close()
                outcomes[case] = json.dumps(losses)
                continue
            else:
                finite = case == "finite"
                loss = (lambda out, t: (out - t) ** 2) if case == "loss" else nn.MSELoss()
                runner = PipelineRunner.from_sequential(schedule, model, loss, check_finite=finite)
                if case == "batch":
                    size = 7 if rank == 0 else 8
                    runner.step(torch.randn(size, 8), torch.randn(size, 8))
                elif case == "empty":
                    runner.step(torch.randn(0, 8) if rank == 0 else x, y)
                elif case == "targets":
                    runner.step(x, torch.randn(12, 8))
                elif case == "finite":
                    runner.step(torch.full((8, 8), float("nan")), y)
                else:
                    runner.step(x, y)
                runner.close()
            outcomes[case] = "no error"
        except (ValueError, TypeError, FloatingPointError, PipelineError) as error:
            outcomes[case] = f"{type(error).__name__}: {error}"
    return outcomes


class Recorded(nn.Module):
    """A stage that runs overlapped pairs itself, backward first, and counts them."""

    def __init__(self, layers: nn.Sequential) -> None:
        super().__init__()
        self.layers = layers
        self.pairs = 0

    def forward(self, x):
        return self.layers(x)

    def overlap_forward_backward(self, forward_task, backward_task) -> None:
        self.pairs += 1
        backward_task.run()
        forward_task.run()


def overlap_hook(rank: int, world: int) -> dict:
    m = 6
    schedule = generate("dualpipev", world, m)
    model = mlp(blocks=8, width=16, seed=5)
    twin = copy.deepcopy(model)
    per = len(model) // schedule.num_stages
    stages = {
        s: Recorded(nn.Sequential(*list(model)[s * per : (s + 1) * per]))
        for s in schedule.placement.stages_of(rank)
    }
    runner = PipelineRunner(schedule, stages, nn.MSELoss(), loss_reduction="sum")
    x, y = batch(m, 16)
    loss = float(runner.step(x, y))
    expected = reference(twin, x, y, m, "sum")
    twins = dict(zip(map(id, model.parameters()), twin.parameters(), strict=True))
    held = [p for stage in stages.values() for p in stage.parameters()]
    pairs = sum(1 for op in schedule.actions[rank] if type(op).__name__ == "Overlap")
    runner.close()
    return {
        "loss": loss,
        "expected": expected,
        "grad_error": max(relative_error(p.grad, twins[id(p)].grad) for p in held),
        "hook_calls": sum(s.pairs for s in stages.values()),
        "pairs": pairs,
    }


class Counting:
    """Wraps an executor or a transport and counts the calls the runner makes on it: a seam a
    CUDA-graph executor or an NCCL-specific transport would plug into the same way."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        value = getattr(self.inner, name)
        if not callable(value):
            return value

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return value(*args, **kwargs)

        return counted


def plugged(rank: int, world: int) -> dict:
    """A runner whose executor and transport come from the options' factories."""
    from cutpipe.runtime import RunnerOptions
    from cutpipe.runtime.protocols import default_executor, default_transport

    made: dict[str, Counting] = {}

    def executor(context):
        made["executor"] = Counting(default_executor(context))
        return made["executor"]

    def transport(context):
        made["transport"] = Counting(default_transport(context))
        return made["transport"]

    m = 4
    schedule = generate("zbv", world, m)
    model = mlp(blocks=8, width=16, seed=3)
    twin = copy.deepcopy(model)
    x, y = batch(m, 16)
    options = RunnerOptions(make_executor=executor, make_transport=transport)
    runner = PipelineRunner.from_sequential(schedule, model, nn.MSELoss(), options=options)
    loss = float(runner.step(x, y))
    expected = reference(twin, x, y, m, "mean")
    twins = dict(zip(map(id, model.parameters()), twin.parameters(), strict=True))
    grad_error = max(relative_error(p.grad, twins[id(p)].grad) for p in runner.parameters())
    runner.close()
    ops = schedule.actions[rank]
    return {
        "loss": loss,
        "expected": expected,
        "grad_error": grad_error,
        "executor": made["executor"].calls,
        "transport": made["transport"].calls,
        "forwards": sum(1 for op in ops if op.kind.name == "F"),
        "weights": sum(1 for op in ops if op.kind.name == "W"),
    }


def two_ranks(
    rank: int, world: int, exact_cases: list[tuple[str, int, str]], bad_cases: list[str]
) -> dict[str, Any]:
    """The 2-rank launches in one, every check that leaves the process group usable: the bad
    inputs last (each fails before any boundary value moves)."""
    return {
        "exactness": exactness(rank, world, exact_cases),
        "shapes": shapes(rank, world),
        "overlap_hook": overlap_hook(rank, world),
        "plugged": plugged(rank, world),
        "bad_inputs": bad_inputs(rank, world, bad_cases),
    }
