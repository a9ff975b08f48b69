"""Pipelined training with the optimizer step of cutpipe.train.optim, and its one-process twin
(spawned processes import the functions that run on every rank)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from cutpipe import generate
from cutpipe.models import mlp
from cutpipe.runtime import PipelineRunner
from cutpipe.train.optim import (
    accumulate,
    build_optimizer,
    clip_pipeline_grad_norm,
    warmup_cosine,
)

WIDTH = 16
PER_MICROBATCH = 2
#: AdamW with decay, warm-up then cosine, and a max norm below most steps' gradient norm
SETTINGS = {"lr": 1e-2, "weight_decay": 0.1, "warmup": 5, "min_lr_ratio": 0.1, "max_norm": 0.1}
#: the gradient norms measured after training, besides the clipped L2 norm
NORM_TYPES = (1.0, 2.0, float("inf"))


def model(seed: int = 5) -> nn.Sequential:
    """Seven Linear(16) + tanh blocks and a final Linear: eight layers, enough for eight stages."""
    head = nn.Linear(WIDTH, WIDTH)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.uniform_(-(WIDTH**-0.5), WIDTH**-0.5, generator=generator)
    return nn.Sequential(*mlp(blocks=7, width=WIDTH, seed=seed), head)


def data(
    step: int, m: int, per_microbatch: int = PER_MICROBATCH
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of optimizer step ``step``, the same on every rank and in the reference: fresh
    inputs, and targets from a fixed random teacher, so there is something to learn."""
    teacher = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(99)) / WIDTH**0.5
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(m * per_microbatch, WIDTH, generator=generator)
    return x, torch.tanh(x @ teacher)


def _optimizer(parameters, steps: int, warmup: int = SETTINGS["warmup"]):
    optimizer = build_optimizer(
        parameters, SETTINGS["lr"], SETTINGS["weight_decay"], betas=(0.9, 0.95), eps=1e-8
    )
    return optimizer, warmup_cosine(optimizer, warmup, steps, SETTINGS["min_lr_ratio"])


def reference(m: int, steps: int) -> dict:
    """One process trains the unsplit model the same way: the same microbatches one after the
    other (mean of their losses), torch's own clip_grad_norm_, the same optimizer and lr."""
    net = model()
    optimizer, scheduler = _optimizer(net.named_parameters(), steps)
    losses, norms = [], []

    def backward(step: int) -> float:
        x, y = data(step, m)
        total = 0.0
        for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
            loss = nn.functional.mse_loss(net(xi), yi)
            (loss / m).backward()
            total += float(loss.detach())
        return total / m

    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append(backward(step))
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), SETTINGS["max_norm"])))
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    backward(steps)
    grads = [p.grad for p in net.parameters()]
    final_norms = [float(torch.nn.utils.get_total_norm(grads, p)) for p in NORM_TYPES]
    layers = [[p.detach().clone() for p in layer.parameters()] for layer in net]
    return {"losses": losses, "norms": norms, "final_norms": final_norms, "layers": layers}


def _stage_parameters(runner: PipelineRunner) -> dict[int, list[list]]:
    return {
        stage: [p.detach().tolist() for p in module.parameters()]
        for stage, module in runner.modules.items()
    }


def training(rank: int, world: int, names: list[str], m: int, steps: int) -> list[dict]:
    """Each schedule: ``steps`` optimizer steps of pipelined training, then one more backward
    whose gradient norms (three orders, nothing clipped) are measured over the pipeline."""
    results = []
    for name in names:
        schedule = generate(name, world, m)
        runner = PipelineRunner.from_sequential(schedule, model(), nn.MSELoss())
        optimizer, scheduler = _optimizer(runner.modules, steps)
        losses, norms = [], []
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(runner.step(*data(step, m))))
            norms.append(float(clip_pipeline_grad_norm(runner, SETTINGS["max_norm"])))
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        runner.step(*data(steps, m))
        final_norms = [
            float(clip_pipeline_grad_norm(runner, float("inf"), norm_type=p)) for p in NORM_TYPES
        ]
        results.append(
            {
                "case": f"{name} R={world} m={m}",
                "name": name,
                "losses": losses,
                "norms": norms,
                "final_norms": final_norms,
                "stages": _stage_parameters(runner),
            }
        )
        runner.close()
    return results


def _train(
    runner: PipelineRunner,
    steps: int,
    m: int,
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> dict:
    optimizer, scheduler = _optimizer(runner.modules, steps, warmup=1)
    losses, norms = [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(backward(*data(step, m, 2 * PER_MICROBATCH))))
        norms.append(float(clip_pipeline_grad_norm(runner, SETTINGS["max_norm"])))
        grads = [p.grad.clone() for p in runner.parameters()]
        optimizer.step()
        scheduler.step()
    final = [p.detach().clone() for p in runner.parameters()]
    return {"losses": losses, "norms": norms, "grads": grads, "final": final}


def _relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(
        float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
        for x, y in zip(a, b, strict=True)
    )


def accumulation(rank: int, world: int, names: list[str], m: int, steps: int) -> list[dict]:
    """Each schedule trains twice from the same weights: ``accumulate`` over the two halves of
    each batch, and one runner step on the whole batch; report how far apart they end."""
    results = []
    for name in names:
        schedule = generate(name, world, m)
        start = model()
        runs = []
        for mode in ("accumulate", "whole"):
            runner = PipelineRunner.from_sequential(schedule, copy.deepcopy(start), nn.MSELoss())

            def backward(x, y, runner=runner, mode=mode):
                if mode == "whole":
                    return runner.step(x, y)
                half = len(x) // 2
                return accumulate(runner, [(x[:half], y[:half]), (x[half:], y[half:])])

            runs.append(_train(runner, steps, m, backward))
            runner.close()
        split, whole = runs
        results.append(
            {
                "case": f"{name} R={world} m={m}",
                "loss_error": _relative(
                    [torch.tensor(split["losses"])], [torch.tensor(whole["losses"])]
                ),
                "norm_error": _relative(
                    [torch.tensor(split["norms"])], [torch.tensor(whole["norms"])]
                ),
                "grad_error": _relative(split["grads"], whole["grads"]),
                "param_error": _relative(split["final"], whole["final"]),
                "clipped": sum(n > SETTINGS["max_norm"] for n in whole["norms"]),
            }
        )
    return results


def clipping(rank: int, world: int) -> dict:
    """clip_grad_norm over the world on hand-made gradients: mirrored copies counted once,
    non-finite norms on every rank, and every rank raising when asked to."""
    from cutpipe.runtime.clipping import clip_grad_norm

    def parameters(poison: float | None = None) -> list[nn.Parameter]:
        made = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))]
        made[0].grad = torch.tensor([3.0, 0.0, 4.0])
        made[1].grad = torch.full((2, 2), float(rank + 1))
        if poison is not None and rank == world - 1:
            made[1].grad[0, 0] = poison
        return made

    outcome: dict = {}
    # every rank holds the same first gradient: as two copies it counts once
    shared = [nn.Parameter(torch.zeros(3))]
    shared[0].grad = torch.tensor([3.0, 0.0, 4.0])
    outcome["copies"] = float(clip_grad_norm(shared, float("inf"), copies=world))
    held = parameters()
    outcome["norm"] = float(clip_grad_norm(held, 1.0))
    outcome["clipped"] = [p.grad.flatten().tolist() for p in held]
    for poison in (float("nan"), float("inf")):
        for norm_type in (2.0, float("inf")):
            key = f"{poison} {norm_type}"
            outcome[key] = float(clip_grad_norm(parameters(poison), 1.0, norm_type=norm_type))
            try:
                clip_grad_norm(
                    parameters(poison), 1.0, norm_type=norm_type, error_if_nonfinite=True
                )
                outcome[key + " raised"] = False
            except RuntimeError:
                outcome[key + " raised"] = True
    outcome.update(_sharded_clipping(world))
    return outcome


def _sharded_clipping(world: int) -> dict:
    """clip_grad_norm of DTensor gradients, as FSDP leaves them, with a pipeline of one rank: a
    parameter sharded unevenly over the world (3 rows on 2 ranks), a replicated DTensor and a
    plain one, each counted once."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from cutpipe.runtime.clipping import clip_grad_norm

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    alone, _ = dist.new_subgroups(1)  # this rank is its whole pipeline

    def parameters() -> list[nn.Parameter]:
        made = []
        for full, placement in (([3.0, 0.0, 4.0], Shard(0)), ([1.0, 1.0], Replicate())):
            parameter = nn.Parameter(distribute_tensor(torch.zeros(len(full)), mesh, [placement]))
            parameter.grad = distribute_tensor(torch.tensor(full), mesh, [placement])
            made.append(parameter)
        plain = nn.Parameter(torch.zeros(2))
        plain.grad = torch.tensor([2.0, 2.0])
        return [*made, plain]

    held = parameters()
    outcome = {"sharded": float(clip_grad_norm(held, 1.0, group=alone))}
    outcome["sharded clipped"] = [
        (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).tolist() for p in held
    ]
    outcome["sharded inf"] = float(
        clip_grad_norm(parameters(), 1.0, group=alone, norm_type=float("inf"))
    )
    return outcome


def two_ranks(
    rank: int, world: int, names: list[str], m: int, steps: int, trained: tuple[int, int]
) -> dict:
    """``accumulation``, ``clipping`` and ``training`` (``trained``: its microbatches and steps)
    in one launch (starting processes is the slow part)."""
    return {
        "accumulation": accumulation(rank, world, names, m, steps),
        "clipping": clipping(rank, world),
        "training": training(rank, world, names, *trained),
    }
