"""What each rank runs in the tests of torch's runtime on cutpipe schedules (spawned processes
import this module): torch.distributed.pipelining's own ``step`` drives the schedule."""

from __future__ import annotations

import copy

import torch
from runtime_workers import batch, reference, relative_error
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from cutpipe.interop import torch_pipelining
from cutpipe.models import mlp
from cutpipe.schedule.fileformat import load_schedule

WIDTH = 16


def stage_modules(model: nn.Sequential, stages: int) -> list[nn.Sequential]:
    per = len(model) // stages
    return [nn.Sequential(*list(model)[s * per : (s + 1) * per]) for s in range(stages)]


def torch_runs(rank: int, world: int, cases: list[tuple[str, str]]) -> list[dict]:
    """Each case (how, path): "csv" loads the file with torch's ``_load_csv``, "to_torch" loads
    it with cutpipe and hands it over with ``to_torch``. One step; gradients against the
    single-process reference (losses summed, as torch's ``scale_grads=False``)."""
    results = []
    for how, path in cases:
        schedule = load_schedule(path)
        model = mlp(blocks=2 * schedule.num_stages, width=WIDTH, seed=3)
        twin = copy.deepcopy(model)
        modules = stage_modules(model, schedule.num_stages)
        held = schedule.placement.stages_of(rank)
        stages = [
            PipelineStage(modules[s], s, schedule.num_stages, torch.device("cpu")) for s in held
        ]
        m = schedule.num_microbatches
        loss = nn.MSELoss()
        if how == "csv":
            runner = _PipelineScheduleRuntime(stages, m, loss_fn=loss, scale_grads=False)
            runner._load_csv(path)
        else:
            runner = torch_pipelining.to_torch(schedule, stages, loss, scale_grads=False)
        x, y = batch(m, WIDTH)
        first, last = 0 in held, schedule.num_stages - 1 in held
        losses: list = []
        runner.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        expected = reference(twin, x, y, m, "sum")
        twins = dict(zip(map(id, model.parameters()), twin.parameters(), strict=True))
        mine = [p for s in held for p in modules[s].parameters()]
        results.append(
            {
                "case": f"{how} {path}",
                "grad_error": max(relative_error(p.grad, twins[id(p)].grad) for p in mine),
                "loss": float(sum(losses)) if last else None,
                "expected": expected,
            }
        )
    return results
