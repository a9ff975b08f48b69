"""What each rank runs in the data-parallel tests (spawned processes import this module)."""

from __future__ import annotations

import copy

import torch
from runtime_workers import batch, relative_error
from torch import nn

from cutpipe import generate
from cutpipe.models import mlp
from cutpipe.parallel.mesh import build_mesh
from cutpipe.runtime import PipelineRunner

WIDTH, STEPS, LR = 16, 3, 1e-2


def reference_steps(model: nn.Module, x, y, microbatches: int) -> list[dict[str, torch.Tensor]]:
    """One process, the whole batch: each step's gradients of the mean loss, then AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    grads = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        for xi, yi in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            (nn.functional.mse_loss(model(xi), yi) / microbatches).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return grads


def pp_x_dp(rank: int, world: int, cases: list[tuple[str, int, str]]) -> list[dict]:
    """PP2 x DP2: each replica its half of the batch, gradients averaged by the runner's
    reducer stage by stage; ``allreduce`` with AdamW, ``zero1`` with the optimizer state
    sharded over DP (torch's ZeroRedundancyOptimizer). Three steps against one process."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    mesh = build_mesh(pp=2, dp=2)
    results = []
    for name, m, mode in cases:
        schedule = generate(name, 2, m)
        model = mlp(blocks=8, width=WIDTH, seed=3)
        twin = copy.deepcopy(model)
        names = {id(p): n for n, p in model.named_parameters()}
        runner = PipelineRunner.from_sequential(
            schedule, model, nn.MSELoss(), group=mesh.pp_group, reducer=mesh.gradient_reducer()
        )
        held = runner.parameters()
        if mode == "zero1":
            optimizer = ZeroRedundancyOptimizer(
                held, optimizer_class=torch.optim.AdamW, process_group=mesh.dp_group, lr=LR
            )
        else:
            optimizer = torch.optim.AdamW(held, lr=LR)
        x, y = batch(2 * m, WIDTH)
        expected = reference_steps(twin, x, y, 2 * m)
        grad_errors = []
        for step in range(STEPS):
            optimizer.zero_grad()
            runner.step(mesh.shard(x), mesh.shard(y))
            grad_errors.append(
                max(relative_error(p.grad, expected[step][names[id(p)]]) for p in held)
            )
            optimizer.step()
        twins = dict(twin.named_parameters())
        results.append(
            {
                "case": f"{name} m={m} {mode} (pp, dp)=({mesh.pp_rank}, {mesh.dp_rank})",
                "grad_error": max(grad_errors),
                "param_error": max(relative_error(p, twins[names[id(p)]]) for p in held),
            }
        )
        runner.close()
    return results


class Recorder:
    """A reducer that notes when each stage was handed over, then lets ``inner`` reduce it."""

    def __init__(self, inner, runner_box: list) -> None:
        self.inner, self.runner_box, self.calls = inner, runner_box, []

    def stage_done(self, stage, parameters) -> None:
        self.calls.append((stage, self.runner_box[0].progress.ops_done))
        self.inner.stage_done(stage, parameters)

    def finish(self) -> None:
        self.calls.append(("finish", self.runner_box[0].progress.ops_done))
        self.inner.finish()


def reduction_points(rank: int, world: int, name: str, m: int) -> list:
    """When, in ops done this step, each stage's reduction started on this rank."""
    mesh = build_mesh(pp=2, dp=2)
    box: list = []
    recorder = Recorder(mesh.gradient_reducer(), box)
    runner = PipelineRunner.from_sequential(
        generate(name, 2, m), mlp(blocks=4, width=8, seed=0), nn.MSELoss(),
        group=mesh.pp_group, reducer=recorder,
    )  # fmt: skip
    box.append(runner)
    x, y = batch(2 * m, 8)
    before = runner.progress.ops_done
    runner.step(mesh.shard(x), mesh.shard(y))
    runner.close()
    return [(stage, done - before) for stage, done in recorder.calls]
