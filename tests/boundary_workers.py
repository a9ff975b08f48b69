"""Functions the step-boundary tests run on every rank (spawned processes import them), and the
single-process reference they are compared with."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from cutpipe import generate
from cutpipe.models import mlp

WIDTH = 8
#: steps whose inputs are scaled up so that clipping triggers, and the step given a NaN
LOUD_STEPS = frozenset({3, 11, 12, 19, 26})
NAN_STEP = 7
MAX_NORM = 1.0
#: how late the last rank comes to each round of ``first_word_early`` (seconds)
LATE = 0.6


def data(step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch: a few steps loud enough to be clipped, one with a NaN."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(2 * m, WIDTH, generator=generator)
    y = torch.randn(2 * m, WIDTH, generator=generator)
    if step in LOUD_STEPS:
        y = y * 40
    if step == NAN_STEP:
        x[0, 0] = math.nan
    return x, y


def make_optimizer(kind: str, parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    if kind.startswith("adamw"):
        return torch.optim.AdamW(parameters, lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)


def schedule_for(lr: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A learning rate that moves every step, so a redo must use the step's own."""
    return torch.optim.lr_scheduler.LambdaLR(lr, lambda step: 1.0 / (1 + 0.1 * step))


def reference(kind: str, m: int, steps: int) -> tuple[list[torch.Tensor], int, int]:
    """One process, torch's own clipping, a non-finite step skipped: the parameters after
    ``steps`` steps, how many steps were clipped and how many skipped."""
    model = mlp(blocks=4, width=WIDTH, seed=3)
    optimizer = make_optimizer(kind, list(model.parameters()))
    rate = schedule_for(optimizer)
    clipped = skipped = 0
    for step in range(steps):
        x, y = data(step, m)
        for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
            (nn.functional.mse_loss(model(xi), yi) / m).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if not math.isfinite(norm):
            skipped += 1
        else:
            clipped += float(norm) > MAX_NORM
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rate.step()
    return [p.detach().clone() for p in model.parameters()], clipped, skipped


def train(
    name: str, m: int, kind: str, boundary: str, steps: int, mesh=None
) -> tuple[dict, int, list]:
    """This rank's parameters (by name) after ``steps`` pipeline steps, its rollbacks, and the
    losses: returned by each step (sync), or carried by each step's verdict (overlap)."""
    from cutpipe.runtime import PipelineRunner

    ranks = torch.distributed.get_world_size(None if mesh is None else mesh.pp_group)
    schedule = generate(name, ranks, m)
    parallel = {} if mesh is None else {"group": mesh.pp_group, "reducer": mesh.gradient_reducer()}
    runner = PipelineRunner.from_sequential(
        schedule, mlp(blocks=4, width=WIDTH, seed=3), nn.MSELoss(),
        clip_grad_norm=MAX_NORM, skip_nonfinite=True, step_boundary=boundary, **parallel,
    )  # fmt: skip
    optimizer = make_optimizer(kind, runner.parameters())
    rate = schedule_for(optimizer)
    autocast = kind.endswith("bf16")
    losses = []
    for step in range(steps):
        batch = data(step, m) if mesh is None else map(mesh.shard, data(step, 2 * m))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = runner.step(*batch, optimizer=optimizer)
        rate.step()
        if boundary == "sync":
            losses.append(float(loss))
        elif step > 0:
            losses.append(runner.verdict.loss)
    if boundary == "overlap":
        losses.append(runner.settle().loss)
    result = {name: p.detach().clone() for name, p in runner.named_parameters().items()}
    rollbacks = runner.rollbacks
    runner.close()
    return result, rollbacks, losses


def post_validation(rank: int, world: int, cases: list[tuple[str, int, str]], steps: int) -> list:
    """Each case trained with both boundaries: bitwise equality, and (fp32) the error against
    torch's clipping on one process."""
    results = []
    for name, m, kind in cases:
        synced, _, returned = train(name, m, kind, "sync", steps)
        overlapped, rollbacks, carried = train(name, m, kind, "overlap", steps)
        expected, clipped, skipped = reference(kind, m, steps)
        named = dict(zip(
            [n for n, _ in mlp(blocks=4, width=WIDTH, seed=3).named_parameters()], expected,
            strict=True,
        ))  # fmt: skip
        error = (
            max(
                float((synced[key] - named[key]).abs().max() / named[key].abs().max())
                for key in synced
            )
            if not kind.endswith("bf16")
            else None
        )
        results.append({
            "case": f"{name} m={m} {kind}",
            "bitwise": all(torch.equal(synced[k], overlapped[k]) for k in synced),
            "error": error,
            "rollbacks": rollbacks,
            "losses": (returned, carried),
            "clipped": clipped,
            "skipped": skipped,
        })  # fmt: skip
    return results


def post_validation_dp(rank: int, world: int, steps: int) -> dict:
    """PP2 x DP2, each replica half of every batch (the NaN of step 7 in one replica's half):
    the two boundaries bitwise equal, and every clipped or skipped step rolled back."""
    from cutpipe.parallel.mesh import build_mesh

    mesh = build_mesh(pp=2, dp=2)
    synced, _, _ = train("zbv", 4, "adamw", "sync", steps, mesh)
    overlapped, rollbacks, _ = train("zbv", 4, "adamw", "overlap", steps, mesh)
    return {
        "bitwise": all(torch.equal(synced[k], overlapped[k]) for k in synced),
        "rollbacks": rollbacks,
    }


def four_ranks(rank: int, world: int, setting: Any, steps: int) -> dict[str, Any]:
    """The 4-rank launches in one: the emulated step timing of ``setting`` first (while nothing
    else has run), then ``post_validation_dp`` for ``steps`` steps."""
    from cutpipe.bench.boundaries import measure_rank

    return {
        "timing": measure_rank(rank, world, setting),
        "dp": post_validation_dp(rank, world, steps),
    }


def first_word_early(rank: int, world: int) -> dict[str, dict]:
    """Two rounds of the step agreement with the last rank late to each, on the point-to-point
    exchange and on the all-gather: how long the other ranks waited for rank 0's word, and
    whether every rank got every word."""
    import time

    import torch.distributed as dist

    from cutpipe.runtime.failure.heartbeat import Progress
    from cutpipe.runtime.transport.collectives import Collectives

    results = {}
    for kind in ("exchange", "all-gather"):
        collectives = Collectives(
            dist.group.WORLD, list(range(world)), rank, Progress(), early_first_word=True,
            exchange=kind == "exchange",
        )  # fmt: skip
        waits, complete = [], True
        for step in range(2):
            if rank == world - 1:
                time.sleep(LATE)
            word = torch.tensor([step, rank, 7], dtype=torch.int64)
            words = collectives.start_gather(word, f"round {step}")
            began = time.perf_counter()
            first = words.first()
            waits.append(time.perf_counter() - began)
            complete &= first.tolist() == [step, 0, 7]
            complete &= words().tolist() == [[step, r, 7] for r in range(world)]
            dist.barrier()
        results[kind] = {"waits": waits, "complete": complete}
    return results
